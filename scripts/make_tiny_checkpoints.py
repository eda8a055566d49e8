"""Write the tiny Hugging Face checkpoints of ``tests/data/checkpoints/`` and transformers' own
answers on them (the fixtures the CPU tests compare ``vmstoolkit run`` against).

Needs torch and transformers (``/work/venv-torch``); the tests never import this script. Every
checkpoint is random weights from a fixed seed, float32, saved by ``save_pretrained`` with
safetensors, computed on the CPU:

=================== ======== ====== ===== ======= ===================================
name                arch     tied   bias  shards  shape
=================== ======== ====== ===== ======= ===================================
llama-tied          llama    yes    no    1       2 blocks, hidden 32, heads 4 / kv 2
llama-sharded       llama    no     no    3+      2 blocks, hidden 48, heads 4 / kv 2,
                                                  head_dim 16 (not hidden / heads)
mistral             mistral  no     no    1       2 blocks, hidden 32, heads 4 / kv 1,
                                                  rope_theta 1e6, sliding window unused
qwen2               qwen2    yes    q/k/v 2       2 blocks, hidden 32, heads 4 / kv 2
=================== ======== ====== ===== ======= ===================================

Beside each checkpoint, ``fixture.npz``: ``prompt_ids`` (int64), ``prefill_logits`` (T, vocab),
``tokens`` (greedy ``generate``, ``max_new_tokens`` of them), ``min_margin`` (the smallest gap
between the best and second logit over the greedy steps: greedy tokens are only comparable when
it is well above fp32 noise); for the checkpoints in ``TRAIN``, the training check of
``vmstoolkit.exec.model``: ``train_x`` (the embedded prompt), ``train_dout`` and, per variant,
the gradients of ``sum(blocks(x) * dout)`` by torch.autograd (``grad.full.<name>``,
``grad.lora.<name>``, names as in ``vmstoolkit.exec.train_graph``) with the LoRA adapters used
(``lora.<name>``, rank ``LORA_RANK``).

Beside it, ``fixture_lm.npz`` (:func:`lm_grads`): the causal-LM loss transformers computes
(``model(ids, labels=ids).loss``) without adapters (``loss.full``) and with the LoRA adapters of
``fixture.npz`` (``loss.lora``), and its gradients by torch.autograd (``grad.full.<name>``,
``grad.lora.<name>``). ``--lm-only`` writes just these files, from the shipped checkpoints and
adapters (the checkpoints and ``fixture.npz`` stay byte for byte as they are).

    /work/venv-torch/bin/python scripts/make_tiny_checkpoints.py [OUT_DIR]
    /work/venv-torch/bin/python scripts/make_tiny_checkpoints.py --lm-only [OUT_DIR]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "checkpoints"
PROMPT_LEN = 7
NEW_TOKENS = 6
LORA_RANK = 2
TRAIN = ("llama-tied", "llama-sharded", "mistral", "qwen2")  # qwen2: LoRA only (its biases frozen)
PROJ = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
        "wg": "mlp.gate_proj", "wu": "mlp.up_proj", "wd": "mlp.down_proj"}
NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def configs():
    common = dict(vocab_size=96, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, torch_dtype="float32")
    return {
        "llama-tied": (transformers.LlamaConfig(hidden_size=32, num_key_value_heads=2, tie_word_embeddings=True,
                                                rope_theta=10000.0, **common), None, 0),
        "llama-sharded": (transformers.LlamaConfig(hidden_size=48, num_key_value_heads=2, head_dim=16,
                                                   tie_word_embeddings=False, rope_theta=500000.0, **common),
                          "20KB", 1),
        "mistral": (transformers.MistralConfig(hidden_size=32, num_key_value_heads=1, sliding_window=None,
                                               tie_word_embeddings=False, rope_theta=1e6, **common), None, 2),
        "qwen2": (transformers.Qwen2Config(hidden_size=32, num_key_value_heads=2, tie_word_embeddings=True,
                                           use_sliding_window=False, rope_theta=1e6, **common), "60KB", 3),
    }


def make_model(cfg, seed):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a missed one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 / p.shape[-1]) ** 0.5 * 2.0)
    return model


def greedy(model, ids):
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    toks = out.sequences[0, len(ids):].tolist()
    margins = []
    for s in out.scores:
        top = torch.topk(s[0].double(), 2).values
        margins.append(float(top[0] - top[1]))
    return toks, min(margins)


def train_grads(model, ids, seed):
    """Gradients of sum(blocks(embed(ids)) * dout), full and LoRA, by torch.autograd."""
    g = torch.Generator().manual_seed(seed + 100)
    hidden = model.config.hidden_size
    dout = torch.randn(len(ids), hidden, generator=g)
    out = {"train_dout": dout.numpy()}
    layers = model.model.layers
    captured = {}

    def grab(mod, inp, outp):
        captured["h"] = outp[0] if isinstance(outp, tuple) else outp

    hook = layers[-1].register_forward_hook(grab)
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        out["train_x"] = model.model.embed_tokens(ids_t)[0].numpy().copy()
    # full: every block parameter
    model.zero_grad()
    for p in model.parameters():
        p.requires_grad_(True)
    model.model(input_ids=ids_t)
    (captured["h"].reshape(len(ids), hidden) * dout).sum().backward()
    for i, layer in enumerate(layers):
        for short, mod in PROJ.items():
            out[f"grad.full.b{i}.{short}"] = layer.get_submodule(mod).weight.grad.numpy().copy()
        for short, mod in NORMS.items():
            out[f"grad.full.b{i}.{short}"] = layer.get_submodule(mod).weight.grad.numpy().copy()
    # LoRA: y = x W^T + (x A^T) B^T on the seven projections, base frozen
    model.zero_grad()
    for p in model.parameters():
        p.requires_grad_(False)
    adapters, hooks = {}, []
    for i, layer in enumerate(layers):
        for short, mod in PROJ.items():
            lin = layer.get_submodule(mod)
            a = (torch.randn(LORA_RANK, lin.in_features, generator=g) / lin.in_features ** 0.5).requires_grad_(True)
            b = (torch.randn(lin.out_features, LORA_RANK, generator=g) * 0.1 / LORA_RANK ** 0.5).requires_grad_(True)
            adapters[f"b{i}.{short}"] = (a, b)
            hooks.append(lin.register_forward_hook(lambda m, inp, o, a=a, b=b: o + (inp[0] @ a.T) @ b.T))
    model.model(input_ids=ids_t)
    (captured["h"].reshape(len(ids), hidden) * dout).sum().backward()
    for name, (a, b) in adapters.items():
        out[f"lora.{name}.lora_a"] = a.detach().numpy().copy()
        out[f"lora.{name}.lora_b"] = b.detach().numpy().copy()
        out[f"grad.lora.{name}.lora_a"] = a.grad.numpy().copy()
        out[f"grad.lora.{name}.lora_b"] = b.grad.numpy().copy()
    for h in hooks + [hook]:
        h.remove()
    return out


def lm_grads(model, ids, adapters: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The causal-LM loss ``model(ids, labels=ids).loss`` and its gradients by torch.autograd:
    every block parameter's without adapters (``full``), and the adapters' with
    ``y = x W^T + (x A^T) B^T`` on the seven projections, base frozen (``lora``); ``adapters``:
    ``b{i}.{proj}.lora_a`` / ``.lora_b`` -> array."""
    ids_t = torch.tensor([ids])
    layers = model.model.layers
    out = {}
    model.zero_grad()
    for p in model.parameters():
        p.requires_grad_(True)
    loss = model(input_ids=ids_t, labels=ids_t).loss
    loss.backward()
    out["loss.full"] = np.array(loss.item())
    for i, layer in enumerate(layers):
        for short, mod in {**PROJ, **NORMS}.items():
            out[f"grad.full.b{i}.{short}"] = layer.get_submodule(mod).weight.grad.numpy().copy()
    model.zero_grad()
    for p in model.parameters():
        p.requires_grad_(False)
    hooks, params = [], {}
    for i, layer in enumerate(layers):
        for short, mod in PROJ.items():
            a = torch.tensor(adapters[f"b{i}.{short}.lora_a"]).requires_grad_(True)
            b = torch.tensor(adapters[f"b{i}.{short}.lora_b"]).requires_grad_(True)
            params[f"b{i}.{short}"] = (a, b)
            hooks.append(layer.get_submodule(mod).register_forward_hook(
                lambda m, inp, o, a=a, b=b: o + (inp[0] @ a.T) @ b.T))
    loss = model(input_ids=ids_t, labels=ids_t).loss
    loss.backward()
    out["loss.lora"] = np.array(loss.item())
    for name, (a, b) in params.items():
        out[f"grad.lora.{name}.lora_a"] = a.grad.numpy().copy()
        out[f"grad.lora.{name}.lora_b"] = b.grad.numpy().copy()
    for h in hooks:
        h.remove()
    return out


def write_lm_fixture(d: Path, model, ids, fx: dict) -> None:
    adapters = {k[len("lora."):]: v for k, v in fx.items() if k.startswith("lora.")}
    np.savez_compressed(d / "fixture_lm.npz", **lm_grads(model, ids, adapters))


def lm_only(out_dir: Path) -> None:
    """``fixture_lm.npz`` of every shipped checkpoint in ``TRAIN``, from its files and adapters."""
    torch.set_grad_enabled(True)
    for name in TRAIN:
        d = out_dir / name
        model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
        with np.load(d / "fixture.npz") as f:
            fx = {k: f[k] for k in f.files}
        write_lm_fixture(d, model, fx["prompt_ids"].tolist(), fx)
        with np.load(d / "fixture_lm.npz") as f:
            print(f"{name}: fixture_lm.npz, loss {float(f['loss.full']):.6f} / lora {float(f['loss.lora']):.6f}")


def main(out_dir: Path) -> None:
    torch.set_grad_enabled(True)
    manifest = {"transformers": transformers.__version__, "torch": torch.__version__, "device": "cpu",
                "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "lora_rank": LORA_RANK, "checkpoints": {}}
    for name, (cfg, shard, seed) in configs().items():
        d = out_dir / name
        if d.exists():
            shutil.rmtree(d)
        model = make_model(cfg, seed)
        kw = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(d, safe_serialization=True, **kw)
        for extra in ("generation_config.json",):  # the runtime reads config.json only
            (d / extra).unlink(missing_ok=True)
        ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, PROMPT_LEN).tolist()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].numpy()
            toks, margin = greedy(model, ids)
        if margin < 1e-3:
            raise SystemExit(f"{name}: greedy margin {margin:.2e} is too close to a tie; change its seed")
        fx = {"prompt_ids": np.array(ids, np.int64), "prefill_logits": logits, "tokens": np.array(toks, np.int64),
              "min_margin": np.array(margin)}
        if name in TRAIN:
            fx.update(train_grads(model, ids, seed))
        np.savez_compressed(d / "fixture.npz", **fx)
        if name in TRAIN:
            write_lm_fixture(d, model, ids, fx)
        files = sorted(p.name for p in d.iterdir())
        manifest["checkpoints"][name] = {"files": files, "min_margin": margin, "tokens": toks}
        print(f"{name}: {files}, greedy {toks}, min margin {margin:.3g}")
    (out_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--lm-only"]
    (lm_only if "--lm-only" in sys.argv[1:] else main)(Path(args[0]) if args else OUT)
