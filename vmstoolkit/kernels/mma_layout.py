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

``mma.sync.m16n8k8`` with tf32 operands ("Matrix Fragments for mma.m16n8k8", .tf32; CUTLASS's
``SM80_16x8x8_F32TF32TF32F32_TN``): one 32-bit element a register, fp32 bits of which the tensor
core reads the top 19 (sign, 8 exponent, 10 mantissa bits):

- A (16 x 8, row major): ``a[0]`` = A[g, t], ``a[1]`` = A[g+8, t], ``a[2]`` = A[g, t+4], ``a[3]`` = A[g+8, t+4];
- B (8 x 8, k by n): ``b[0]`` = B[t, g], ``b[1]`` = B[t+4, g];
- C and D: as for m16n8k16 above.

Cost: every function is O(32 x fragment) numpy work; they are for tests and simulators only.
"""

from __future__ import annotations

import numpy as np

from vmstoolkit.errors import KernelError

WARP = 32
M, N, K = 16, 8, 16  # the mma shape
K_TF32 = 8  # m16n8k8's k
TF32_DROPPED = 13  # low mantissa bits of an fp32 that tf32 does not keep


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


def a_coords_tf32(lane: int) -> list[tuple[int, int]]:
    """(row, col) of each of the 4 A registers of ``lane`` in m16n8k8 with tf32 operands."""
    g, t = lane >> 2, lane & 3
    return [(g + 8 * (reg & 1), t + 4 * (reg >> 1)) for reg in range(4)]


def b_coords_tf32(lane: int) -> list[tuple[int, int]]:
    """(k, n) of each of the 2 B registers of ``lane`` in m16n8k8 with tf32 operands."""
    g, t = lane >> 2, lane & 3
    return [(t + 4 * reg, g) for reg in range(2)]


def tf32_round(x) -> np.ndarray:
    """float32 -> the nearest tf32 value, ties away from zero (``cvt.rna.tf32.f32``), as float32 with
    the low 13 mantissa bits zero; magnitudes that round past the largest finite tf32 become inf,
    NaN stays NaN."""
    x = np.asarray(x, np.float32)
    u = np.ascontiguousarray(x).view(np.uint32).astype(np.uint64)
    half = 1 << (TF32_DROPPED - 1)
    mask = (0xFFFFFFFF >> TF32_DROPPED) << TF32_DROPPED
    rounded = ((u + half) & mask).astype(np.uint32).view(np.float32).reshape(x.shape)
    return np.where(np.isnan(x) | np.isinf(x), x, rounded)


def tf32_truncate(x) -> np.ndarray:
    """float32 -> what an mma with .tf32 operands reads of it (our model: the low 13 bits dropped)."""
    x = np.ascontiguousarray(x, np.float32)
    mask = np.uint32((0xFFFFFFFF >> TF32_DROPPED) << TF32_DROPPED)
    return (x.view(np.uint32) & mask).view(np.float32)


_A_TF32 = np.array([a_coords_tf32(lane) for lane in range(WARP)])  # (32, 4, 2)
_B_TF32 = np.array([b_coords_tf32(lane) for lane in range(WARP)])  # (32, 2, 2)


def a_fragments_tf32(a: np.ndarray) -> np.ndarray:
    """A (16 x 8 float32) -> (32, 4) float32: each lane's A registers of m16n8k8."""
    _check(a, (M, K_TF32))
    return np.asarray(a, np.float32)[_A_TF32[..., 0], _A_TF32[..., 1]]


def b_fragments_tf32(b: np.ndarray) -> np.ndarray:
    """B (8 x 8, k by n, float32) -> (32, 2) float32: each lane's B registers of m16n8k8."""
    _check(b, (K_TF32, N))
    return np.asarray(b, np.float32)[_B_TF32[..., 0], _B_TF32[..., 1]]


def a_matrix_tf32(frags: np.ndarray) -> np.ndarray:
    """(32, 4) A registers -> the 16 x 8 matrix they hold (inverse of :func:`a_fragments_tf32`)."""
    out = np.zeros((M, K_TF32), np.float32)
    out[_A_TF32[..., 0], _A_TF32[..., 1]] = np.asarray(frags, np.float32)
    return out


def b_matrix_tf32(frags: np.ndarray) -> np.ndarray:
    """(32, 2) B registers -> the 8 x 8 matrix they hold."""
    out = np.zeros((K_TF32, N), np.float32)
    out[_B_TF32[..., 0], _B_TF32[..., 1]] = np.asarray(frags, np.float32)
    return out


def mma_tf32(a_frags: np.ndarray, b_frags: np.ndarray, c_frags: np.ndarray) -> np.ndarray:
    """What ``mma.sync.m16n8k8.row.col.f32.tf32.tf32.f32`` returns to each lane: (32, 4) float32
    ``D = A B + C`` from the lanes' registers, each operand read as tf32 (:func:`tf32_truncate`),
    products exact in float64 and rounded once to float32 (the tensor core's own summation may
    differ in the last bits)."""
    a = tf32_truncate(a_matrix_tf32(a_frags)).astype(np.float64)
    b = tf32_truncate(b_matrix_tf32(b_frags)).astype(np.float64)
    return c_fragments((a @ b + c_matrix(c_frags).astype(np.float64)).astype(np.float32))


def _check(a, shape) -> None:
    if tuple(np.shape(a)) != shape:
        raise KernelError(f"fragment matrix has shape {tuple(np.shape(a))}, expected {shape}")
