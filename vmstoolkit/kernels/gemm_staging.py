"""The staging and the epilogues the tensor-core GEMMs share (:mod:`.gemm_bf16` and
:mod:`.gemm_tf32` on mma.sync, :mod:`.gemm_wgmma` on wgmma): the cp.async fetch of an operand's k
slices into XOR-swizzled shared tiles, as generated source lines; the bytes of each 16-byte chunk
inside the matrix; the stores of a thread's two adjacent outputs."""

from __future__ import annotations

from numba import cuda

from . import _mma

CHUNK = 8  # bf16 elements per 16-byte chunk (one cp.async, one ldmatrix row)


@cuda.jit(device=True)
def row_bytes(row_ok, k, K):
    """Source bytes of a 16-byte chunk of k row ``k`` (a "t" operand) at a column that is
    (``row_ok``) inside the matrix: all or none."""
    return 16 if row_ok and k < K else 0


def _make_chunk_bytes(elem_bytes: int):
    @cuda.jit(device=True)
    def chunk_bytes(row_ok, k, K):
        """Source bytes of the 16-byte chunk at ``k`` of a row (of an "n" operand) that is
        (``row_ok``) inside the matrix: those of its elements before ``K`` (cp.async zero-fills
        the rest). A row of a view can go on past K in memory (a row stride padded to 16
        bytes): reading those elements put them into the k sum (16 bytes whenever k < K, until
        this was fixed)."""
        if row_ok and k < K:
            return min(16, (K - k) * elem_bytes)
        return 0

    return chunk_bytes


CHUNK_BYTES = {2: _make_chunk_bytes(2), 4: _make_chunk_bytes(4)}  # by element size
chunk_bytes = CHUNK_BYTES[2]


# Epilogues: a lane's two adjacent outputs (row, col), (row, col + 1), each stored if inside C.
# Device functions (NVVM inlines them): as statements of the kernel their branches would
# multiply its basic blocks, and Numba's SSA passes take time superlinear in those.
@cuda.jit(device=True)
def store_f32(c, acc, row, col, M, N, v0, v1):
    if row < M:
        if col < N:
            c[row, col] = v0
        if col + 1 < N:
            c[row, col + 1] = v1


@cuda.jit(device=True)
def store_acc(c, acc, row, col, M, N, v0, v1):
    if row < M:
        if col < N:
            c[row, col] = acc[row, col] + v0
        if col + 1 < N:
            c[row, col + 1] = acc[row, col + 1] + v1


@cuda.jit(device=True)
def store_add(c, acc, row, col, M, N, v0, v1):
    if row < M:
        if col < N:
            cuda.atomic.add(c, (row, col), v0)
        if col + 1 < N:
            cuda.atomic.add(c, (row, col + 1), v1)


@cuda.jit(device=True)
def store_bf16(c, acc, row, col, M, N, v0, v1):
    if row < M:
        if col + 1 < N:
            pk = _mma.pack_bf16x2(v0, v1)
            c[row, col] = pk & 0xFFFF
            c[row, col + 1] = pk >> 16
        elif col < N:
            c[row, col] = _mma.pack_bf16x2(v0, v0) & 0xFFFF


def swizzle_n(rows: str, chunk: str, bk: int) -> str:
    """Element offset in an "n" tile (rows x bk) of chunk ``chunk`` of row ``rows`` (source text):
    rows of 4 chunks (bk 32) swap chunk c with c ^ ((row >> 1) & 3), rows of 8 with c ^ (row & 7)."""
    sw = f"((({rows}) >> 1) & 3)" if bk == 32 else f"(({rows}) & 7)"
    return f"(({rows}) * {bk} + ((({chunk}) ^ {sw}) << 3))"


def swizzle_t(k: str, chunk: str, width: int) -> str:
    """Element offset in a "t" tile (BK x width) of chunk ``chunk`` of k row ``k``."""
    mask = min(8, width // CHUNK) - 1
    return f"(({k}) * {width} + ((({chunk}) ^ (({k}) & {mask})) << 3))"


def fetch_setup(fmt, t, op: str, trans: bool, rows: int, bound: str) -> list[str]:
    """Source lines, before the k loop, of the cp.async fetch of operand ``op`` ('a' or 'b'): per
    chunk ``i`` this thread copies, its swizzled shared offset ``d{op}{i}`` inside a stage, its
    element offset ``o{op}{i}`` in global memory at the block's first slice (stepped by
    ``step_{op}`` per slice), whether its row (column) is inside the matrix ``v{op}{i}``, and
    its k inside the slice ``k{op}{i}``. ``fmt`` gives the tiles' swizzles (``swizzle_n``,
    ``swizzle_t``: an :class:`.gemm_bf16.OperandFormat`, or the wgmma GEMM's), ``t`` the tiles
    (``bk``, ``threads``, ``chunk``, ``ELEM_BYTES``)."""
    BK, threads, chunk = t.bk, t.threads, t.chunk
    per_row = rows // chunk if trans else BK // chunk
    lines = [f"pitch_{op} = {op}.strides[0] // {t.ELEM_BYTES}",
             f"step_{op} = " + (f"{BK} * pitch_{op}" if trans else f"{BK}")]
    for i in range(rows * BK // chunk // threads):
        q = f"(tid + {i * threads})"
        if trans:  # stored (K, rows): chunk cr of k row kr
            lines += [f"kr = {q} // {per_row}", f"cr = {q} % {per_row}", f"gr = r0_{op} + cr * {chunk}",
                      f"d{op}{i} = " + fmt.swizzle_t("kr", "cr", rows), f"v{op}{i} = gr < {bound}",
                      f"k{op}{i} = kr",
                      f"o{op}{i} = (kbeg * {BK} + kr) * pitch_{op} + (gr if v{op}{i} else 0)"]
        else:  # stored (rows, K): chunk cr of row rr
            lines += [f"rr = {q} // {per_row}", f"cr = {q} % {per_row}", f"gr = r0_{op} + rr",
                      f"d{op}{i} = " + fmt.swizzle_n("rr", "cr", BK), f"v{op}{i} = gr < {bound}",
                      f"k{op}{i} = cr * {chunk}",
                      f"o{op}{i} = (gr if v{op}{i} else 0) * pitch_{op} + kbeg * {BK} + cr * {chunk}"]
    return lines


def fetch_lines(fmt, t, op: str, trans: bool, rows: int, bound: str, async_: bool,
                 offset: int) -> list[str]:
    """Source lines fetching the next slice of operand ``op`` ('a' or 'b') into stage ``st``
    (``k0`` = the slice's first k; ``bound`` = the operand's row count R or C; the operand's
    stages start at element ``offset`` of the shared array)."""
    BK, threads, chunk = t.bk, t.threads, t.chunk
    shift = chunk.bit_length() - 1
    smem, base = "Sm", f"{offset} + st * {rows * BK}"
    lines = []
    if async_:  # zero-fill (0 source bytes) outside the matrix: the mma loop needs no checks
        for i in range(rows * BK // chunk // threads):
            # a "t" chunk is one k row's: all 16 bytes or none; an "n" one runs along k
            lines += [f"cp_async16_at({smem}, {base} + d{op}{i}, {op}, o{op}{i}, "
                      f"{'row_bytes' if trans else 'chunk_bytes'}(v{op}{i}, k0 + k{op}{i}, K))",
                      f"o{op}{i} += step_{op}"]
        return lines
    lines.append(f"for e in range(tid, {rows * BK}, {threads}):")
    if trans:
        lines += [f"    kr = e // {rows}", f"    rr = e % {rows}", f"    gk = k0 + kr", f"    gr = r0_{op} + rr",
                  f"    v = {op}[gk, gr] if gk < K and gr < {bound} else 0",
                  f"    {smem}[{base} + {fmt.swizzle_t('kr', f'rr >> {shift}', rows)} + (rr & {chunk - 1})] = v"]
    else:
        lines += [f"    rr = e // {BK}", f"    kr = e % {BK}", f"    gr = r0_{op} + rr", f"    gk = k0 + kr",
                  f"    v = {op}[gr, gk] if gr < {bound} and gk < K else 0",
                  f"    {smem}[{base} + {fmt.swizzle_n('rr', f'kr >> {shift}', BK)} + (kr & {chunk - 1})] = v"]
    return lines


def aligned_b16(a) -> bool:
    """True if a 2-D 2-byte array can be fetched in 16-byte chunks from any column that is a
    multiple of 8: base address 16-byte aligned, unit column stride, row stride a multiple of 8
    elements (device arrays by ``__cuda_array_interface__``, the simulator's by ``__array_interface__``)."""
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    shape = tuple(iface["shape"])
    row, col = iface.get("strides") or (shape[1] * 2, 2)
    return (iface["data"][0] % 16 == 0 and (shape[0] <= 1 or row % 16 == 0) and (shape[1] <= 1 or col == 2))
