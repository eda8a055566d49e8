"""The staging and the epilogues both bf16 GEMMs share (:mod:`.gemm_bf16` on mma.sync,
:mod:`.gemm_wgmma` on wgmma): the cp.async fetch of an operand's k slices into XOR-swizzled shared
tiles, as generated source lines, the bytes of each 16-byte chunk inside the matrix, and the stores
of a thread's two adjacent outputs."""

from __future__ import annotations

from numba import cuda

from . import _mma

CHUNK = 8  # bf16 elements per 16-byte chunk (one cp.async, one ldmatrix row)


@cuda.jit(device=True)
def chunk_bytes(row_ok, k, K):
    """Source bytes of the 16-byte chunk at ``k`` of a row of an "n" operand that is (``row_ok``)
    inside the matrix: those before the row's end ``K`` (cp.async zero-fills the rest). A row
    whose pitch is a multiple of 8 but whose length is not ends mid-chunk; reading the whole
    chunk would add the padding after it into the sums."""
    if row_ok and k < K:
        return 2 * min(8, K - k)
    return 0


@cuda.jit(device=True)
def chunk_bytes_t(inside, k, K):
    """Source bytes of a chunk of k row ``k`` of a "t" operand, ``inside`` of whose 8 elements
    are inside the matrix (0-8: fixed per chunk, since the chunk runs along the rows)."""
    return 2 * inside if k < K else 0


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


def fetch_setup(op: str, trans: bool, rows: int, threads: int, bound: str, BK: int,
                 swizzle_t=swizzle_t) -> list[str]:
    """Source lines, before the k loop, of the cp.async fetch of operand ``op`` ('a' or 'b'): per
    chunk ``i`` this thread copies, its swizzled shared offset ``d{op}{i}`` inside a stage, its
    element offset ``o{op}{i}`` in global memory at the block's first slice (stepped by
    ``step_{op}`` per slice), whether its row (column) is inside the matrix ``v{op}{i}``, and
    its k inside the slice ``k{op}{i}``. ``swizzle_t``: the "t" tile's offset function (the wgmma
    GEMM's tiles are panels: :mod:`.gemm_wgmma`)."""
    per_row = rows // CHUNK if trans else BK // CHUNK
    lines = [f"pitch_{op} = {op}.strides[0] // 2",
             f"step_{op} = " + (f"{BK} * pitch_{op}" if trans else f"{BK}")]
    for i in range(rows * BK // CHUNK // threads):
        q = f"(tid + {i * threads})"
        if trans:  # stored (K, rows): chunk cr of k row kr
            lines += [f"kr = {q} // {per_row}", f"cr = {q} % {per_row}", f"gr = r0_{op} + cr * {CHUNK}",
                      f"d{op}{i} = " + swizzle_t("kr", "cr", rows), f"v{op}{i} = gr < {bound}",
                      f"w{op}{i} = max(0, min({CHUNK}, {bound} - gr))",
                      f"k{op}{i} = kr",
                      f"o{op}{i} = (kbeg * {BK} + kr) * pitch_{op} + (gr if v{op}{i} else 0)"]
        else:  # stored (rows, K): chunk cr of row rr
            lines += [f"rr = {q} // {per_row}", f"cr = {q} % {per_row}", f"gr = r0_{op} + rr",
                      f"d{op}{i} = " + swizzle_n("rr", "cr", BK), f"v{op}{i} = gr < {bound}",
                      f"k{op}{i} = cr * {CHUNK}",
                      f"o{op}{i} = (gr if v{op}{i} else 0) * pitch_{op} + kbeg * {BK} + cr * {CHUNK}"]
    return lines


def fetch_lines(op: str, trans: bool, rows: int, threads: int, bound: str, async_: bool, BK: int,
                 offset: int) -> list[str]:
    """Source lines fetching the next slice of operand ``op`` ('a' or 'b') into stage ``st``
    (``k0`` = the slice's first k; ``bound`` = the operand's row count R or C; the operand's
    stages start at element ``offset`` of the shared array)."""
    smem, base = "Sm", f"{offset} + st * {rows * BK}"
    lines = []
    if async_:  # zero-fill (0 source bytes) outside the matrix: the mma loop needs no checks
        for i in range(rows * BK // CHUNK // threads):
            nbytes = (f"chunk_bytes_t(w{op}{i}, k0 + k{op}{i}, K)" if trans
                      else f"chunk_bytes(v{op}{i}, k0 + k{op}{i}, K)")
            lines += [f"cp_async16_at({smem}, {base} + d{op}{i}, {op}, o{op}{i}, {nbytes})",
                      f"o{op}{i} += step_{op}"]
        return lines
    lines.append(f"for e in range(tid, {rows * BK}, {threads}):")
    if trans:
        lines += [f"    kr = e // {rows}", f"    rr = e % {rows}", f"    gk = k0 + kr", f"    gr = r0_{op} + rr",
                  f"    v = {op}[gk, gr] if gk < K and gr < {bound} else 0",
                  f"    {smem}[{base} + {swizzle_t('kr', 'rr >> 3', rows)} + (rr & 7)] = v"]
    else:
        lines += [f"    rr = e // {BK}", f"    kr = e % {BK}", f"    gr = r0_{op} + rr", f"    gk = k0 + kr",
                  f"    v = {op}[gr, gk] if gr < {bound} and gk < K else 0",
                  f"    {smem}[{base} + {swizzle_n('rr', 'kr >> 3', BK)} + (kr & 7)] = v"]
    return lines


def aligned_b16(a) -> bool:
    """True if a 2-D 2-byte array can be fetched in 16-byte chunks from any column that is a
    multiple of 8: base address 16-byte aligned, unit column stride, row stride a multiple of 8
    elements (device arrays by ``__cuda_array_interface__``, the simulator's by ``__array_interface__``)."""
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    shape = tuple(iface["shape"])
    row, col = iface.get("strides") or (shape[1] * 2, 2)
    return (iface["data"][0] % 16 == 0 and (shape[0] <= 1 or row % 16 == 0) and (shape[1] <= 1 or col == 2))
