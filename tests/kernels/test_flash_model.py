"""The per-lane model of the bf16 flash-attention forward (``kernels/flash_model.py``) against
the numpy references: the register reuse of P as an mma A operand, the quad reductions, and the whole
walk (causal, GQA, ragged T, head dims 16, 64 and 128) against ``bf16.reference_attention``. CPU only
(numpy), a few hundred mma-layout calls: well under a second."""

import numpy as np
import pytest

from vmstoolkit.kernels import bf16 as B
from vmstoolkit.kernels import flash_model as F
from vmstoolkit.kernels import mma_layout as L


def test_p_accumulators_are_the_a_fragment_of_p(rng):
    s0, s1 = (rng.standard_normal((32, 4)).astype(np.float32) for _ in range(2))
    p = np.concatenate([L.c_matrix(s0), L.c_matrix(s1)], axis=1)  # (16, 16)
    assert np.array_equal(L.a_matrix(F.scores_to_a(s0, s1)), L.bf16_bits(p))
    # and not by accident: the tiles swapped give another matrix
    assert not np.array_equal(L.a_matrix(F.scores_to_a(s1, s0)), L.bf16_bits(p))


def test_quad_reductions(rng):
    v = rng.standard_normal(32).astype(np.float32)
    assert np.array_equal(F.quad_max(v), np.repeat(v.reshape(8, 4).max(1), 4))
    assert np.allclose(F.quad_sum(v), np.repeat(v.reshape(8, 4).sum(1), 4), rtol=1e-6)


@pytest.mark.parametrize("b, t, nh, nkv, d", [(1, 21, 4, 2, 16), (2, 17, 2, 1, 64), (1, 9, 2, 2, 128),
                                              (1, 1, 1, 1, 16)])
def test_warp_walk_equals_the_reference(rng, b, t, nh, nkv, d):
    q = B.to_bits(rng.standard_normal((b, t, nh, d)))
    k = B.to_bits(rng.standard_normal((b, t, nkv, d)))
    v = B.to_bits(rng.standard_normal((b, t, nkv, d)))
    got = F.forward(q, k, v)
    want = B.reference_attention(B.values(q), B.values(k), B.values(v), round_p=True)
    rel = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert rel <= 2 * B.UNIT_ROUNDOFF, rel
    assert np.mean(got != want) <= 0.05
    if t > 1:  # the test sees an off-by-one key index (keys shifted by one position)
        bad = F.forward(q, np.roll(k, 1, axis=1), v)
        assert np.mean(bad != want) > 0.2
