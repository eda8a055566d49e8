"""Loading a Hugging Face folder without torch: sharded and unsharded, tied and untied, Qwen2's
biases, head_dim from the config, memory-mapped float32, widened float16 and bfloat16; and one
line naming the problem for every folder the runtime cannot run."""

import json
import shutil

import numpy as np
import pytest

from tests.exec.model.helpers import folder
from vmstoolkit.exec.errors import CheckpointError
from vmstoolkit.exec.model import load_model
from vmstoolkit.exec.model.checkpoint import hf_names


def test_unsharded_tied_llama():
    ck = load_model(folder("llama-tied"))
    c = ck.config
    assert (c.model_type, c.tied, c.qkv_bias, c.heads, c.kv_heads, c.head_dim) == ("llama", True, False, 4, 2, 8)
    assert "lm_head.weight" not in hf_names(c) and "lm_head.weight" not in ck.names()
    assert c.rope_theta == 10000.0 and c.eps == 1e-5


def test_sharded_untied_llama_with_its_own_head_dim():
    ck = load_model(folder("llama-sharded"))
    c = ck.config
    assert (c.hidden, c.head_dim, c.q_dim, c.tied, c.rope_theta) == (48, 16, 64, False, 500000.0)
    assert ck.get("lm_head.weight").shape == (96, 48)
    assert len({e.shard for e in ck._entries.values()}) > 3
    assert ck.get("model.layers.1.self_attn.o_proj.weight").shape == (48, 64)


def test_qwen2_biases_and_mistral_gqa():
    q = load_model(folder("qwen2"))
    assert q.config.qkv_bias and q.get("model.layers.0.self_attn.k_proj.bias").shape == (16,)
    m = load_model(folder("mistral")).config
    assert (m.kv_heads, m.rope_theta, m.sliding_window) == (1, 1e6, None)


def test_float32_tensors_are_views_of_the_mapped_file():
    ck = load_model(folder("llama-tied"))
    a = ck.get("model.embed_tokens.weight")
    assert ck.is_mapped("model.embed_tokens.weight") and not a.flags.writeable
    assert isinstance(a.base, np.memmap) or isinstance(a.base.base, np.memmap)


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_precision_checkpoints_are_widened_to_float32(tmp_path, dtype):
    from safetensors.numpy import save_file

    src = load_model(folder("llama-tied"))
    d = tmp_path / "half"
    d.mkdir()
    shutil.copy(folder("llama-tied") / "config.json", d)
    tensors = {}
    for n in src.names():
        a = np.ascontiguousarray(src.get(n))
        tensors[n] = a.astype(np.float16) if dtype == "F16" else (a.view(np.uint32) >> 16).astype(np.uint16)
    save_file(tensors, str(d / "model.safetensors"))
    if dtype == "BF16":  # safetensors' numpy writer has no bfloat16: relabel the uint16 bits
        raw = bytearray((d / "model.safetensors").read_bytes())
        n = int.from_bytes(raw[:8], "little")
        header = raw[8:8 + n].decode().strip().replace('"U16"', '"BF16"').encode()
        header = header.ljust(-(-len(header) // 8) * 8)  # offsets count from the header's end
        (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n:])
    ck = load_model(d)
    w = ck.get("model.layers.0.mlp.up_proj.weight")
    want = src.get("model.layers.0.mlp.up_proj.weight")
    assert w.dtype == np.float32 and not ck.is_mapped("model.layers.0.mlp.up_proj.weight")
    np.testing.assert_allclose(w, want, rtol=1e-2 if dtype == "BF16" else 1e-3, atol=1e-3)


def copy_of(name, tmp_path):
    d = tmp_path / name
    shutil.copytree(folder(name), d)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None and k.startswith("-"):
            cfg.pop(k[1:], None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def one_line_error(d, match):
    with pytest.raises(CheckpointError, match=match) as e:
        load_model(d)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("name,changes,match", [
    ("llama-tied", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     r"rope_parameters.rope_type='llama3' is not supported"),
    ("llama-tied", {"-rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
     r"rope_scaling=\{'type': 'linear', 'factor': 2.0\} is not supported"),
    ("llama-tied", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ("llama-tied", {"attention_bias": True}, r"attention_bias=True is not supported"),
    ("llama-tied", {"mlp_bias": True}, r"mlp_bias=True is not supported"),
    ("llama-tied", {"model_type": "gpt2"}, r"model_type='gpt2' is not supported"),
    ("llama-tied", {"architectures": ["LlamaForSequenceClassification"]}, r"architectures=\['LlamaForSequenceClassification'\]"),
    ("llama-tied", {"quantization_config": {"quant_method": "gptq"}}, r"quantization_config='gptq'"),
    ("llama-tied", {"num_key_value_heads": 3}, r"num_key_value_heads=3 is not supported"),
    ("llama-tied", {"head_dim": 7}, r"head_dim=7 is not supported"),
    ("llama-tied", {"rms_norm_eps": -1}, r"rms_norm_eps=-1"),
    ("llama-tied", {"vocab_size": 0}, r"vocab_size=0"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4}, r"use_sliding_window=True is not supported"),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types='sliding_attention'"),
])
def test_unsupported_configs_are_named_in_one_line(tmp_path, name, changes, match):
    d = copy_of(name, tmp_path)
    edit_config(d, **changes)
    one_line_error(d, match)


def test_a_sliding_window_is_refused_only_where_it_is_in_use(tmp_path):
    from vmstoolkit.exec.model.generate import generate

    d = copy_of("mistral", tmp_path)
    edit_config(d, sliding_window=8)
    assert load_model(d).config.sliding_window == 8
    assert len(generate(d, [1, 2, 3], 4)) == 4  # 6 positions: inside the window
    with pytest.raises(CheckpointError, match="sliding_window=8 is in use at 9 positions"):
        generate(d, [1, 2, 3, 4, 5], 5)


def test_corrupt_truncated_and_missing_shards(tmp_path):
    d = copy_of("qwen2", tmp_path)
    shard = d / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    msg = one_line_error(d, r"model-00002-of-00002.safetensors: corrupt or truncated safetensors file")
    shard.write_bytes(b"not a safetensors file at all")
    one_line_error(d, r"corrupt or truncated")
    shard.unlink()
    one_line_error(d, r"shard 'model-00002-of-00002.safetensors' named by model.safetensors.index.json is missing")
    assert "Traceback" not in msg


def test_missing_tensors_wrong_shapes_and_missing_files(tmp_path):
    from safetensors.numpy import save_file

    d = copy_of("llama-tied", tmp_path)
    ck = load_model(d)
    tensors = {n: np.ascontiguousarray(ck.get(n)) for n in ck.names()}
    del ck
    t2 = dict(tensors)
    del t2["model.layers.1.mlp.down_proj.weight"]
    save_file(t2, str(d / "model.safetensors"))
    one_line_error(d, r"tensor 'model.layers.1.mlp.down_proj.weight' is missing")
    t2 = dict(tensors, **{"model.norm.weight": np.ones(31, np.float32)})
    save_file(t2, str(d / "model.safetensors"))
    one_line_error(d, r"'model.norm.weight' has shape \[31\], config.json implies \[32\]")
    edit_config(d, tie_word_embeddings=False)
    save_file(tensors, str(d / "model.safetensors"))
    one_line_error(d, r"tensor 'lm_head.weight' is missing")
    (d / "model.safetensors").unlink()
    one_line_error(d, r"has no \*.safetensors file")
    (d / "config.json").write_text("{not json")
    one_line_error(d, r"config.json: not readable JSON")
    (d / "config.json").unlink()
    one_line_error(d, r"has no config.json")
    one_line_error(tmp_path / "nowhere", r"does not exist")


def test_corrupt_index(tmp_path):
    d = copy_of("qwen2", tmp_path)
    (d / "model.safetensors.index.json").write_text('{"weight_map": 3}')
    one_line_error(d, r"model.safetensors.index.json: not a shard index")


def test_transformers_4_spelling_of_rope_theta():
    from vmstoolkit.exec.model.config import parse_config

    cfg = json.loads((folder("llama-tied") / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=123.0, rope_scaling=None)
    assert parse_config(cfg).rope_theta == 123.0
