"""RMSNorm, RoPE, SwiGLU and residual add against the references."""

import numpy as np
import pytest
from numba import cuda

from vmstoolkit.kernels import reference as R
from vmstoolkit.kernels import residual, rmsnorm, rope, swiglu


def test_rmsnorm_validate_and_other_eps():
    rmsnorm.validate()
    rmsnorm.validate(shapes=((2, 3),), eps=0.5)


def test_rmsnorm_bad_weight_shape():
    x = cuda.to_device(np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match="rmsnorm weight"):
        rmsnorm.rmsnorm(x, cuda.to_device(np.ones(3, np.float32)), cuda.device_array((2, 4), np.float32))


def test_rope_validate_theta_offset():
    rope.validate()
    rope.validate(shapes=((2, 4, 3, 10),), theta=500.0, offset=7)


def test_rope_in_place(rng, rel_err):
    x = rng.standard_normal((2, 6, 3, 8), dtype=np.float32)  # (B, T, nh, hd)
    d = cuda.to_device(x)
    rope.rope(d, d, theta=10000.0)
    assert rel_err(d.copy_to_host(), R.rope(x)) <= 1e-5


def test_rope_really_rotates(rng):
    # A reference check that can fail: position 0 is the identity, later positions are not.
    x = rng.standard_normal((1, 3, 1, 4), dtype=np.float32)
    d = cuda.device_array(x.shape, np.float32)
    rope.rope(cuda.to_device(x), d)
    got = d.copy_to_host()
    np.testing.assert_allclose(got[:, 0], x[:, 0], rtol=1e-6)
    assert not np.allclose(got[:, 2], x[:, 2])


def test_rope_odd_head_dim_raises():
    x = cuda.to_device(np.ones((1, 2, 1, 5), np.float32))
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope.rope(x, x)


def test_swiglu_and_residual_validate():
    swiglu.validate()
    residual.validate()


def test_swiglu_shape_mismatch_raises():
    a = cuda.to_device(np.ones((2, 3), np.float32))
    b = cuda.to_device(np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match="must have one shape"):
        swiglu.swiglu(a, b, cuda.device_array((2, 3), np.float32))
    with pytest.raises(ValueError, match="must have one shape"):
        residual.residual_add(a, b, cuda.device_array((2, 3), np.float32))
