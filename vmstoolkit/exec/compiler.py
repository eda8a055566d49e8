"""Memory graph compiler: task graph + GPU budget -> placed, offloading, race-free memory graph.

The compiler simulates the task graph in program order, one GPU region of ``budget`` bytes per
GPU, and emits a *memory graph*:

- every residency of a tensor on a GPU is a :class:`Buffer` at a fixed offset of its GPU's region,
  written by one vertex (or preloaded before the run, ``writer == -1``) and read by others;
- when an allocation does not fit, the resident tensor whose next use is furthest away (Belady)
  is evicted: an ``offload`` vertex (GPU -> pinned host) copies it out unless a clean host copy
  already exists (weights, inputs, activations offloaded before: tensors are write-once), and a
  ``reload`` vertex (host -> GPU) brings it back right before its next use;
- when a buffer takes bytes that an older buffer occupied, edges go from the older buffer's last
  accesses (its readers, or its writer if nobody read it) to the new writer, and only those;
- finally the transitive reduction drops every edge implied by the others.

With ``recompute=True``, an activation that is cheap to rerun from tensors live anyway (see
:data:`RECOMPUTE_OPS` and :func:`recomputable_tensors`) is not offloaded when evicted: it is
dropped, and a compute vertex running its producer again (``MVertex.recompute``) rewrites it
right before its next use. ``MemoryGraph.recomputed_flops`` sums the FLOPs so added.

Vertex ids are the compile-time order, which is a topological order of the memory graph.

Runtime complexity: O((V + E) log V) for the simulation, plus O(E * V / 64) word operations for
the transitive reduction with bitsets (ancestor sets are freed once their last successor is
processed, so memory stays near the width of the graph).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from sortedcontainers import SortedDict, SortedList

from vmstoolkit.exec.errors import BudgetTooSmallError, InvalidBudgetError
from vmstoolkit.exec.graph import TaskGraph, TensorKind

# Every buffer starts on a 256-byte boundary: what cudaMalloc guarantees and what vectorised
# kernels assume.
ALIGN = 256

STREAMS = ("compute", "h2d", "d2h")

# Producers worth rerunning instead of a round trip over PCIe. RMSNorm (4 FLOPs per element)
# and SwiGLU's activation (5 per element) are memory-bound elementwise kernels: rerunning one
# reads its inputs once from HBM (~4.8 TB/s on the H200), while offloading and reloading its
# output moves it twice over PCIe (~50 GB/s): two orders of magnitude cheaper per byte. In a
# LLaMA training step their inputs are live anyway when the output's backward use comes: the
# block input x and the residual h are read again by the norms' own backward, gate and up by
# SwiGLU's backward, right after the projections' weight gradients read the normed inputs and
# silu(gate) * up. RoPE is left out: its input (q, k before rotation) is not saved, so
# rerunning it would keep alive a tensor as large as the one dropped; residual adds likewise
# (the projection output they read is dead). Attention's outputs are far too costly to rerun.
RECOMPUTE_OPS = ("rmsnorm", "swiglu")


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class OffsetAllocator:
    """Allocator of offsets inside one region ``[0, size)`` that prefers the *oldest* hole.

    Every free range remembers when it was freed (a compile-time position; coalesced ranges keep
    the latest). ``allocate`` takes, among the ranges large enough, the one freed earliest (ties:
    the smallest), from its low end. For the runtime this is what matters: a new buffer must
    wait for the last accesses of what occupied its bytes, so the oldest hole lets a reload
    start earliest (prefetch). Best fit instead put reloads in the hole just freed by the
    previous block, and the event-driven executor on the sim backend lost 40% of its compute
    utilisation at half budget (0.47 s against a 0.31 s bound on the 16-block LLaMA).

    Free ranges are kept by (size, offset) for the search and by offset for coalescing.
    Runtime complexity: O(h + log(n)) per allocate (h: ranges large enough), O(log(n)) per free.
    """

    def __init__(self, size: int):
        self.size = size
        self._by_size = SortedList([(size, 0)]) if size > 0 else SortedList()
        self._by_off = SortedDict({0: (size, -1)}) if size > 0 else SortedDict()  # off -> (size, freed at)
        self._used: dict[int, int] = {}
        self.used = 0
        self.peak = 0

    def allocate(self, size: int) -> int | None:
        i = self._by_size.bisect_left((size, -1))
        if i == len(self._by_size):
            return None
        best = None
        for sz, off in self._by_size.islice(i):
            key = (self._by_off[off][1], sz)
            if best is None or key < best[0]:
                best = (key, sz, off)
        _, sz, off = best
        t = self._by_off.pop(off)[1]
        self._by_size.remove((sz, off))
        if sz > size:
            self._by_size.add((sz - size, off + size))
            self._by_off[off + size] = (sz - size, t)
        self._used[off] = size
        self.used += size
        self.peak = max(self.peak, self.used)
        return off

    def free(self, off: int, when: int = 0) -> None:
        size = self._used.pop(off)
        self.used -= size
        start, end = off, off + size
        i = self._by_off.bisect_left(off)
        if i < len(self._by_off):  # right neighbour
            roff, (rsz, rt) = self._by_off.peekitem(i)
            if roff == end:
                del self._by_off[roff]
                self._by_size.remove((rsz, roff))
                end += rsz
                when = max(when, rt)
        if i > 0:  # left neighbour
            loff, (lsz, lt) = self._by_off.peekitem(i - 1)
            if loff + lsz == start:
                del self._by_off[loff]
                self._by_size.remove((lsz, loff))
                start = loff
                when = max(when, lt)
        self._by_off[start] = (end - start, when)
        self._by_size.add((end - start, start))

    def _check(self) -> None:
        spans = sorted([(o, s) for o, (s, _) in self._by_off.items()] + list(self._used.items()))
        pos = 0
        for o, s in spans:
            assert o == pos, f"gap or overlap at {pos} / {o}"
            pos = o + s
        assert pos == self.size
        assert sum(self._used.values()) == self.used
        assert len(self._by_size) == len(self._by_off)
        for o, (s, _) in self._by_off.items():  # coalesced: no two free ranges touch
            assert (s, o) in self._by_size
            assert o + s not in self._by_off


@dataclass(slots=True)
class Buffer:
    """One residency of a tensor: bytes ``[offset, offset + size)`` of GPU ``gpu``'s region."""

    id: int
    tensor: int
    gpu: int
    offset: int
    size: int
    writer: int  # vertex id, -1 when preloaded before the run, -2 when void (see below)
    readers: list[int] = field(default_factory=list)
    # A void buffer was allocated and given back before anyone wrote it (a placement attempt
    # undone); whoever takes its bytes next must still wait for what was there before it.
    inherited: list[int] = field(default_factory=list)

    def last_accesses(self) -> list[int]:
        if self.writer == -2:
            return self.inherited
        if self.readers:
            return self.readers
        return [self.writer] if self.writer >= 0 else []


@dataclass(slots=True)
class MVertex:
    """A vertex of the memory graph: a task-graph operation, an offload or a reload."""

    id: int
    kind: str  # "compute" | "offload" | "reload"
    op: str  # task op name, "offload" or "reload"
    name: str
    gpu: int
    stream: str  # one of STREAMS
    task: int  # task vertex id (compute) or -1
    tensor: int  # tensor moved (offload/reload) or -1
    reads: tuple[int, ...]  # buffer ids
    writes: tuple[int, ...]  # buffer ids
    flops: float = 0.0
    nbytes: int = 0  # bytes copied (offload, reload, copy)
    recompute: bool = False  # a compute vertex rerunning ``task`` to rewrite a dropped tensor


@dataclass
class MemoryGraph:
    graph: TaskGraph
    budget: int
    n_gpus: int
    vertices: list[MVertex]
    buffers: list[Buffer]
    preds: list[list[int]]  # after transitive reduction
    preloaded: list[int]  # buffer ids filled before the run
    output_location: dict[int, int]  # output tensor -> final buffer id, or -1 if on the host
    peak_bytes: list[int]  # per GPU, most bytes in use at once
    edges_before_reduction: int = 0
    kinds: dict = field(default_factory=dict)  # (u, v) -> "data" | "reuse" | "data+reuse"

    @property
    def n_edges(self) -> int:
        return sum(len(p) for p in self.preds)

    def succs(self) -> list[list[int]]:
        s: list[list[int]] = [[] for _ in self.vertices]
        for v, ps in enumerate(self.preds):
            for u in ps:
                s[u].append(v)
        return s

    def bytes_moved(self, kind: str, gpu: int | None = None) -> int:
        return sum(v.nbytes for v in self.vertices if v.kind == kind and (gpu is None or v.gpu == gpu))

    @property
    def offloaded_bytes(self) -> int:
        return self.bytes_moved("offload")

    @property
    def reloaded_bytes(self) -> int:
        return self.bytes_moved("reload")

    @property
    def recomputed_flops(self) -> float:
        """FLOPs added by recomputation (0 unless compiled with ``recompute=True``)."""
        return sum(v.flops for v in self.vertices if v.recompute)

    def summary(self) -> dict:
        n = {k: sum(1 for v in self.vertices if v.kind == k) for k in ("compute", "offload", "reload")}
        return {
            "budget": self.budget,
            "vertices": len(self.vertices),
            **{f"{k}_vertices": c for k, c in n.items()},
            "edges": self.n_edges,
            "edges_before_reduction": self.edges_before_reduction,
            "peak_bytes": self.peak_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "reloaded_bytes": self.reloaded_bytes,
            "recompute_vertices": sum(1 for v in self.vertices if v.recompute),
            "recomputed_flops": self.recomputed_flops,
            "preloaded_bytes": sum(self.buffers[b].size for b in self.preloaded),
        }


def check_budget_value(budget) -> int:
    """``budget`` as an int number of bytes; :class:`InvalidBudgetError` unless it is a positive
    whole number (an integral float such as ``1e9`` is taken; NaN, infinities, fractions of a
    byte, zero, negatives, text and booleans are not)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise InvalidBudgetError(f"budget {budget!r} is not a number of bytes")
    if isinstance(budget, float) and not (math.isfinite(budget) and budget.is_integer()):
        raise InvalidBudgetError(f"budget {budget!r} is not a whole number of bytes")
    if budget <= 0:
        raise InvalidBudgetError(f"budget {budget!r} bytes: must be positive")
    return int(budget)


def working_set(graph: TaskGraph) -> int:
    """The smallest budget (within 1%) that runs ``graph`` with no offload or reload: every
    weight resident plus the peak of live activations, plus what placement loses to
    fragmentation."""
    total = sum(align(t.nbytes) for t in graph.tensors)
    b = max(compile_memory_graph(graph, total, check_budget=False).peak_bytes)
    while True:
        mg = compile_memory_graph(graph, b, check_budget=False)
        if mg.offloaded_bytes == 0 and mg.reloaded_bytes == 0:
            return b
        b = align(int(b * 1.01) + 1)


def recomputable_tensors(graph: TaskGraph, uses: list[list[int]], nbytes: list[int], budget: int) -> set[int]:
    """Activations the compiler may drop and recompute instead of offloading: outputs of a
    :data:`RECOMPUTE_OPS` vertex that are not graph outputs, whose producer reads no activation
    that dies before the output's last use (so its inputs are resident or have a host copy
    whenever a rerun is needed) and no recomputable tensor (reruns never nest). A use vertex must
    also fit with the inputs of every rerun it may need on top of its own tensors, so that a
    placement in an emptied region still succeeds. O(V + E)."""
    tensors, tverts, n = graph.tensors, graph.vertices, len(graph.vertices)
    out: set[int] = set()
    for v in tverts:
        if v.op not in RECOMPUTE_OPS or len(v.outputs) != 1:  # a rerun rewrites one tensor
            continue
        for t in v.outputs:
            if not uses[t] or uses[t][-1] >= n:
                continue
            if any(i in out or (tensors[i].kind is TensorKind.ACTIVATION and uses[i][-1] < uses[t][-1])
                   for i in v.inputs):
                continue
            out.add(t)
    for u in tverts:
        cand = [t for t in dict.fromkeys(u.inputs) if t in out]
        if not cand:
            continue
        need = sum(nbytes[t] for t in {*u.inputs, *u.outputs} if tensors[t].gpu == u.gpu)
        need += sum(nbytes[i] for t in cand for i in set(tverts[graph.producer[t]].inputs))
        if need > budget:
            out.difference_update(cand)
    return out


def compile_memory_graph(graph: TaskGraph, budget: int, n_gpus: int | None = None, *,
                         preload: bool = True, check_budget: bool = True, recompute: bool = False) -> MemoryGraph:
    """Compile ``graph`` for ``n_gpus`` GPUs (default: the graph's own) of ``budget`` bytes each.

    With ``preload``, weights and inputs are placed on the GPU before the run, in order of first
    use, while they fit; the rest start on the host. Preloaded tensors are clean (a host copy
    exists), so when the simulation needs their room, Belady drops the furthest-used ones for free.
    With ``recompute``, evicted :func:`recomputable_tensors` are dropped instead of offloaded and
    their producer rerun before the next use (module docstring).
    Raises :class:`BudgetTooSmallError` when one vertex alone does not fit, and
    :class:`InvalidBudgetError` for a budget that is not a positive whole number of bytes.
    """
    budget = check_budget_value(budget)
    n_gpus = graph.n_gpus if n_gpus is None else n_gpus
    if graph.n_gpus > n_gpus:
        raise ValueError(f"graph uses {graph.n_gpus} GPUs, compiling for {n_gpus}")
    tensors, tverts = graph.tensors, graph.vertices
    n = len(tverts)
    nbytes = [align(t.nbytes) for t in tensors]
    tgpu = [t.gpu for t in tensors]

    # reserve: the largest single vertex per GPU; also the "no schedule fits" check
    reserve = [0] * n_gpus
    worst = (0, "", 0)
    for v in tverts:
        need: dict[int, int] = {}
        for t in {*v.inputs, *v.outputs}:
            need[tgpu[t]] = need.get(tgpu[t], 0) + nbytes[t]
        for gpu, b in need.items():
            reserve[gpu] = max(reserve[gpu], b)
            if b > worst[0]:
                worst = (b, v.name, gpu)
    if check_budget and worst[0] > budget:  # name the hungriest vertex, not merely the first
        raise BudgetTooSmallError(worst[1], worst[2], worst[0], budget)

    # uses of every tensor, as positions in program order; outputs get a use at the end
    uses: list[list[int]] = [[] for _ in tensors]
    for v in tverts:
        for t in dict.fromkeys(v.inputs):
            uses[t].append(v.id)
    for t in graph.outputs:
        uses[t].append(n)
    use_ptr = [0] * len(tensors)  # index into uses[t] of the next use
    recomputable = recomputable_tensors(graph, uses, nbytes, budget) if recompute else set()

    def next_use(t: int) -> int:
        u = uses[t]
        i = use_ptr[t]
        return u[i] if i < len(u) else n + 1

    alloc = [OffsetAllocator(budget) for _ in range(n_gpus)]
    last = [SortedDict() for _ in range(n_gpus)]  # start -> (end, buffer id): latest occupant
    heaps: list[list] = [[] for _ in range(n_gpus)]  # (-next_use, tensor)
    resident: dict[int, int] = {}  # tensor -> buffer id
    host_copy: dict[int, int] = {}  # tensor -> vertex that made the host copy (-1: from start)
    for t in tensors:
        if t.kind is not TensorKind.ACTIVATION:
            host_copy[t.id] = -1
    buffers: list[Buffer] = []
    vertices: list[MVertex] = []
    preds: list[set[int]] = []
    kinds: dict[tuple[int, int], str] = {}
    pending_reuse: dict[int, list[int]] = {}  # buffer id -> vertices that must precede its writer

    def occupy(gpu: int, off: int, size: int, bid: int) -> list[int]:
        """Record ``bid`` as the latest occupant of its range; return the older buffers there."""
        d = last[gpu]
        end = off + size
        older = []
        i = d.bisect_right(off) - 1
        if i < 0:
            i = 0
        keys = []
        for k in d.islice(i):
            if k >= end:
                break
            e, b = d[k]
            if e <= off:
                continue
            older.append(b)
            keys.append(k)
        for k in keys:
            e, b = d.pop(k)
            if k < off:
                d[k] = (off, b)  # left remainder
            if e > end:
                d[end] = (e, b)  # right remainder
        d[off] = (end, bid)
        return older

    def new_buffer(t: int, writer_pending: bool, pinned: set[int], where: str) -> int:
        gpu, size = tgpu[t], nbytes[t]
        a = alloc[gpu]
        off = a.allocate(size)
        stash = []
        while off is None:
            victim = pop_victim(gpu, pinned, stash)
            if victim is None:
                for item in stash:
                    heapq.heappush(heaps[gpu], item)
                raise _Fragmented(gpu, size, tensors[t].name, a.used)
            evict(victim)
            off = a.allocate(size)
        for item in stash:
            heapq.heappush(heaps[gpu], item)
        bid = len(buffers)
        buffers.append(Buffer(bid, t, gpu, off, size, -1))
        older = occupy(gpu, off, size, bid)
        must = []
        for ob in older:
            must.extend(buffers[ob].last_accesses())
        pending_reuse[bid] = must
        resident[t] = bid
        heapq.heappush(heaps[gpu], (-next_use(t), t))
        return bid

    def pop_victim(gpu: int, pinned: set[int], stash: list) -> int | None:
        h = heaps[gpu]
        while h:
            nu, t = heapq.heappop(h)
            if t not in resident or -nu != next_use(t):
                continue  # stale entry
            if t in pinned:
                stash.append((nu, t))
                continue
            return t
        return None

    def emit(kind, op, name, gpu, stream, task, tensor, reads, writes, flops=0.0, nb=0, extra_preds=()) -> int:
        vid = len(vertices)
        vertices.append(MVertex(vid, kind, op, name, gpu, stream, task, tensor, tuple(reads), tuple(writes), flops, nb))
        ps: set[int] = set()
        for b in reads:
            w = buffers[b].writer
            if w >= 0:
                ps.add(w)
                kinds[(w, vid)] = "data"
            buffers[b].readers.append(vid)
        for u in extra_preds:
            if u >= 0:
                ps.add(u)
                kinds[(u, vid)] = "data"
        for b in writes:
            buffers[b].writer = vid
            for u in pending_reuse.pop(b):
                ps.add(u)
                kinds[(u, vid)] = "data+reuse" if kinds.get((u, vid)) == "data" else "reuse"
        ps.discard(vid)
        preds.append(ps)
        return vid

    def evict(t: int) -> None:
        bid = resident.pop(t)
        b = buffers[bid]
        if t not in host_copy and t not in recomputable:
            host_copy[t] = emit("offload", "offload", f"offload {tensors[t].name}", b.gpu, "d2h", -1, t,
                                [bid], [], nb=tensors[t].nbytes)
        alloc[b.gpu].free(b.offset, len(vertices))

    def release(t: int) -> None:
        bid = resident.pop(t)
        alloc[buffers[bid].gpu].free(buffers[bid].offset, len(vertices))

    # -- preload weights and inputs in order of first use --------------------------------------
    preloaded: list[int] = []
    if preload:
        first = sorted((uses[t.id][0], t.id) for t in tensors if t.kind is not TensorKind.ACTIVATION and uses[t.id])
        full = [False] * n_gpus
        for _, t in first:
            gpu = tgpu[t]
            if full[gpu]:
                continue
            if alloc[gpu].used + nbytes[t] > budget:
                full[gpu] = True  # keep the preloaded set a prefix of first uses
                continue
            bid = new_buffer(t, False, set(), "preload")
            pending_reuse.pop(bid)
            preloaded.append(bid)

    # -- simulate ------------------------------------------------------------------------------
    def reload(t: int, pinned: set[int], where: str) -> None:
        bid = new_buffer(t, True, pinned, where)
        emit("reload", "reload", f"reload {tensors[t].name}", tgpu[t], "h2d", -1, t, [], [bid],
             nb=tensors[t].nbytes, extra_preds=[host_copy[t]])

    def place(v) -> list[int]:
        """Make ``v``'s inputs resident (reloading them, or rerunning the producer of a dropped
        recomputable one) and allocate its outputs."""
        ins = list(dict.fromkeys(v.inputs))
        pinned = set(ins) | set(v.outputs)
        for t in ins:  # a rerun's inputs stay put until v runs: no hole opens under v's tensors
            if t not in resident and t in recomputable:
                pinned.update(tverts[graph.producer[t]].inputs)
        for t in ins:
            if t not in resident and t in recomputable:
                pv = tverts[graph.producer[t]]
                for i in dict.fromkeys(pv.inputs):
                    if i not in resident:
                        reload(i, pinned, v.name)
                bid = new_buffer(t, True, pinned, v.name)
                rid = emit("compute", pv.op, f"recompute {pv.name}", pv.gpu, "compute", pv.id, -1,
                           [resident[i] for i in pv.inputs], [bid], flops=pv.flops)
                vertices[rid].recompute = True
            elif t not in resident:
                if t not in host_copy:
                    raise AssertionError(f"{tensors[t].name} is neither resident nor on the host")
                reload(t, pinned, v.name)
        return [new_buffer(t, True, pinned, v.name) for t in v.outputs]

    for v in tverts:
        ins = list(dict.fromkeys(v.inputs))
        try:
            outs = place(v)
        except _Fragmented as e:
            # The vertex fits in total but the holes left around its pinned inputs are too
            # small: evict everything on that GPU (clean tensors are dropped, the others
            # offloaded) and place again into the empty region, which packs from offset 0 and
            # so always succeeds (the total was checked above).
            for t in v.outputs:  # allocated by the failed attempt, not written: void them
                if t in resident:
                    bid = resident.pop(t)
                    b = buffers[bid]
                    b.writer, b.inherited = -2, pending_reuse.pop(bid)
                    alloc[b.gpu].free(b.offset, len(vertices))
            for t in [t for t in resident if tgpu[t] == e.gpu]:
                evict(t)
            try:
                outs = place(v)
            except _Fragmented as e2:
                raise BudgetTooSmallError(v.name, e2.gpu, reserve[e2.gpu], budget,
                                          detail=f"no contiguous {e2.size} bytes for {e2.tensor!r}") from None
        nb = sum(tensors[t].nbytes for t in v.outputs) if v.op == "copy" else 0
        emit("compute", v.op, v.name, v.gpu, "h2d" if v.op == "copy" else "compute", v.id, -1,
             [resident[t] for t in v.inputs], outs, flops=v.flops, nb=nb)
        for t in ins:
            use_ptr[t] += 1
            if use_ptr[t] >= len(uses[t]):
                release(t)
            else:
                heapq.heappush(heaps[tgpu[t]], (-next_use(t), t))
        for t in v.outputs:
            if not uses[t]:
                release(t)

    output_location = {t: resident.get(t, -1) for t in graph.outputs}
    edges_before = sum(len(p) for p in preds)
    reduced = transitive_reduction(preds)
    kept = {(u, v) for v, ps in enumerate(reduced) for u in ps}
    return MemoryGraph(graph, budget, n_gpus, vertices, buffers, reduced, preloaded, output_location,
                       [a.peak for a in alloc], edges_before, {e: k for e, k in kinds.items() if e in kept})


class _Fragmented(Exception):
    def __init__(self, gpu: int, size: int, tensor: str, used: int):
        self.gpu, self.size, self.tensor, self.used = gpu, size, tensor, used


def transitive_reduction(preds: list) -> list[list[int]]:
    """Drop every edge ``u -> v`` implied by another path, for a graph whose vertex ids are a
    topological order. Predecessors of ``v`` are visited latest first: one is redundant iff it
    already belongs to the ancestors of a kept later one. Ancestor sets are Python ints used as
    bitsets and freed after their last successor."""
    n = len(preds)
    remaining = [0] * n
    for ps in preds:
        for u in ps:
            remaining[u] += 1
    anc: dict[int, int] = {}
    out: list[list[int]] = []
    for v in range(n):
        covered = 0
        keep = []
        for u in sorted(preds[v], reverse=True):
            if not (covered >> u) & 1:
                keep.append(u)
                covered |= anc[u] | (1 << u)
        for u in preds[v]:
            remaining[u] -= 1
            if remaining[u] == 0:
                del anc[u]
        if remaining[v]:
            anc[v] = covered
        keep.reverse()
        out.append(keep)
    return out
