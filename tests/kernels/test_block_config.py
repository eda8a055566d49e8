"""LlamaBlockConfig speaks Hugging Face's names (issue 18) and keeps the short ones."""

import dataclasses
from types import SimpleNamespace

import pytest

from vmstoolkit.kernels import LlamaBlockConfig


def hf_like(**over):
    base = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=160,
                rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", rope_scaling=None,
                attention_bias=False, mlp_bias=False, head_dim=8)
    base.update(over)
    return SimpleNamespace(**base)


def test_hf_keyword_names_and_short_properties():
    c = LlamaBlockConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=160, rms_norm_eps=1e-5, rope_theta=5e5)
    assert (c.n_heads, c.n_kv_heads, c.ffn_size, c.rms_eps, c.head_dim) == (8, 2, 160, 1e-5, 8)
    assert c == LlamaBlockConfig(hidden_size=64, n_heads=8, n_kv_heads=2, ffn_size=160, rms_eps=1e-5,
                                 rope_theta=5e5)
    assert c == LlamaBlockConfig(64, 8, 2, 160, 1e-5, 5e5)
    assert dataclasses.replace(c, num_key_value_heads=8).n_kv_heads == 8
    c.check()


def test_kv_heads_default_to_heads_like_hf():
    assert LlamaBlockConfig(hidden_size=64, num_attention_heads=4).num_key_value_heads == 4
    assert LlamaBlockConfig().n_kv_heads == LlamaBlockConfig().n_heads == 16


def test_from_hf_reads_any_object_with_the_attributes():
    c = LlamaBlockConfig.from_hf(hf_like())
    assert c == LlamaBlockConfig(64, 8, 2, 160, 1e-5, 500000.0)
    assert LlamaBlockConfig.from_hf(hf_like(num_key_value_heads=None)).n_kv_heads == 8
    v5 = hf_like(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    del v5.rope_theta
    assert LlamaBlockConfig.from_hf(v5).rope_theta == 1e6


@pytest.mark.parametrize("over, match", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling 'llama3'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"head_dim": 16}, "head_dim=16"),
])
def test_from_hf_refuses_what_the_kernels_do_not_compute(over, match):
    with pytest.raises(ValueError, match=match):
        LlamaBlockConfig.from_hf(hf_like(**over))


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="n_head"):
        LlamaBlockConfig(n_head=4)
