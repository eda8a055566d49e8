"""Layouts of Hopper's warpgroup MMA (``wgmma.mma_async.m64nNk16``, bf16) in plain Python: where
:mod:`.gemm_wgmma` writes each operand element in shared memory, where the hardware reads it
through a matrix descriptor, and which thread holds which accumulator.

Shared memory uses the 128-byte swizzle (CUTLASS's ``Swizzle<3,4,3>``): inside every 1024-byte
aligned atom of 8 rows of 128 bytes, byte address bits 4-6 (the 16-byte chunk) are XORed with
bits 7-9 (the row), so the 8 rows of one chunk column fall in 8 different bank groups.

- **K-major** operands (A stored (M, K), B stored (N, K): ``trans = 0``) are tiles of ``rows``
  rows of BK = 64 bf16 (one 128-byte swizzle row each): element (r, k) at ``swizzle(r * 128 + 2k)``.
- **MN-major** operands (A stored (K, M), B stored (K, N): ``trans = 1``) are panels of 64
  M/N elements: panel p holds k rows of 128 bytes, element (mn, k) at
  ``p * (BK * 128) + swizzle(k * 128 + 2 (mn % 64))``.

A descriptor (PTX ISA, "Matrix Descriptor Format") holds the start address, a leading and a
stride byte offset, each >> 4 in 14 bits, and the swizzle mode in bits 62-63 (1 = 128 bytes).
For the canonical swizzled layouts (PTX ISA, "Shared Memory Matrix Layout"; CUTLASS's
``make_gmma_desc``), in bytes:

- K-major: row r, k in 0-15 at ``start + (r // 8) * SBO + (r % 8) * 128 + 2k``; the leading
  offset is unused (set to 16, i.e. 1, as CUTLASS does);
- MN-major: ``start + (mn // 64) * LBO + 2 (mn % 64) + (k // 8) * SBO + (k % 8) * 128``;

the swizzle then applied to the address. An instruction's k step s (of the 4 in a BK slice)
starts 32 s bytes into a K-major tile and 16 s rows (2048 s bytes) into an MN-major one.

The accumulator (fp32, ``n / 2`` registers a thread): thread t of the warpgroup, warp w = t // 32,
lane l; register i = 4 j + q holds row ``16 w + l // 4 + 8 (q // 2)``, column
``8 j + 2 (l % 4) + q % 2`` (PTX ISA, "Matrix Fragments for wgmma.m64nNk16": the mma.sync m16n8
accumulator, one m16 row block per warp, repeated along n).
"""

from __future__ import annotations

import numpy as np

from vmstoolkit.errors import KernelError

BK = 64  # bf16 per 128-byte swizzle row: the k depth of one staged slice
ROW_BYTES = 128
ATOM_BYTES = 1024  # 8 swizzled rows; tiles start at a multiple of it
PANEL = 64  # M/N elements per 128-byte row of an MN-major tile
SWIZZLE_128B = 1  # the descriptor's swizzle-mode field
K_STEP = 16  # k of one instruction
WARPGROUP = 128


def swizzle(addr: int) -> int:
    """The 128-byte swizzle of a byte address (bits 4-6 ^= bits 7-9)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def kmajor_offset(row: int, k: int) -> int:
    """Byte offset of element (row, k) in a K-major tile (rows x BK), from its atom-aligned start."""
    return swizzle(row * ROW_BYTES + 2 * k)


def mnmajor_offset(mn: int, k: int, bk: int = BK) -> int:
    """Byte offset of element (mn, k) in an MN-major tile (bk k rows, panels of 64 mn)."""
    return (mn // PANEL) * bk * ROW_BYTES + swizzle(k * ROW_BYTES + 2 * (mn % PANEL))


def fields(mn_major: bool, bk: int = BK) -> tuple[int, int]:
    """(leading, stride) byte offsets of an operand's descriptor: K-major (16 unused, 1024 between
    8-row groups); MN-major (a panel, bk * 128 bytes, between 64-element blocks; 1024 between
    8-k groups)."""
    return (bk * ROW_BYTES, ATOM_BYTES) if mn_major else (16, ATOM_BYTES)


def descriptor_hi(lbo: int, sbo: int, mode: int = SWIZZLE_128B) -> int:
    """The descriptor's fields other than the start address."""
    return ((lbo >> 4) & 0x3FFF) << 16 | ((sbo >> 4) & 0x3FFF) << 32 | mode << 62


def descriptor(addr: int, lbo: int, sbo: int, mode: int = SWIZZLE_128B) -> int:
    """A whole descriptor for a shared address (what ``_wgmma.wgmma_bf16`` builds in the kernel)."""
    return descriptor_hi(lbo, sbo, mode) | ((addr >> 4) & 0x3FFF)


def step_offset(mn_major: bool, step: int) -> int:
    """Bytes from a tile's start to the start of k step ``step`` (0-3) of a BK slice."""
    return step * K_STEP * ROW_BYTES if mn_major else step * K_STEP * 2


def reads(desc: int, rows: int, mn_major: bool) -> np.ndarray:
    """The byte address the hardware reads for element (r, k), r < rows, k < 16, of one operand
    of an m64nNk16 instruction given its descriptor (swizzle mode 128 B): an int array (rows, 16)."""
    if desc >> 62 != SWIZZLE_128B:
        raise KernelError(f"wgmma_layout.reads: only the 128-byte swizzle is modelled, got swizzle mode {desc >> 62}")
    start = (desc & 0x3FFF) << 4
    lbo = ((desc >> 16) & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    r = np.arange(rows, dtype=np.int64)[:, None]
    k = np.arange(K_STEP, dtype=np.int64)[None, :]
    if mn_major:
        a = start + (r // PANEL) * lbo + 2 * (r % PANEL) + (k // 8) * sbo + (k % 8) * ROW_BYTES
    else:
        a = start + (r // 8) * sbo + (r % 8) * ROW_BYTES + 2 * k
    return a ^ (((a >> 7) & 7) << 4)  # swizzle(), elementwise


def accumulator_owner(n: int) -> np.ndarray:
    """(row, col) of accumulator register i of thread t: an int array (128, n // 2, 2)."""
    out = np.empty((WARPGROUP, n // 2, 2), np.int64)
    for t in range(WARPGROUP):
        w, lane = divmod(t, 32)
        for i in range(n // 2):
            j, q = divmod(i, 4)
            out[t, i] = (16 * w + lane // 4 + 8 * (q // 2), 8 * j + 2 * (lane % 4) + q % 2)
    return out
