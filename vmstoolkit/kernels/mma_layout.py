"""Which lane of a warp owns which element: the fragment layouts of ``mma.sync.m16n8k16`` (bf16
in, fp32 accumulate) and what ``ldmatrix.m8n8.x4[.trans].b16`` delivers, as numpy, from the PTX
ISA's figures ("Matrix Fragments for mma.m16n8k16 with floating point type", "ldmatrix").

This is the CPU reference the tensor-core intrinsics (:mod:`._mma`) are tested against, and the
model their simulator twins compute from. Conventions: ``g = lane >> 2`` (the "group"),
``t = lane & 3`` (the thread in the group); a 32-bit register holding two b16 values keeps the
element of the lower column (k) in its lower 16 bits.

- A (16 x 16, row major): ``a[0]`` = A[g, 2t : 2t+2], ``a[1]`` = A[g+8, 2t : 2t+2],
  ``a[2]`` = A[g, 2t+8 : 2t+10], ``a[3]`` = A[g+8, 2t+8 : 2t+10];
- B (16 x 8, "col": k down the rows): ``b[0]`` = B[2t : 2t+2, g], ``b[1]`` = B[2t+8 : 2t+10, g];
- C and D (16 x 8, fp32): ``c[0], c[1]`` = C[g, 2t], C[g, 2t+1]; ``c[2], c[3]`` = C[g+8, 2t], C[g+8, 2t+1].
- ``ldmatrix .x4``: lanes 8j .. 8j+7 give the addresses of the 8 rows (8 b16 each, 16 bytes) of
  matrix j; lane ``l``'s register j holds matrix j's row ``g``, elements 2t and 2t+1; with
  ``.trans`` it holds column ``g``, elements (rows) 2t and 2t+1.

Cost: every function is O(32 x fragment) numpy work; they are for tests and simulators only.
"""

from __future__ import annotations

import numpy as np

from vmstoolkit.errors import KernelError

WARP = 32
M, N, K = 16, 8, 16  # the mma shape


def a_coords(lane: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """For each of the 4 A registers of ``lane``: ((row, col) of its low half, (row, col) of its high half)."""
    g, t = lane >> 2, lane & 3
    out = []
    for reg in range(4):
        r = g + 8 * (reg & 1)
        c = 2 * t + 8 * (reg >> 1)
        out.append(((r, c), (r, c + 1)))
    return out


def b_coords(lane: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """For each of the 2 B registers of ``lane``: ((k, n) of its low half, (k, n) of its high half)."""
    g, t = lane >> 2, lane & 3
    return [((2 * t + 8 * reg, g), (2 * t + 8 * reg + 1, g)) for reg in range(2)]


def c_coords(lane: int) -> list[tuple[int, int]]:
    """(row, col) of each of the 4 accumulators of ``lane``."""
    g, t = lane >> 2, lane & 3
    return [(g + 8 * (i >> 1), 2 * t + (i & 1)) for i in range(4)]


def pack(lo, hi) -> np.ndarray:
    """Two arrays of b16 bit patterns (uint16) -> the uint32 registers holding them (lo in the low half)."""
    return (np.asarray(hi, np.uint32) << 16) | np.asarray(lo, np.uint32)


def unpack(reg) -> tuple[np.ndarray, np.ndarray]:
    """uint32 registers -> (low halves, high halves) as uint16."""
    reg = np.asarray(reg, np.uint32)
    return (reg & 0xFFFF).astype(np.uint16), (reg >> 16).astype(np.uint16)


def bf16_bits(x) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(x, np.float32))
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def bf16_value(bits) -> np.ndarray:
    """bf16 bit patterns (uint16) -> their values as float32 (exact)."""
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def _coords(fn, regs: int) -> tuple[np.ndarray, ...]:
    """(rows, cols) index arrays (32, regs, 2) of ``fn``'s (lo, hi) coordinates, for fancy indexing."""
    c = np.array([fn(lane) for lane in range(WARP)])  # (32, regs, 2 halves, 2 coords)
    assert c.shape == (WARP, regs, 2, 2)
    return c[..., 0], c[..., 1]


_A_RC = _coords(a_coords, 4)
_B_RC = _coords(b_coords, 2)
_C_RC = tuple(np.array([c_coords(lane) for lane in range(WARP)])[..., i] for i in range(2))  # (32, 4) each


def a_fragments(a_bits: np.ndarray) -> np.ndarray:
    """A (16 x 16 uint16 bf16 bits) -> (32, 4) uint32: each lane's A registers."""
    _check(a_bits, (M, K))
    halves = np.asarray(a_bits, np.uint16)[_A_RC]  # (32, 4, 2)
    return pack(halves[..., 0], halves[..., 1])


def b_fragments(b_bits: np.ndarray) -> np.ndarray:
    """B (16 x 8, k by n, uint16 bf16 bits) -> (32, 2) uint32: each lane's B registers."""
    _check(b_bits, (K, N))
    halves = np.asarray(b_bits, np.uint16)[_B_RC]
    return pack(halves[..., 0], halves[..., 1])


def c_fragments(c: np.ndarray) -> np.ndarray:
    """C (16 x 8 float32) -> (32, 4) float32: each lane's accumulators."""
    _check(c, (M, N))
    return np.asarray(c, np.float32)[_C_RC]


def c_matrix(frags: np.ndarray) -> np.ndarray:
    """(32, 4) accumulators -> the 16 x 8 matrix they hold (inverse of :func:`c_fragments`)."""
    c = np.zeros((M, N), np.float32)
    c[_C_RC] = np.asarray(frags, np.float32)
    return c


def _matrix(frags, rc, shape) -> np.ndarray:
    out = np.zeros(shape, np.uint16)
    lo, hi = unpack(frags)
    out[rc[0][..., 0], rc[1][..., 0]] = lo
    out[rc[0][..., 1], rc[1][..., 1]] = hi
    return out


def a_matrix(frags: np.ndarray) -> np.ndarray:
    """(32, 4) uint32 A registers -> the 16 x 16 uint16 matrix they hold."""
    return _matrix(frags, _A_RC, (M, K))


def b_matrix(frags: np.ndarray) -> np.ndarray:
    """(32, 2) uint32 B registers -> the 16 x 8 uint16 matrix they hold."""
    return _matrix(frags, _B_RC, (K, N))


def mma(a_frags: np.ndarray, b_frags: np.ndarray, c_frags: np.ndarray) -> np.ndarray:
    """What ``mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32`` returns to each lane: (32, 4) float32
    ``D = A B + C`` from the lanes' registers (products exact in float64, rounded once to float32;
    the tensor core's own summation order may differ in the last bits)."""
    a = bf16_value(a_matrix(a_frags)).astype(np.float64)
    b = bf16_value(b_matrix(b_frags)).astype(np.float64)
    d = (a @ b + c_matrix(c_frags).astype(np.float64)).astype(np.float32)
    return c_fragments(d)


_LD_LANE = np.arange(WARP)
_LD_G, _LD_T = _LD_LANE >> 2, _LD_LANE & 3


def ldmatrix(memory: np.ndarray, row_index: np.ndarray, trans: bool = False) -> np.ndarray:
    """What ``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16`` returns to each lane: (32, 4)
    uint32, given a flat uint16 ``memory`` and each lane's element index of a row start
    (``row_index[lane]``: lanes 8j .. 8j+7 name the rows 0..7 of matrix j)."""
    memory = np.asarray(memory, np.uint16)
    row_index = np.asarray(row_index, np.int64)
    j = np.arange(4)[None, :]
    g, t = _LD_G[:, None], _LD_T[:, None]
    if trans:  # column g of matrix j, rows 2t and 2t + 1
        lo = memory[row_index[8 * j + 2 * t] + g]
        hi = memory[row_index[8 * j + 2 * t + 1] + g]
    else:  # row g of matrix j, elements 2t and 2t + 1
        lo = memory[row_index[8 * j + g] + 2 * t]
        hi = memory[row_index[8 * j + g] + 2 * t + 1]
    return pack(lo, hi)


def _check(a, shape) -> None:
    if tuple(np.shape(a)) != shape:
        raise KernelError(f"fragment matrix has shape {tuple(np.shape(a))}, expected {shape}")
