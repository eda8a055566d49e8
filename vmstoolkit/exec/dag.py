"""Order of a memory graph's vertices: a topological order, or the cycle that prevents one.

A graph built by the compiler is acyclic (vertex ids are a topological order), but one edited by
hand or by a tool may not be: the executors would wait forever on the cycle's vertices, so they
and the race checker refuse it first, naming the cycle.
"""

from __future__ import annotations

from vmstoolkit.exec.errors import CycleError


def topological_positions(preds: list[list[int]], names: list[str] | None = None) -> list[int]:
    """Position of every vertex in a topological order of the graph given by ``preds`` (Kahn's
    algorithm, duplicate edges counted once). Raises :class:`CycleError` with one cycle, named by
    ``names`` (default: the vertex ids), when there is none.

    Runtime complexity: O(V + E).
    """
    n = len(preds)
    pset = [set(p) for p in preds]
    indeg = [len(p) for p in pset]
    succ: list[list[int]] = [[] for _ in range(n)]
    for v, ps in enumerate(pset):
        for u in ps:
            succ[u].append(v)
    stack = [v for v in range(n) if indeg[v] == 0]
    pos = [-1] * n
    k = 0
    while stack:
        u = stack.pop()
        pos[u] = k
        k += 1
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                stack.append(v)
    if k != n:
        cycle = _cycle_among(pset, pos)
        raise CycleError(cycle, [names[v] if names is not None else str(v) for v in cycle])
    return pos


def check_acyclic(mg) -> None:
    """Raise :class:`CycleError` if memory graph ``mg``'s edges form a cycle. O(V + E).

    The compiler numbers vertices in a topological order, so first the cheap test that every
    edge goes from a lower id to a higher one (0.05 s at 83k vertices, against 0.5 s for a
    topological sort); only a graph that fails it is sorted, to name its cycle or accept it."""
    preds = mg.preds
    if all(max(ps, default=-1) < v for v, ps in enumerate(preds)):
        return
    topological_positions(preds, [v.name for v in mg.vertices])


def _cycle_among(pset: list[set[int]], pos: list[int]) -> list[int]:
    """One cycle among the vertices Kahn's algorithm left unordered (``pos == -1``), as a path
    ``[a, ..., a]`` along edges. Each of them keeps an unordered predecessor (else it would have
    been ordered), so walking predecessors from any of them must repeat a vertex."""
    v = next(i for i, p in enumerate(pos) if p < 0)
    seen: dict[int, int] = {}
    walk: list[int] = []
    while v not in seen:
        seen[v] = len(walk)
        walk.append(v)
        v = min(u for u in pset[v] if pos[u] < 0)
    back = walk[seen[v]:] + [v]  # v <- ... <- v, along predecessor links
    return back[::-1]
