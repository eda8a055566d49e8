"""Static race freedom of a memory graph.

Two buffers of one GPU whose byte ranges overlap must be ordered by the graph: every access of
the older one (its readers, or its writer if nobody reads it) must be an ancestor of the newer
one's writer. Every reader must also descend from its buffer's writer (read after write).

The checker trusts nothing the compiler recorded about reuse: it sorts the buffers of each GPU by
the position of their writer in a topological order it computes itself, sweeps their byte
ranges, and checks each buffer against the previous occupant of every byte it covers. That
suffices: if A precedes B and B precedes C on a byte, A's accesses precede B's writer, which
precedes (or is) B's last access, which precedes C's writer. A graph that orders overlapping
buffers the other way round from the sort is caught too, because its writers would sort the
other way.

Runtime complexity: O(B log B) for the sweep plus O(E * V / 64) word operations for ancestor
bitsets (Python ints, freed after their last successor).
"""

from __future__ import annotations

from collections import defaultdict

from sortedcontainers import SortedDict

from vmstoolkit.exec.dag import topological_positions
from vmstoolkit.exec.errors import RaceError

__all__ = ["check_race_free", "topological_positions"]


def check_race_free(mg) -> int:
    """Raise :class:`RaceError` unless ``mg`` (a MemoryGraph) is race free, or
    :class:`~vmstoolkit.exec.errors.CycleError` if it has a cycle; return the number of
    orderings that were proved."""
    preds = mg.preds
    pos = topological_positions(preds, [v.name for v in mg.vertices])
    order = sorted(range(len(preds)), key=pos.__getitem__)
    # requirements: writer vertex -> [(vertex that must precede it, description)]
    need: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # w -> (u, old buffer, new buffer)
    by_gpu = defaultdict(list)
    for b in mg.buffers:
        if b.writer == -2:
            continue  # void: never written nor read
        by_gpu[b.gpu].append(b)
        for r in b.readers:
            if b.writer >= 0:
                need[r].append((b.writer, b.id, b.id))
    for gpu, bufs in by_gpu.items():
        bufs.sort(key=lambda b: pos[b.writer] if b.writer >= 0 else -1)
        occ = SortedDict()  # start -> (end, buffer)
        for b in bufs:
            lo, hi = b.offset, b.offset + b.size
            i = max(occ.bisect_right(lo) - 1, 0)
            hit = []
            for k in occ.islice(i):
                if k >= hi:
                    break
                e, ob = occ[k]
                if e > lo:
                    hit.append(k)
            for k in hit:
                e, ob = occ.pop(k)
                old = mg.buffers[ob]
                if b.writer < 0 and old.writer < 0:
                    raise RaceError(_bname(mg, old), _bname(mg, b), gpu, max(k, lo), min(e, hi))
                for u in old.last_accesses():
                    need[b.writer].append((u, ob, b.id))
                if k < lo:
                    occ[k] = (lo, ob)
                if e > hi:
                    occ[hi] = (e, ob)
            occ[lo] = (hi, b.id)
    # ancestors in topological order; check requirements at each vertex
    succ_count = [0] * len(preds)
    for ps in preds:
        for u in set(ps):
            succ_count[u] += 1
    anc: dict[int, int] = {}
    proved = 0
    for v in order:
        a = 0
        for u in set(preds[v]):
            a |= anc[u] | (1 << u)
            succ_count[u] -= 1
            if succ_count[u] == 0:
                del anc[u]
        for u, ob, nb in need.get(v, ()):
            if u == v and ob == nb:
                continue
            if not (a >> u) & 1:
                old, new = mg.buffers[ob], mg.buffers[nb]
                lo, hi = max(old.offset, new.offset), min(old.offset + old.size, new.offset + new.size)
                first = f"{_bname(mg, old)} (accessed by {_vname(mg, u)})"
                second = f"{_bname(mg, new)} (written by {_vname(mg, v)})" if ob != nb else f"its reader {_vname(mg, v)}"
                raise RaceError(first, second, new.gpu, lo, hi)
            proved += 1
        if succ_count[v]:
            anc[v] = a
    return proved


def _bname(mg, b) -> str:
    return f"buffer {b.id} of {mg.graph.tensors[b.tensor].name!r}"


def _vname(mg, v: int) -> str:
    return f"vertex {v} {mg.vertices[v].name!r}"
