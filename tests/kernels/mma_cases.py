"""Helper of the tensor-core GEMM tests (not a test module): random bf16 operands and the three
layouts' cases. Imported by name (pytest puts this folder on sys.path)."""

import numpy as np

from vmstoolkit.kernels import mma_layout


def bits(rng, shape):
    """bf16 bits (uint16) of standard normal values."""
    return mma_layout.bf16_bits(rng.standard_normal(shape).astype(np.float32))


def layout_cases(rng, m, n, k):
    """(x, w, dy, cases): x (m, k), w (n, k), dy (m, n) bf16 bits, and per layout of
    ``gemm_bf16`` (y = x w^T, dx = dy w, dw = dy^T x) ``(layout, launcher, a, b, out shape)``."""
    from vmstoolkit.kernels import gemm_bf16 as GB

    x, w, dy = bits(rng, (m, k)), bits(rng, (n, k)), bits(rng, (m, n))
    return x, w, dy, (("nn", GB.gemm_bf16, x, w, (m, n)), ("nt", GB.linear_dx_bf16, dy, w, (m, k)),
                      ("tt", GB.linear_dw_bf16, dy, x, (n, k)))
