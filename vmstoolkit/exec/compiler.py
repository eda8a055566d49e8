"""Memory graph compiler: task graph + GPU budget -> placed, offloading, race-free memory graph.

The compiler simulates the task graph in program order, one GPU region of ``budget`` bytes per
GPU, and emits a *memory graph*:

- every residency of a tensor on a GPU is a :class:`Buffer` at a fixed offset of its GPU's region,
  written by one vertex (or preloaded before the run, ``writer == -1``) and read by others;
- when an allocation does not fit, the resident tensor whose next use is furthest away (Belady)
  is evicted: an ``offload`` vertex (GPU -> pinned host) copies it out unless a clean host copy
  already exists (weights, inputs, activations offloaded before: tensors are write-once), and a
  ``reload`` vertex (host -> GPU) brings it back before its next use: with ``prefetch`` (the
  default) as late as its estimated copy still ends before that use, when room can be made
  without evicting anything needed sooner (Note [Prefetch by need time]), else right before it;
- when a buffer takes bytes that an older buffer occupied, edges go from the older buffer's last
  accesses (its readers, or its writer if nobody read it) to the new writer, and only those;
- finally the transitive reduction drops every edge implied by the others.

With ``recompute=True``, an activation that is cheap to rerun from tensors live anyway (see
:data:`RECOMPUTE_OPS` and :func:`recomputable_tensors`) is not offloaded when evicted: it is
dropped, and a compute vertex running its producer again (``MVertex.recompute``) rewrites it
right before its next use. ``MemoryGraph.recomputed_flops`` sums the FLOPs so added.

When a placement finds enough free bytes but no hole large enough and the budget holds every
live tensor (:func:`live_peak`), resident tensors are moved aside on the device (``move``
vertices) instead of evicted (Note [Compaction instead of eviction]).

Vertex ids are the compile-time order, which is a topological order of the memory graph.

Runtime complexity: O((V + E) log V) for the simulation, plus O(E * V / 64) word operations for
the transitive reduction with bitsets (ancestor sets are freed once their last successor is
processed, so memory stays near the width of the graph).

Note [Compile time per vertex]
------------------------------
Rationale. A training step of 64 LLaMA-7B-wide blocks has 10^4 memory-graph vertices; compile
time per vertex used to triple from 1 to 64 blocks (``benchmarks/compile_time.py``). Two causes,
found with cProfile and the collector's callbacks at 16 and 64 blocks:

- placement scanned every free range large enough for the oldest one, and free ranges grow with
  the region (12 scanned per allocation at 4 blocks, 146 at 64): now an O(log n) search
  (:mod:`vmstoolkit.exec.region`);
- CPython's cyclic garbage collector ran full collections while the compile created its
  ~10^5 long-lived objects (vertices, buffers, edge sets), each pass over the whole heap: 0.1 to
  0.2 s of a 0.5 s compile at 64 blocks, none at 4.

Approach. Placement keeps the free ranges in a segment tree over the times they were freed
(:mod:`vmstoolkit.exec.region`'s Note), choosing exactly what the scan chose. The compile
creates no reference cycles (every object it builds is freed by reference
counting or kept in the result), so :func:`compile_memory_graph` pauses the cyclic collector
while it runs (``_cyclic_gc_paused``) and restores it after; objects are still freed as usual.

Figures (``benchmarks/compile_time.py``, half the working set, CPU seconds per memory-graph
vertex, best of 5, a shared and busy 2-core AMD EPYC): LoRA training from 4 to 64 blocks 2.8e-5
to 6.7e-5 before, 2.6e-5 to 3.9e-5 after; full 2.3e-5 to 4.1e-5 before, 2.9e-5 to 3.4e-5 after;
prefill 2.1e-5 to 2.3e-5 before, 2.4e-5 to 2.9e-5 after (with few holes the tree costs ~0.7 us
more per placement than the scan did). What growth remains comes from the logarithmic searches
(heaps, sorted containers, the tree: 10 to 14 levels) and from state that outgrows the caches
(every constant-work step, ``emit`` for one, costs ~20% more per call at 64 blocks).

Note [Prefetch by need time]
----------------------------
Rationale. Issue 32, item 7: LoRA at a quarter of the working set ran at 1.18x (Qwen2-7B) and
1.20x (Yi-34B) of its bound on the sim backend with the H200's costs, and 1.14x for Yi-34B with
no host cost and no jitter, where fixed-order came within 1.5% of event-driven: the loss was in
the graph. The zero-cost run's compute stream idled 94 ms of 539; each of the big idle gaps was
one FFN weight's reload (560 MB, 10.9 ms) that could not start before the GEMM right before its
use ended, because the compiler placed it at that use, in the bytes that GEMM had just
released (``b3.wg`` after ``b3.ds.dx0`` read ``b3.wd``, 10.3 ms of idle compute). A reload emitted right
before its use can only take room freed by then, so its reuse edges tie it to the vertex
before; no launch order can overlap it with that vertex.

Approach. Before task vertex ``p`` (when ``p``'s own inputs are resident), reload each tensor
whose next use ``q`` comes too soon to wait for vertex ``p + 1``: ``T[q] - T[p + 1]`` below its
reload's estimate, where ``T`` is the estimated start of each vertex with compute alone (the
``EST_*`` rates) and a reload takes ``EST_COPY_S + bytes / EST_COPY_BYTES_PER_S``. So a copy is
issued about one copy-length of compute ahead of its use, in order of that latest issue time.
Room comes from free holes (oldest first, as ever) or from evicting, furthest next use first,
only tensors used after ``q``; when that is not enough, nothing more is evicted for it and the
tensor is reloaded at ``q`` as before. The reload vertex is emitted before ``p``, so its reuse
edges come from vertices before ``p`` and the event-driven executor also sees it as more urgent.

Figures (``experiments/results/untuned-shapes``, sim, H200 costs, jitter 5%, 3 seeds, the
event-driven step before -> with prefetch alone -> with the executor's compute streams in compile
order too, seconds): Yi-34B at a quarter 0.568 -> 0.487 -> 0.484 (1.20x -> 1.07x its bound),
Qwen2-7B 0.693 -> 0.639 -> 0.642, the issue's shape 0.638 -> 0.628 -> 0.624; at half 2-5%
faster everywhere; the same bytes moved or fewer (Yi-34B 19.47 GB either way). Mistral-7B at a
quarter is slower (0.638 -> 0.645 -> 0.647; 0.641 with the executor's compute depth), although
with no host cost its prefetching graph is 1.5% faster (0.600 -> 0.591 s, no jitter): an
interaction with the host's launch costs, not found yet. Compile time is unchanged (0.04-0.18 s
per budget on this box, with or without).

Limitations. The estimates are one machine's figures; the issue distance counts compute only,
not the copies queued before (a queue-aware version, tried, issued earlier, held memory longer
and moved up to 10% more bytes at a quarter: worse). A prefetched tensor may still be evicted
before its use by a later placement (Belady sees it as any other tensor): a wasted copy, never a
wrong graph. ``prefetch=False`` compiles exactly the graphs of before (``compiler_golden.json``).

Note [Compaction instead of eviction]
-------------------------------------
Rationale. Issue 32: "no offload" was not monotone in the budget. Placement takes the oldest
hole (:mod:`vmstoolkit.exec.region`), so the layout, and where it fragments, changes with every
budget; a placement that found enough free bytes but no hole large enough evicted Belady's
victims until one opened. On the tiny checkpoints' generation graphs (8 prompt tokens, 64 new)
the victims were the tokens (graph outputs, used last) and the logits, dirty, so offloaded:
400-590 bytes at some budgets up to 1.5x the unconstrained peak and none at others (llama-tied:
none at 167,936, 400 at 171,520, none at 173,312). :func:`working_set` could only walk up in 1%
steps (26-40 compiles, 5.5 of a 6.6 s ``vmstoolkit run generate``), since a bisection landed on
a larger value on two of twenty graphs.

Approach. On a GPU whose budget holds its :func:`live_peak` (every tensor live at once, computed
from the liveness alone), such a placement compacts instead (:meth:`_Simulation.compact`): it
chooses a window of the requested size, starting or ending where a free range does, that moves
the fewest resident bytes, and moves every tensor overlapping it into the free ranges outside
it (best fit, largest first). Each move is a ``move`` vertex on the compute stream, a
device-to-device copy of one buffer into a new buffer of the same tensor that never overlaps the
old one (its bytes are taken while the old ones are still held): it reads the old buffer (a data
edge from its writer), writes the new one (reuse edges from the last accesses of the bytes it
takes), and later readers read the new one; the old bytes' next occupant waits for the move as
for any reader. So moves need nothing new from the race checker or the executors beyond the copy
itself (the sim backend's view copy, the CUDA backend's device-to-device ``copy_to_device``).
Buffers allocated but not written yet (the outputs of the vertex being placed) never move. At
such a budget nothing is then evicted as long as every compaction succeeds: what is resident is
exactly what is live, which the budget holds. Below the live peak evictions are needed anyway and
Belady's choice stands as before (``compact=True`` compacts there too; not the default, its
makespans not measured), so every graph compiled below its live peak is byte-identical to
before (``compiler_golden.json``: no digest changed).

Limitations. A move never overlaps its source, so compaction can fail when the free bytes barely
exceed the request: ``tiny_llama()`` at exactly its live peak needs a 4096-byte hole with 4096
bytes free in two pieces, 256 and 3840, every buffer between them larger than either; it then
evicts as before (one weight reloaded, 32 KiB). Over every graph the tests use, from the live
peak to 1.5x it in 1% steps, the bytes offloaded plus reloaded never grow with the budget
(``tests/exec/test_budget_monotone.py``) and the working set is the live peak or one 1% step
above it; that is checked, not proved. An overlapping move (a memmove) would close the gap but
needs chunked copies or a staging buffer on the CUDA backend: not done.

Figures (sim backend, ``CostModel.h200()``, no jitter, event-driven; every 1% step from the live
peak to 1.5x it, 37-41 budgets per graph; makespan with compaction over without, at the same
budget): the tiny checkpoints' 8/64 generation graphs 0.994-1.004 (llama-tied, qwen2, mistral;
a move is launched like a copy, 30 us of host time: at 40 us, as a kernel, up to 1.008), their
LoRA step 0.997-1.000, ``qwen2`` generating the fixture's tokens 0.987-1.009, 4-block LoRA
0.998-1.013 (1.013 at the live peak itself, where one compaction failed), full 1.000-1.001;
meanwhile nothing moves to or from the host at every budget from the (new) working set up,
where before up to 0.9 GB did (4-block LoRA). The working sets shrink: the 8/64 generation
graphs' by 13-24% (llama-tied 167,936 -> 127,744 bytes), 4-block LoRA's by 6%.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import math
from bisect import bisect_right
from dataclasses import dataclass, field

from sortedcontainers import SortedDict

from vmstoolkit.exec.errors import BudgetTooSmallError, InvalidBudgetError, InvalidGraphError, InvalidOptionError
from vmstoolkit.exec.graph import TaskGraph, TensorKind
from vmstoolkit.exec.region import OffsetAllocator

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

# What prefetch (Note [Prefetch by need time]) assumes a vertex takes: the H200's figures as
# ``CostModel.h200`` has them (GEMM rate, HBM bandwidth, pinned copies each way, fixed costs).
# Only their ratios matter: they turn "the compute between here and the use" and "the copy" into
# one unit. A wrong ratio issues reloads earlier or later than they need, never a wrong graph.
EST_FLOPS_PER_S = 41e12
EST_MEM_BYTES_PER_S = 3.0e12
EST_COPY_BYTES_PER_S = 54e9
EST_KERNEL_S = 4e-6
EST_COPY_S = 8e-6


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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
    kind: str  # "compute" | "offload" | "reload" | "move"
    op: str  # task op name, "offload", "reload" or "move"
    name: str
    gpu: int
    stream: str  # one of STREAMS
    task: int  # task vertex id (compute) or -1
    tensor: int  # tensor copied (offload/reload/move) or -1
    reads: tuple[int, ...]  # buffer ids
    writes: tuple[int, ...]  # buffer ids
    flops: float = 0.0
    nbytes: int = 0  # bytes copied (offload, reload, move, copy)
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
    def compacted_bytes(self) -> int:
        """Bytes copied device to device by compaction's ``move`` vertices (Note [Compaction
        instead of eviction]); not part of :meth:`summary`, whose keys the golden file pins."""
        return self.bytes_moved("move")

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
    weight resident plus the peak of live activations (:func:`live_peak`), plus what placement
    loses to fragmentation where compaction cannot open a hole.

    The candidates are those a walk up from the live peak in 1% steps tries (``b`` then
    ``align(int(b * 1.01) + 1)``); the first one that compiles with nothing moved to or from the
    host is found by galloping (candidates 0, 1, 3, 7, ...) and then bisecting between the last
    that moved bytes and the first that did not: O(log k) compiles for the k-th candidate, one
    when the live peak itself is enough. That takes "nothing moved" to be monotone in the budget,
    which compaction made it (Note [Compaction instead of eviction]; the walk itself is
    ``tests/exec/test_working_set.py``'s reference, equal on every graph the tests use)."""
    nbytes = [align(t.nbytes) for t in graph.tensors]
    cands = [max(live_peak(graph, nbytes, tensor_uses(graph), graph.n_gpus))]

    def candidate(i: int) -> int:
        while len(cands) <= i:
            cands.append(align(int(cands[-1] * 1.01) + 1))
        return cands[i]

    def fits(i: int) -> bool:
        mg = compile_memory_graph(graph, candidate(i), check_budget=False)
        return mg.offloaded_bytes == 0 and mg.reloaded_bytes == 0

    if fits(0):
        return cands[0]
    bad, good = 0, 1
    while not fits(good):  # gallop: 1, 3, 7, 15, ...
        bad, good = good, 2 * good + 1
    while good - bad > 1:  # invariant: candidate(bad) moves bytes, candidate(good) does not
        mid = (bad + good) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return candidate(good)


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


def live_peak(graph: TaskGraph, nbytes: list[int], uses: list[list[int]], n_gpus: int) -> list[int]:
    """Per GPU, the most bytes resident at once when nothing is ever evicted: every weight and
    input with a use from the start until its last use, every activation from its producer until
    its last use (the unconstrained compile's ``peak_bytes``, without compiling). A budget of at
    least this holds everything live at every step, so whatever the compiler evicts there it
    evicts for fragmentation alone. O(V + E)."""
    tgpu = [t.gpu for t in graph.tensors]
    used = [0] * n_gpus
    for t in graph.tensors:
        if t.kind is not TensorKind.ACTIVATION and uses[t.id]:
            used[t.gpu] += nbytes[t.id]
    peak = list(used)
    left = [len(u) for u in uses]
    for v in graph.vertices:
        for t in v.outputs:
            used[tgpu[t]] += nbytes[t]
            peak[tgpu[t]] = max(peak[tgpu[t]], used[tgpu[t]])
        for t in dict.fromkeys(v.inputs):
            left[t] -= 1
            if left[t] == 0:
                used[tgpu[t]] -= nbytes[t]
        for t in v.outputs:
            if not uses[t]:
                used[tgpu[t]] -= nbytes[t]
    return peak


def compile_memory_graph(graph: TaskGraph, budget: int, n_gpus: int | None = None, *,
                         preload: bool = True, check_budget: bool = True, recompute: bool = False,
                         prefetch: bool = True, compact: bool | None = None) -> MemoryGraph:
    """Compile ``graph`` for ``n_gpus`` GPUs (default: the graph's own) of ``budget`` bytes each.

    With ``preload``, weights and inputs are placed on the GPU before the run, in order of first
    use, while they fit; the rest start on the host. Preloaded tensors are clean (a host copy
    exists), so when the simulation needs their room, Belady drops the furthest-used ones for free.
    With ``recompute``, evicted :func:`recomputable_tensors` are dropped instead of offloaded and
    their producer rerun before the next use (module docstring). With ``prefetch`` (default),
    reloads are issued an estimated copy-length ahead of their use where room allows (Note
    [Prefetch by need time]); ``prefetch=False`` reloads right before each use. ``compact``:
    when a placement finds enough free bytes but no hole large enough, move resident tensors
    aside on the device instead of evicting (Note [Compaction instead of eviction]); None (the
    default) on each GPU whose budget holds its :func:`live_peak`, True on every GPU, False never.
    Raises :class:`BudgetTooSmallError` when one vertex alone does not fit, and
    :class:`InvalidBudgetError` for a budget that is not a positive whole number of bytes.

    The steps: check that every vertex fits (:func:`vertex_needs`), the uses of every tensor
    (:func:`tensor_uses`, the liveness), the tensors that may be recomputed, then a
    :class:`_Simulation` of the graph in program order (:meth:`~_Simulation.preload`, then
    :meth:`~_Simulation.step` per vertex: placement, eviction, offload / reload / recompute
    insertion, data and reuse edges), and :meth:`~_Simulation.memory_graph` (transitive reduction).
    """
    budget = check_budget_value(budget)
    if compact not in (None, True, False):
        raise InvalidOptionError(f"compact={compact!r}: must be True, False or None (where the budget holds the live peak)")
    n_gpus = graph.n_gpus if n_gpus is None else n_gpus
    if graph.n_gpus > n_gpus:
        raise InvalidGraphError(f"graph uses {graph.n_gpus} GPUs, compiling for {n_gpus}")
    nbytes = [align(t.nbytes) for t in graph.tensors]
    reserve, (worst, worst_name, worst_gpu) = vertex_needs(graph, nbytes, n_gpus)
    if check_budget and worst > budget:  # name the hungriest vertex, not merely the first
        raise BudgetTooSmallError(worst_name, worst_gpu, worst, budget)
    with _cyclic_gc_paused():
        uses = tensor_uses(graph)
        recomputable = recomputable_tensors(graph, uses, nbytes, budget) if recompute else set()
        if compact is None:
            compacting = [budget >= p for p in live_peak(graph, nbytes, uses, n_gpus)]
        else:
            compacting = [compact] * n_gpus
        sim = _Simulation(graph, budget, n_gpus, nbytes, uses, recomputable, reserve, compacting)
        if prefetch:
            sim.plan_prefetch()
        if preload:
            sim.preload()
        for v in graph.vertices:
            sim.step(v)
        return sim.memory_graph()


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Pause CPython's cyclic garbage collector for the block when it is on (module Note
    [Compile time per vertex]); reference counting still frees everything as usual."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def vertex_needs(graph: TaskGraph, nbytes: list[int], n_gpus: int) -> tuple[list[int], tuple[int, str, int]]:
    """What the hungriest vertex needs: per GPU, the most bytes one vertex's inputs and outputs
    take there (what a repacked region must hold, see :meth:`_Simulation.step`), and the
    ``(bytes, vertex name, gpu)`` of the hungriest vertex overall (the first one in program
    order), which no schedule can go below. O(V + E)."""
    reserve = [0] * n_gpus
    worst = (0, "", 0)
    for v in graph.vertices:
        need: dict[int, int] = {}
        for t in {*v.inputs, *v.outputs}:
            gpu = graph.tensors[t].gpu
            need[gpu] = need.get(gpu, 0) + nbytes[t]
        for gpu, b in need.items():
            reserve[gpu] = max(reserve[gpu], b)
            if b > worst[0]:
                worst = (b, v.name, gpu)
    return reserve, worst


def tensor_uses(graph: TaskGraph) -> list[list[int]]:
    """Liveness: for every tensor, the vertices that read it, as ascending positions in program
    order (a vertex reading a tensor twice counts once); a graph output gets one more use at
    position ``len(graph.vertices)``, after the last vertex, so it stays until the end. O(V + E)."""
    uses: list[list[int]] = [[] for _ in graph.tensors]
    for v in graph.vertices:
        for t in dict.fromkeys(v.inputs):
            uses[t].append(v.id)
    for t in graph.outputs:
        uses[t].append(len(graph.vertices))
    return uses


class _Fragmented(Exception):
    """A placement found enough free bytes on ``gpu`` but no contiguous ``size`` of them."""

    def __init__(self, gpu: int, size: int, tensor: str, used: int):
        self.gpu, self.size, self.tensor, self.used = gpu, size, tensor, used


class _Simulation:
    """The compile-time run of a task graph in program order, emitting its memory graph.

    State per GPU: the region's :class:`OffsetAllocator` (placement), the latest occupant of
    every byte range (``last``, for reuse edges) and a heap of resident tensors by next use
    (``heaps``, for Belady eviction; entries go stale and are skipped when popped). Per tensor:
    the position of its next use (liveness, ``use_ptr`` into ``uses``), its resident buffer, and
    the vertex that made its host copy (-1: on the host from the start). Emitted: buffers,
    vertices, the predecessors of every vertex and the kind of every edge.

    The methods are the compiler's steps:

    - :meth:`preload`: weights and inputs placed before the run;
    - per vertex, :meth:`step`: :meth:`place_or_repack` makes its inputs resident (:meth:`reload`,
      or a recompute vertex) and allocates its outputs with :meth:`new_buffer`, which evicts by
      Belady (:meth:`pop_victim`, :meth:`evict`: an offload when no clean host copy exists);
      :meth:`emit` appends the vertex with its data edges and the reuse edges :meth:`occupy`
      found; :meth:`retire_uses` advances liveness and releases dead tensors;
    - :meth:`memory_graph`: dependency minimization (transitive reduction) and the result.
    """

    def __init__(self, graph: TaskGraph, budget: int, n_gpus: int, nbytes: list[int], uses: list[list[int]],
                 recomputable: set[int], reserve: list[int], compacting: list[bool] | None = None):
        self.graph, self.budget, self.n_gpus = graph, budget, n_gpus
        self.tensors, self.tverts = graph.tensors, graph.vertices
        self.n = len(graph.vertices)
        self.nbytes = nbytes
        self.tgpu = [t.gpu for t in graph.tensors]
        self.uses = uses
        self.use_ptr = [0] * len(graph.tensors)  # index into uses[t] of the next use
        self.recomputable = recomputable
        self.reserve = reserve
        self.alloc = [OffsetAllocator(budget) for _ in range(n_gpus)]
        self.last = [SortedDict() for _ in range(n_gpus)]  # start -> (end, buffer id): latest occupant
        self.heaps: list[list] = [[] for _ in range(n_gpus)]  # (-next_use, tensor)
        self.resident: dict[int, int] = {}  # tensor -> buffer id
        self.host_copy: dict[int, int] = {t.id: -1 for t in graph.tensors if t.kind is not TensorKind.ACTIVATION}
        self.buffers: list[Buffer] = []
        self.vertices: list[MVertex] = []
        self.preds: list[set[int]] = []
        self.kinds: dict[tuple[int, int], str] = {}
        self.pending_reuse: dict[int, list[int]] = {}  # buffer id -> vertices that must precede its writer
        self.preloaded: list[int] = []
        self.prefetch_heap: list | None = None  # set by plan_prefetch
        self.compacting = compacting or [False] * n_gpus  # per GPU: compact instead of evicting
        self.unwritten: set[int] = set()  # buffers allocated whose writer is not emitted yet: never moved

    # -- prefetch (Note [Prefetch by need time]) ------------------------------------------------

    def plan_prefetch(self) -> None:
        """Estimated start ``T[p]`` of every task vertex in program order (compute only, with the
        ``EST_*`` rates) and the longest reload; prefetch is on from here."""
        nbytes = self.nbytes
        T = [0.0]
        for v in self.tverts:
            moved = sum(nbytes[t] for t in {*v.inputs, *v.outputs})
            T.append(T[-1] + EST_KERNEL_S + max(v.flops / EST_FLOPS_PER_S, moved / EST_MEM_BYTES_PER_S))
        self.T = T
        self.longest_reload = max((self.reload_estimate(t.id) for t in self.tensors), default=0.0)
        self.prefetch_heap = []  # (latest issue time T[q] - reload estimate, use q, tensor)
        self.scanned = 0  # task vertices whose inputs are in the heap: [0, scanned)

    def reload_estimate(self, t: int) -> float:
        return EST_COPY_S + self.nbytes[t] / EST_COPY_BYTES_PER_S

    def prefetch(self, p: int) -> None:
        """Before task vertex ``p``: reload every tensor whose next use ``q`` is too close to
        wait for vertex ``p + 1`` (``T[q] - T[p + 1]`` below its reload's estimate), latest issue
        time first, if room can be made by evicting only tensors used after ``q``."""
        T, h, tverts = self.T, self.prefetch_heap, self.tverts
        now = T[p + 1]
        self.scanned = max(self.scanned, p + 1)
        while self.scanned < self.n and T[self.scanned] - self.longest_reload < now:
            q = self.scanned
            for t in dict.fromkeys(tverts[q].inputs):
                heapq.heappush(h, (T[q] - self.reload_estimate(t), q, t))
            self.scanned += 1
        if any(t not in self.resident for t in tverts[p].inputs):
            return  # p's own reloads need the room first; the due prefetches wait for p + 1
        while h and h[0][0] < now:
            _, q, t = heapq.heappop(h)
            if t in self.resident or t not in self.host_copy or self.next_use(t) != q:
                continue  # resident, not written yet (or dropped for recompute), or used before q
            bid = self.new_buffer(t, set(), until=q)
            if bid is not None:  # else no room without evicting what is used by q: reloaded at q
                self.emit_reload(t, bid)

    # -- liveness -------------------------------------------------------------------------------

    def next_use(self, t: int) -> int:
        """Position of ``t``'s next use; past the end (``n + 1``) when it has none left."""
        u = self.uses[t]
        i = self.use_ptr[t]
        return u[i] if i < len(u) else self.n + 1

    def retire_uses(self, v) -> None:
        """After ``v`` ran: its inputs move to their next use (and are released after their
        last), and outputs nobody reads are released at once."""
        for t in dict.fromkeys(v.inputs):
            self.use_ptr[t] += 1
            if self.use_ptr[t] >= len(self.uses[t]):
                self.release(t)
            else:
                heapq.heappush(self.heaps[self.tgpu[t]], (-self.next_use(t), t))
        for t in v.outputs:
            if not self.uses[t]:
                self.release(t)

    # -- reuse edges ----------------------------------------------------------------------------

    def occupy(self, gpu: int, off: int, size: int, bid: int) -> list[int]:
        """Record ``bid`` as the latest occupant of its range; return the older buffers there."""
        d = self.last[gpu]
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

    # -- placement and eviction -----------------------------------------------------------------

    def new_buffer(self, t: int, pinned: set[int], until: int | None = None) -> int | None:
        """Place a new residency of ``t`` in its GPU's region, evicting the resident tensors used
        furthest in the future (never a ``pinned`` one) until it fits, and note the vertices its
        writer must wait for (the last accesses of the buffers whose bytes it takes). Raises
        :class:`_Fragmented` when evicting every unpinned tensor still leaves no room; with
        ``until`` (a prefetch), evicts only tensors next used after that position and returns
        None when that leaves no room (what it evicted stays evicted: the furthest-used ones)."""
        gpu, size = self.tgpu[t], self.nbytes[t]
        a = self.alloc[gpu]
        off = a.allocate(size)
        stash = []
        while off is None:
            if self.compacting[gpu] and a.used + size <= a.size and self.compact(gpu, size):
                off = a.allocate(size)
                break
            victim = self.pop_victim(gpu, pinned, stash)
            if victim is not None and until is not None and self.next_use(victim) <= until:
                stash.append((-self.next_use(victim), victim))
                victim = None
            if victim is None:
                for item in stash:
                    heapq.heappush(self.heaps[gpu], item)
                if until is not None:
                    return None
                raise _Fragmented(gpu, size, self.tensors[t].name, a.used)
            self.evict(victim)
            off = a.allocate(size)
        for item in stash:
            heapq.heappush(self.heaps[gpu], item)
        bid = self.add_buffer(t, gpu, off, size)
        self.resident[t] = bid
        heapq.heappush(self.heaps[gpu], (-self.next_use(t), t))
        return bid

    def add_buffer(self, t: int, gpu: int, off: int, size: int) -> int:
        """A new, not yet written buffer of ``t`` at ``off``, and the last accesses of the older
        buffers there that its writer must wait for."""
        bid = len(self.buffers)
        self.buffers.append(Buffer(bid, t, gpu, off, size, -1))
        must = []
        for ob in self.occupy(gpu, off, size, bid):
            must.extend(self.buffers[ob].last_accesses())
        self.pending_reuse[bid] = must
        self.unwritten.add(bid)
        return bid

    # -- compaction (Note [Compaction instead of eviction]) -------------------------------------

    def compact(self, gpu: int, size: int) -> bool:
        """Open a hole of ``size`` bytes on ``gpu`` by moving resident tensors, each into a free
        range outside the window it leaves (never overlapping its old bytes), with ``move``
        vertices; False, and nothing done, when no window can be emptied so. The window: among
        those starting or ending where a free range does, the one whose emptying moves the fewest
        bytes (then the lowest) among those whose tensors fit in the free ranges left outside it
        (best fit, largest first). Buffers not written yet (outputs being placed) stay put.
        O(H (log R + k) + tries * k H): H free ranges, R resident tensors, k moved per window."""
        a = self.alloc[gpu]
        holes = a.holes()
        buffers = self.buffers
        bufs = sorted((buffers[bid].offset, bid) for t, bid in self.resident.items() if self.tgpu[t] == gpu)
        offs = [o for o, _ in bufs]
        starts = set()
        for o, s in holes:
            if o + size <= a.size:
                starts.add(o)
            if o + s >= size:
                starts.add(o + s - size)
        scored = []
        for lo in starts:
            hi = lo + size
            j = max(bisect_right(offs, lo) - 1, 0)
            moved, cost = [], 0
            while j < len(bufs) and bufs[j][0] < hi:
                b = buffers[bufs[j][1]]
                if b.offset + b.size > lo:
                    if b.id in self.unwritten:
                        break
                    moved.append(b.id)
                    cost += b.size
                j += 1
            else:
                scored.append((cost, lo, moved))
        scored.sort(key=lambda c: c[:2])
        for _, lo, moved in scored:
            plan = _pack_outside(holes, lo, lo + size, [(buffers[b].size, b) for b in moved])
            if plan is not None:
                for bid, dest in plan:
                    self.move(bid, dest)
                return True
        return False

    def move(self, bid: int, dest: int) -> None:
        """Copy resident buffer ``bid`` to the free bytes at ``dest`` on its GPU (a ``move``
        vertex on the compute stream: it reads the old buffer, writes the new one, so the old
        one's next occupant waits for it) and give the old bytes back."""
        b = self.buffers[bid]
        t, gpu = b.tensor, b.gpu
        self.alloc[gpu].allocate_at(dest, b.size)
        nb = self.add_buffer(t, gpu, dest, b.size)
        self.resident[t] = nb
        self.emit("move", "move", f"move {self.tensors[t].name}", gpu, "compute", -1, t, [bid], [nb],
                  nb=self.tensors[t].nbytes)
        self.alloc[gpu].free(b.offset, len(self.vertices))

    def pop_victim(self, gpu: int, pinned: set[int], stash: list) -> int | None:
        """Belady: the resident tensor of ``gpu`` whose next use is furthest away, skipping stale
        heap entries; pinned ones are set aside in ``stash`` for the caller to push back."""
        h = self.heaps[gpu]
        while h:
            nu, t = heapq.heappop(h)
            if t not in self.resident or -nu != self.next_use(t):
                continue  # stale entry
            if t in pinned:
                stash.append((nu, t))
                continue
            return t
        return None

    def evict(self, t: int) -> None:
        """Give ``t``'s bytes back, offloading it first unless a host copy exists or it will be
        recomputed."""
        bid = self.resident.pop(t)
        b = self.buffers[bid]
        if t not in self.host_copy and t not in self.recomputable:
            self.host_copy[t] = self.emit("offload", "offload", f"offload {self.tensors[t].name}", b.gpu, "d2h", -1,
                                          t, [bid], [], nb=self.tensors[t].nbytes)
        self.alloc[b.gpu].free(b.offset, len(self.vertices))

    def release(self, t: int) -> None:
        """Give back the bytes of ``t``, which nobody reads again."""
        bid = self.resident.pop(t)
        self.alloc[self.buffers[bid].gpu].free(self.buffers[bid].offset, len(self.vertices))

    # -- vertices and their data and reuse edges -------------------------------------------------

    def emit(self, kind, op, name, gpu, stream, task, tensor, reads, writes, flops=0.0, nb=0, extra_preds=()) -> int:
        """Append a memory-graph vertex: edges from the writers of what it reads (and from
        ``extra_preds``) are data edges, edges from the pending last accesses of the bytes its
        outputs take are reuse edges."""
        buffers, kinds = self.buffers, self.kinds
        vid = len(self.vertices)
        self.vertices.append(MVertex(vid, kind, op, name, gpu, stream, task, tensor, tuple(reads), tuple(writes),
                                     flops, nb))
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
            self.unwritten.discard(b)
            for u in self.pending_reuse.pop(b):
                ps.add(u)
                kinds[(u, vid)] = "data+reuse" if kinds.get((u, vid)) == "data" else "reuse"
        ps.discard(vid)
        self.preds.append(ps)
        return vid

    # -- preload, reload and recompute ----------------------------------------------------------

    def preload(self) -> None:
        """Place weights and inputs before the run in order of first use while they fit; the
        preloaded set stays a prefix of first uses per GPU."""
        uses, tgpu = self.uses, self.tgpu
        first = sorted((uses[t.id][0], t.id) for t in self.tensors if t.kind is not TensorKind.ACTIVATION and uses[t.id])
        full = [False] * self.n_gpus
        for _, t in first:
            gpu = tgpu[t]
            if full[gpu]:
                continue
            if self.alloc[gpu].used + self.nbytes[t] > self.budget:
                full[gpu] = True
                continue
            bid = self.new_buffer(t, set())
            self.pending_reuse.pop(bid)
            self.unwritten.discard(bid)  # filled before the run
            self.preloaded.append(bid)

    def reload(self, t: int, pinned: set[int]) -> None:
        """Bring ``t`` back from its host copy into a new buffer (a ``reload`` vertex on h2d)."""
        self.emit_reload(t, self.new_buffer(t, pinned))

    def emit_reload(self, t: int, bid: int) -> None:
        self.emit("reload", "reload", f"reload {self.tensors[t].name}", self.tgpu[t], "h2d", -1, t, [], [bid],
                  nb=self.tensors[t].nbytes, extra_preds=[self.host_copy[t]])

    def place(self, v) -> list[int]:
        """Make ``v``'s inputs resident (reloading them, or rerunning the producer of a dropped
        recomputable one) and allocate its outputs."""
        tverts, resident, recomputable = self.tverts, self.resident, self.recomputable
        producer = self.graph.producer
        ins = list(dict.fromkeys(v.inputs))
        pinned = set(ins) | set(v.outputs)
        for t in ins:  # a rerun's inputs stay put until v runs: no hole opens under v's tensors
            if t not in resident and t in recomputable:
                pinned.update(tverts[producer[t]].inputs)
        for t in ins:
            if t not in resident and t in recomputable:
                pv = tverts[producer[t]]
                for i in dict.fromkeys(pv.inputs):
                    if i not in resident:
                        self.reload(i, pinned)
                bid = self.new_buffer(t, pinned)
                rid = self.emit("compute", pv.op, f"recompute {pv.name}", pv.gpu, "compute", pv.id, -1,
                                [resident[i] for i in pv.inputs], [bid], flops=pv.flops)
                self.vertices[rid].recompute = True
            elif t not in resident:
                if t not in self.host_copy:
                    raise AssertionError(f"{self.tensors[t].name} is neither resident nor on the host")
                self.reload(t, pinned)
        return [self.new_buffer(t, pinned) for t in v.outputs]

    def place_or_repack(self, v) -> list[int]:
        """:meth:`place` ``v``; when the holes left around its pinned tensors are too small
        although the total fits, evict everything on that GPU (clean tensors are dropped, the
        others offloaded) and place again into the empty region, which packs from offset 0 and
        so always succeeds (the total was checked by :func:`vertex_needs`)."""
        try:
            return self.place(v)
        except _Fragmented as e:
            for t in v.outputs:  # allocated by the failed attempt, not written: void them
                if t in self.resident:
                    bid = self.resident.pop(t)
                    b = self.buffers[bid]
                    b.writer, b.inherited = -2, self.pending_reuse.pop(bid)
                    self.unwritten.discard(bid)
                    self.alloc[b.gpu].free(b.offset, len(self.vertices))
            for t in [t for t in self.resident if self.tgpu[t] == e.gpu]:
                self.evict(t)
            try:
                return self.place(v)
            except _Fragmented as e2:
                raise BudgetTooSmallError(v.name, e2.gpu, self.reserve[e2.gpu], self.budget,
                                          detail=f"no contiguous {e2.size} bytes for {e2.tensor!r}") from None

    def step(self, v) -> None:
        """Run task vertex ``v``: place it, emit its compute (or copy) vertex, retire its uses."""
        if self.prefetch_heap is not None:
            self.prefetch(v.id)
        outs = self.place_or_repack(v)
        nb = sum(self.tensors[t].nbytes for t in v.outputs) if v.op == "copy" else 0
        self.emit("compute", v.op, v.name, v.gpu, "h2d" if v.op == "copy" else "compute", v.id, -1,
                  [self.resident[t] for t in v.inputs], outs, flops=v.flops, nb=nb)
        self.retire_uses(v)

    # -- dependency minimization ----------------------------------------------------------------

    def memory_graph(self) -> MemoryGraph:
        """The memory graph of the run: every edge implied by others dropped
        (:func:`transitive_reduction`), edge kinds kept for the edges that remain."""
        output_location = {t: self.resident.get(t, -1) for t in self.graph.outputs}
        edges_before = sum(len(p) for p in self.preds)
        reduced = transitive_reduction(self.preds)
        kept = {(u, v) for v, ps in enumerate(reduced) for u in ps}
        return MemoryGraph(self.graph, self.budget, self.n_gpus, self.vertices, self.buffers, reduced, self.preloaded,
                           output_location, [a.peak for a in self.alloc], edges_before,
                           {e: k for e, k in self.kinds.items() if e in kept})


def _pack_outside(holes: list[tuple[int, int]], lo: int, hi: int, items: list[tuple[int, int]]):
    """Destinations for ``items`` (``(size, buffer id)``) in the free ranges ``holes`` less the
    window ``[lo, hi)``: largest first, each in the smallest range it fits (then the lowest), at
    that range's low end. A list of ``(buffer id, offset)``, or None when one does not fit."""
    free = []
    for o, s in holes:
        if o < lo:
            free.append([o, min(o + s, lo) - o])
        if o + s > hi:
            start = max(o, hi)
            free.append([start, o + s - start])
    plan = []
    for size, bid in sorted(items, key=lambda i: (-i[0], i[1])):
        best = None
        for f in free:
            if f[1] >= size and (best is None or (f[1], f[0]) < (best[1], best[0])):
                best = f
        if best is None:
            return None
        plan.append((bid, best[0]))
        best[0] += size
        best[1] -= size
    return plan


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
