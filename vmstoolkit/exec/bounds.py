"""Lower bounds on the makespan of a memory graph, from the durations of its vertices.

Every stream runs one vertex at a time, in any order the edges allow. Two bounds follow:

- **resource**: the busiest stream's total work (per GPU: compute, host-to-device copies,
  device-to-host copies), the classic ``max(compute, copies)``;
- **precedence** (:func:`precedence_bound`): for any vertex ``v`` and streams ``s``, ``s'``,
  every ancestor of ``v`` on ``s`` has finished before ``v`` starts, and they ran one at a time,
  so ``v`` starts no earlier than their summed durations; every descendant of ``v`` on ``s'``
  starts after ``v`` ends, one at a time. So the run lasts at least
  ``A_s(v) + d(v) + D_s'(v)``: the ancestors' work on one stream, ``v``, the descendants' work
  on another. It holds for every executor (edges satisfied early on one stream are still run in
  order there), and exceeds the resource bound where compute and copies must take turns: the
  weights a block needs must all pass the one copy stream before its first GEMM, and what the
  optimizer writes back must pass the other one after the last.

Note [Why a precedence bound]
-----------------------------
Rationale. Issue 32 asked whether the step's bound was right. ``max(compute, copies)`` is a
valid bound but loose exactly where the executor is studied: when copies and compute are close.
LoRA on 12 blocks 5120 wide at a quarter of its working set moves 0.44 s of reloads against
0.50 s of compute (sim, default costs); the event-driven step was 1.18x the resource bound,
and a prototype of this bound put 10% of that gap in the graph itself.

Approach. One pass in compile order (a topological order) keeps each vertex's ancestors as a
Python int bitset and sums their durations per stream (numpy over the unpacked bits); a pass in
reverse does the same for descendants. A vertex's set is freed after its last successor
(predecessor) is processed, as :func:`~vmstoolkit.exec.compiler.transitive_reduction` does.

Runtime complexity: O(V * (V / 64 + S V / 8)) word and byte operations (S: streams), about
0.1 s at 2,500 vertices; graphs over :data:`MAX_VERTICES` are not bounded this way (None).
"""

from __future__ import annotations

import numpy as np

# Above this many vertices the precedence bound is skipped (O(V^2) work: ~2 s at 20,000).
MAX_VERTICES = 20_000


def resource_bound(mg, durations) -> float:
    """The busiest stream's total work: ``max`` over (GPU, stream) of its vertices' durations."""
    busy: dict[tuple[int, str], float] = {}
    for v, d in zip(mg.vertices, durations):
        k = (v.gpu, v.stream)
        busy[k] = busy.get(k, 0.0) + d
    return max(busy.values(), default=0.0)


def _sums(order, neighbours, n_left, dur_by_stream, n) -> np.ndarray:
    """For every vertex, the summed durations per stream of the vertices reachable backwards
    through ``neighbours`` (ancestors with predecessors, descendants with successors), visiting
    ``order``; ``n_left[u]``: how many vertices still need ``u``'s set."""
    out = np.zeros((n, dur_by_stream.shape[0]))
    sets: dict[int, int] = {}
    nbytes = (n + 7) // 8
    for v in order:
        s = 0
        for u in neighbours[v]:
            s |= sets[u] | (1 << u)
            n_left[u] -= 1
            if n_left[u] == 0:
                del sets[u]
        if s:
            bits = np.unpackbits(np.frombuffer(s.to_bytes(nbytes, "little"), np.uint8), bitorder="little")[:n]
            out[v] = dur_by_stream @ bits
        if n_left[v]:
            sets[v] = s
    return out


def precedence_bound(mg, durations) -> tuple[float, int] | None:
    """``(seconds, vertex)``: the largest ``A_s(v) + d(v) + D_s'(v)`` over vertices ``v`` and
    streams ``s, s'`` (module docstring) and the ``v`` that reaches it; None for a graph of more
    than :data:`MAX_VERTICES` vertices."""
    n = len(mg.vertices)
    if n == 0:
        return 0.0, -1
    if n > MAX_VERTICES:
        return None
    keys = sorted({(v.gpu, v.stream) for v in mg.vertices})
    kid = {k: i for i, k in enumerate(keys)}
    d = np.asarray(durations, dtype=float)
    by_stream = np.zeros((len(keys), n))
    for i, v in enumerate(mg.vertices):
        by_stream[kid[(v.gpu, v.stream)], i] = d[i]
    preds = mg.preds
    succs = mg.succs()
    anc = _sums(range(n), preds, [len(s) for s in succs], by_stream, n)
    desc = _sums(range(n - 1, -1, -1), succs, [len(p) for p in preds], by_stream, n)
    total = anc.max(axis=1) + d + desc.max(axis=1)
    v = int(np.argmax(total))
    return float(total[v]), v
