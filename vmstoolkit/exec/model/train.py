"""Training a checkpoint's blocks under a GPU budget, LoRA or full fine-tuning, with the training
graph of ``experiment train-offload`` (:mod:`vmstoolkit.exec.train_graph`) over the checkpoint's
own weights.

What a step is, as in train-offload: the forward of every block saving what backward needs, the
backward, an AdamW update of each trainable tensor. The loss (``loss="lm"``, the default) is the
causal-LM loss ``transformers`` computes (``LlamaForCausalLM(ids, labels=ids).loss``): the
checkpoint's final norm and LM head over the last block's output, softmax cross-entropy against
the next token, averaged over the ``seq - 1`` rows that have one
(:mod:`vmstoolkit.exec.train_graph`, ``loss="lm"``); each row's ``loss``. ``loss="dot"`` is
train-offload's ``<blocks(x), dout>`` with ``dout`` random with the seed, or given. ``x`` is the
checkpoint's embedding of the token ids. The embedding, the final norm and the LM head are not
trained (their gradients are not in the graph), and every step of a run times the same step
from the checkpoint's weights (updates are new tensors; the runtime never
writes a value). Qwen2's q/k/v biases are in the LoRA graph, frozen (``bias_add`` after the
projection: the gradient passes through unchanged); full fine-tuning would have to train them and
is refused for Qwen2 in one line.

Gradients: on the sim backend (small models) every run is compared with the float64 numpy
reference (``max_abs_grad_err``); the tests compare them with torch.autograd on the tiny
checkpoints (fixtures of ``scripts/make_tiny_checkpoints.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from vmstoolkit.exec.backends import backend_kind
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.errors import BudgetTooSmallError, CheckpointError, InvalidOptionError
from vmstoolkit.exec.experiment import require_gpus
from vmstoolkit.exec.graph import LlamaConfig, TensorKind
from vmstoolkit.exec.model.checkpoint import Checkpoint, load_model
from vmstoolkit.exec.host_plan import TRAIN_LABELS, check_host_budget, default_host_budget, host_plan
from vmstoolkit.exec.model.progress import Stages
from vmstoolkit.exec.plan_cache import Plan
from vmstoolkit.exec.train_experiment import SIM_CHECK_FLOPS, parse_budget
from vmstoolkit.exec.train_graph import VARIANTS, AdamWConfig, TrainGraph, build_train_step, lm_labels

HF_PROJ = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
           "wg": "mlp.gate_proj", "wu": "mlp.up_proj", "wd": "mlp.down_proj"}
HF_NORM = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def build_model_train_step(ckpt: Checkpoint, seq: int, variant: str = "lora", *, rank: int = 16,
                           adamw: AdamWConfig | None = None, loss: str = "lm") -> TrainGraph:
    """The training graph of ``seq`` positions of ``ckpt``'s blocks, with its head for ``loss="lm"``."""
    return build_train_step(train_config(ckpt, seq), variant, rank=rank, adamw=adamw, loss=loss,
                            vocab=ckpt.config.vocab if loss == "lm" else None)


def train_config(ckpt: Checkpoint, seq: int) -> LlamaConfig:
    """The training graph's shape for ``seq`` positions of ``ckpt``'s blocks."""
    c = ckpt.config
    return LlamaConfig(qkv_bias=c.qkv_bias, n_blocks=c.n_blocks, seq=seq, hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, ffn=c.ffn,
                       eps=c.eps, rope_theta=c.rope_theta,
                       head_size=c.head_dim if c.head_dim * c.heads != c.hidden else None)


def hf_name(name: str, tied: bool = False) -> str | None:
    """``b3.wq`` -> ``model.layers.3.self_attn.q_proj.weight``, ``norm`` -> ``model.norm.weight``,
    ``lm_head`` -> ``lm_head.weight`` (``model.embed_tokens.weight`` when ``tied``); None for
    other tensors."""
    if name == "norm":
        return "model.norm.weight"
    if name == "lm_head":
        return "model.embed_tokens.weight" if tied else "lm_head.weight"
    if not name.startswith("b") or "." not in name:
        return None
    blk, _, rest = name.partition(".")
    if not blk[1:].isdigit():
        return None
    if rest in HF_PROJ:
        return f"model.layers.{blk[1:]}.{HF_PROJ[rest]}.weight"
    if rest in HF_NORM:
        return f"model.layers.{blk[1:]}.{HF_NORM[rest]}.weight"
    if rest.endswith(".bias") and rest[:-5] in HF_PROJ:
        return f"model.layers.{blk[1:]}.{HF_PROJ[rest[:-5]]}.bias"
    return None


def train_values(ckpt: Checkpoint, tg: TrainGraph, ids, *, dout: np.ndarray | None = None,
                 adapters: dict[str, np.ndarray] | None = None, seed: int = 0, copy: bool = False) -> dict[int, np.ndarray]:
    """Host values of a step: the checkpoint's weights (views of the mapped file, or with
    ``copy`` writable copies, which the cuda backend registers in place), ``x`` = the embedding
    of ``ids``, ``dout`` (given, or N(0, 1) from ``seed``), LoRA adapters (given by name, or A ~
    N(0, 1/in) and B ~ N(0, 0.01/r) from ``seed``: B is not zero so that A gets a gradient in
    the first step), AdamW moments at zero; with ``loss="lm"`` the final norm, the LM head and
    ``labels`` (:func:`~vmstoolkit.exec.train_graph.lm_labels` of ``ids``)."""
    rng = np.random.default_rng(seed)
    emb = ckpt.get("model.embed_tokens.weight")
    out = {}
    for t in tg.graph.tensors:
        if t.kind is TensorKind.ACTIVATION:
            continue
        n = t.name
        if t.id == tg.x:
            a = np.ascontiguousarray(emb[np.asarray(ids, np.int64)], np.float32)
        elif t.id == tg.labels:
            a = lm_labels(ids)
        elif t.id == tg.dout:
            a = np.asarray(dout, np.float32) if dout is not None else rng.standard_normal(t.shape, dtype=np.float32)
        elif n.endswith((".adam_m", ".adam_v")):
            a = np.zeros(t.shape, np.float32)
        elif ".lora_" in n:
            if adapters is not None and n in adapters:
                a = np.asarray(adapters[n], np.float32)
            elif n.endswith(".lora_a"):
                a = rng.standard_normal(t.shape, dtype=np.float32) / np.float32(np.sqrt(t.shape[1]))
            else:
                a = rng.standard_normal(t.shape, dtype=np.float32) * np.float32(0.1 / np.sqrt(t.shape[1]))
        else:
            hf = hf_name(n, ckpt.config.tied)
            if hf is None:
                raise CheckpointError(f"no checkpoint tensor for training tensor {n!r}")
            a = ckpt.get(hf)
            if copy:
                a = np.array(a)
        if a.shape != t.shape:
            raise CheckpointError(f"training tensor {n!r}: shape {a.shape}, the graph needs {t.shape}")
        out[t.id] = a
    return out


def train_token_ids(ckpt: Checkpoint, seq: int, seed: int = 0) -> np.ndarray:
    """The token ids of a step when none are given: ``seq`` uniform ids from ``seed``."""
    return np.random.default_rng(seed).integers(0, ckpt.config.vocab, seq)


def run_train(model, *, variant: str = "lora", budgets=("0.5",), seq: int = 2048, steps: int = 3, rank: int = 16,
              backend: str = "sim", n_gpus: int = 1, host_budget: int | None = -1, executors=("event-driven",),
              check_grads: bool | None = None, seed: int = 0, jitter: float = 0.0, adamw: AdamWConfig | None = None,
              token_ids=None, stages: Stages | None = None, loss: str = "lm") -> Iterator[dict]:
    """Rows of ``experiment train-offload``'s keys (``budget``, ``executor``, ``variant``,
    ``step_s`` (mean over the steps after the first; on cuda one untimed step before them all
    compiles the kernels), ``lower_bound_s``, ``offloaded_bytes``,
    ``reloaded_bytes``, ``recomputed_flops``, ``plan_s``, ``max_abs_grad_err``), with the model,
    ``loss`` (the step's loss with ``loss="lm"`` where the run computes: the last step's; None
    for a timing-only simulation or ``loss="dot"``), the host plan (:mod:`vmstoolkit.exec.host_plan`) and ``steps_s`` (every step), one per (budget, executor).

    ``budgets``: sizes or fractions in (0, 1] of the step's working set. ``host_budget``: bytes,
    None (no check) or -1 (the default: available memory less a margin); a plan above it is
    refused in one line before any value is read or backend made."""
    from vmstoolkit.exec.train_experiment import _Cuda, _Sim

    stages = stages or Stages()
    if variant not in VARIANTS:
        raise InvalidOptionError(f"unknown variant {variant!r} (choose one of {', '.join(VARIANTS)})")

    kind = backend_kind(backend)
    backend, real = kind.value, kind.real
    if n_gpus != 1:
        raise InvalidOptionError(f"--gpus {n_gpus}: the training graph runs on one GPU (pipeline stages are "
                                 f"generation's only)")
    if real:
        require_gpus(n_gpus)
    with stages.stage("loading the checkpoint"):
        ckpt = model if isinstance(model, Checkpoint) else load_model(model)
        if ckpt.config.qkv_bias and variant == "full":
            raise CheckpointError(f"{ckpt.folder.name}: full fine-tuning of a {ckpt.config.model_type} checkpoint is "
                                  f"not supported: the graph does not train its q/k/v biases (--variant lora keeps "
                                  f"them frozen)")
    with stages.stage("building the training graph"):
        tg = build_model_train_step(ckpt, seq, variant, rank=rank, adamw=adamw, loss=loss)
    ws_cache: list[int] = []

    def ws() -> int:
        if not ws_cache:
            with stages.stage("measuring the working set"):
                ws_cache.append(working_set(tg.graph))
        return ws_cache[0]

    resolved = [(b, parse_budget(b, ws)) for b in budgets]
    if check_grads is None:
        check_grads = not real and sum(v.flops for v in tg.graph.vertices) <= SIM_CHECK_FLOPS
    hb = default_host_budget() if host_budget == -1 else host_budget
    ids = np.asarray(token_ids, np.int64) if token_ids is not None else train_token_ids(ckpt, seq, seed)
    if len(ids) != seq:
        raise InvalidOptionError(f"{len(ids)} token ids for a step of seq={seq}")
    tied = ckpt.config.tied
    mapped = {t.id for t in tg.graph.tensors if t.kind is TensorKind.WEIGHT and hf_name(t.name, tied) is not None
              and ckpt.is_mapped(hf_name(t.name, tied))}
    runner = _Cuda(check_grads) if real else _Sim(seed, jitter, check_grads)
    values = None
    warm = False
    try:
        planned = []  # every budget planned and its host memory checked before anything is allocated
        for spec, budget in resolved:
            t0 = time.perf_counter()
            with stages.stage(f"planning at {spec}"):
                try:
                    mg = compile_memory_graph(tg.graph, budget)
                except BudgetTooSmallError as e:
                    planned.append((spec, budget, None, None, str(e)))
                    continue
            plan = Plan(seq, tg, mg, time.perf_counter() - t0)
            hp = host_plan(mg, mapped=mapped, pinned_copies=real, pin="register" if real else None,
                           sim_numerics=not real and check_grads,
                           reference=real and check_grads, materialized=runner.needs_values)
            check_host_budget(hp, hb, labels=TRAIN_LABELS)
            planned.append((spec, budget, plan, hp, None))
        # pinned staging is bounded by the plans: the runner's one pool serves every budget
        runner.staging_limit = max((p[3].staging for p in planned if p[3] is not None), default=0)
        for spec, budget, plan, hp, error in planned:
            if error is not None:
                yield from ({"budget": budget, "budget_spec": str(spec), "executor": ex, "variant": variant,
                             "model": str(ckpt.folder), "error": error} for ex in executors)
                continue
            mg = plan.memory
            if values is None and runner.needs_values:
                with stages.stage("reading the weights"):
                    values = train_values(ckpt, tg, ids, seed=seed, copy=real)
            if real and not warm:
                with stages.stage("JIT compiling the kernels (an untimed step)"):
                    runner.run(plan, executors[0], values, 0)
                warm = True
            for ex in executors:
                spans, errs, lbs = [], [], []
                runner.last_loss = None
                with stages.stage(f"{steps} step(s) at {spec}, {ex}"):
                    for i in range(steps):
                        span, lb, err = runner.run(plan, ex, values, i)
                        spans.append(span)
                        lbs.append(lb)
                        if err is not None:
                            errs.append(err)
                steady = spans[1:] or spans
                yield {"budget": budget, "budget_spec": str(spec), "executor": ex, "variant": variant,
                       "step_s": float(np.mean(steady)), "lower_bound_s": float(np.mean(lbs[1:] or lbs)),
                       "offloaded_bytes": mg.offloaded_bytes, "reloaded_bytes": mg.reloaded_bytes,
                       "recomputed_flops": mg.recomputed_flops, "plan_s": plan.plan_s / steps,
                       "max_abs_grad_err": max(errs) if errs else None, "loss": runner.last_loss, "steps_s": spans,
                       "loss_kind": loss, "seq": seq, "rank": rank,
                       "model": str(ckpt.folder), "model_type": ckpt.config.model_type, "backend": backend,
                       "working_set": ws_cache[0] if ws_cache else None, "peak_bytes": max(mg.peak_bytes),
                       "host_budget": hb, **hp.as_row()}
    finally:
        runner.close()
