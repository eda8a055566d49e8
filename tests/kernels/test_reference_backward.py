"""The numpy backward references against an independent check: central finite differences of
the float64 forward (loss = <forward(...), r> for a random r), every input coordinate."""

import numpy as np
import pytest

from vmstoolkit.kernels import reference as R

H = 1e-6  # float64 central differences: error ~ H^2 * f''' + eps / H ~ 1e-10 relative


def numeric_grad(f, args, i, r):
    """d<f(*args), r>/d args[i], by central differences over every coordinate."""
    x = args[i]
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + H
        up = np.sum(f(*args) * r)
        x[idx] = old - H
        dn = np.sum(f(*args) * r)
        x[idx] = old
        g[idx] = (up - dn) / (2 * H)
    return g


def close(got, want, rtol=1e-6):
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= rtol * max(1.0, np.max(np.abs(want))), np.max(np.abs(got - want))


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_linear(rng):
    x, w = rng.standard_normal((5, 4)), rng.standard_normal((3, 4))
    r = rng.standard_normal((5, 3))
    close(R.linear_backward_x(r, w), numeric_grad(R.linear, [x, w], 0, r))
    acc = rng.standard_normal((3, 4))
    close(R.linear_backward_w(r, x, acc) - acc, numeric_grad(R.linear, [x, w], 1, r))


def test_rmsnorm(rng):
    x, w = rng.standard_normal((3, 6)), 1 + 0.1 * rng.standard_normal(6)
    r = rng.standard_normal((3, 6))
    f = lambda x, w: R.rmsnorm(x, w, 1e-5)  # noqa: E731
    dx, dw = R.rmsnorm_backward(x, w, r, 1e-5)
    close(dx, numeric_grad(f, [x, w], 0, r))
    close(dw, numeric_grad(f, [x, w], 1, r))


def test_rope(rng):
    x = rng.standard_normal((2, 5, 3, 6))
    r = rng.standard_normal(x.shape)
    close(R.rope_backward(r, 500.0), numeric_grad(lambda x: R.rope(x, 500.0), [x], 0, r))


@pytest.mark.parametrize("nh, nkv", [(2, 2), (4, 2), (3, 1)])
def test_attention_gqa(rng, nh, nkv):
    b, t, hd = 1, 5, 4
    q, k, v = (rng.standard_normal((b, t, n, hd)) for n in (nh, nkv, nkv))
    r = rng.standard_normal((b, t, nh, hd))
    o, lse = R.attention_lse(q, k, v)
    # lse is the log of the softmax denominator: recompute it the slow way
    s = np.einsum("bihd,bjhd->bhij", q, np.repeat(k, nh // nkv, axis=2)) / np.sqrt(hd)
    want_lse = [[[np.log(np.sum(np.exp(s[0, h, i, : i + 1]))) for i in range(t)] for h in range(nh)]]
    close(lse, np.array(want_lse))
    dq, dk, dv = R.attention_backward(q, k, v, o, lse, r)
    for i, got in enumerate((dq, dk, dv)):
        close(got, numeric_grad(R.attention, [q, k, v], i, r))


def test_swiglu(rng):
    g, u = 3 * rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    r = rng.standard_normal((4, 5))
    dg, du = R.swiglu_backward(g, u, r)
    close(dg, numeric_grad(R.swiglu, [g, u], 0, r))
    close(du, numeric_grad(R.swiglu, [g, u], 1, r))


def test_adamw_matches_the_algorithm_written_out_step_by_step(rng):
    """AdamW as torch.optim.AdamW documents it, written independently, over three steps."""
    w, m, v = rng.standard_normal(7), np.zeros(7), np.zeros(7)
    w0 = w.copy()
    lr, b1, b2, eps, wd = 1e-2, 0.8, 0.95, 1e-8, 0.1
    mm, vv = np.zeros(7), np.zeros(7)
    for step in range(1, 4):
        g = rng.standard_normal(7)
        w, m, v = R.adamw(w, g, m, v, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step)
        w0 = w0 - lr * wd * w0
        mm = b1 * mm + (1 - b1) * g
        vv = b2 * vv + (1 - b2) * g**2
        w0 = w0 - lr * (mm / (1 - b1**step)) / (np.sqrt(vv / (1 - b2**step)) + eps)
        close(w, w0, 1e-12)
    with pytest.raises(ValueError, match="step counts from 1"):
        R.adamw(w, g, m, v, lr=lr, step=0)
