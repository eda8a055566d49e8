import numpy as np
import pytest
from numba import cuda

from vmstoolkit.kernels import LlamaBlockConfig, llama_block_forward
from vmstoolkit.kernels import reference as R

SMALL = LlamaBlockConfig(hidden_size=16, n_heads=4, n_kv_heads=2, ffn_size=24, rms_eps=1e-5,
                         rope_theta=500.0)


def make_weights(config, rng):
    w = {}
    for name, shape in config.weight_shapes().items():
        if len(shape) == 1:
            w[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w[name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return w


def ref(x, w, c):
    return R.llama_block(x, w, c.n_heads, c.n_kv_heads, c.rms_eps, c.rope_theta)


@pytest.mark.parametrize("config", [SMALL, LlamaBlockConfig(hidden_size=8, n_heads=2,
                                                            n_kv_heads=2, ffn_size=12)])
def test_block_matches_reference_numpy_in_numpy_out(config, rng, rel_err):
    w = make_weights(config, rng)
    x = rng.standard_normal((2, 5, config.hidden_size)).astype(np.float32)  # (B, T, H)
    out = llama_block_forward(x, w, config)
    assert isinstance(out, np.ndarray) and out.shape == x.shape and out.dtype == np.float32
    assert rel_err(out, ref(x, w, config)) <= 1e-5


def test_block_device_in_device_out(rng, rel_err):
    w = make_weights(SMALL, rng)
    dw = {k: cuda.to_device(v) for k, v in w.items()}
    x = rng.standard_normal((1, 9, 16)).astype(np.float32)  # (B, T, H), ragged vs the tiles
    out = llama_block_forward(cuda.to_device(x), dw, SMALL)
    assert not isinstance(out, np.ndarray)
    assert rel_err(out.copy_to_host(), ref(x, w, SMALL)) <= 1e-5


def test_bad_inputs_raise(rng):
    w = make_weights(SMALL, rng)
    x = np.zeros((1, 3, 16), np.float32)
    with pytest.raises(ValueError, match="n_heads=4 is not divisible by n_kv_heads=3"):
        llama_block_forward(x, w, LlamaBlockConfig(16, 4, 3, 24))
    with pytest.raises(ValueError, match="float64"):
        llama_block_forward(x.astype(np.float64), w, SMALL)
    with pytest.raises(ValueError, match=r"expected \(batch, seq, 16\)"):
        llama_block_forward(np.zeros((1, 3, 8), np.float32), w, SMALL)
    bad = dict(w)
    bad["mlp.up_proj.weight"] = bad["mlp.up_proj.weight"].T.copy()
    with pytest.raises(ValueError, match="mlp.up_proj.weight"):
        llama_block_forward(x, bad, SMALL)
    bad = dict(w)
    del bad["self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        llama_block_forward(x, bad, SMALL)
    bad = dict(w)
    bad["self_attn.q_proj.bias"] = np.zeros(16, np.float32)
    with pytest.raises(ValueError, match="unexpected"):
        llama_block_forward(x, bad, SMALL)
    bad = dict(w)
    bad["input_layernorm.weight"] = bad["input_layernorm.weight"].astype(np.float64)
    with pytest.raises(ValueError, match="float64"):
        llama_block_forward(x, bad, SMALL)
