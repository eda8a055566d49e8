"""Executors of a memory graph over a backend, on one asyncio event loop.

A backend (``backends.sim.SimBackend``, ``backends.cuda.CudaBackend``) speaks
:class:`~vmstoolkit.exec.backends.base.Backend`; the executors use:

- ``setup(mg)``: take one region of ``mg.budget`` bytes per GPU, fill the preloaded buffers;
- ``launch(v) -> token``: enqueue vertex ``v`` on the stream ``(v.gpu, v.stream)`` of a small
  pool (compute, host-to-device, device-to-host per GPU) and mark its end (an event);
- ``completion(token) -> asyncio.Future``: resolves, on the running loop, once that work is done;
- ``clock() -> float`` (seconds), and ``drive(done)``: a coroutine run beside the executor until
  ``done`` resolves (the sim backend advances its virtual clock there; cuda just waits).

The **event-driven** executor keeps the set of ready vertices (a heap by compile order, so the
most urgent one goes first), launches them, and releases each vertex's successors when its
completion arrives, in whatever order the work finishes. Several GPUs share the same loop.

With ``lookahead`` (default), an edge between two vertices of the *same stream* is satisfied as
soon as the first is launched: the stream runs its work in order, so the second can be queued
behind it at once instead of leaving the stream idle for a host round trip. Edges across
streams always wait for the completion.

The **fixed-order** executor applies the same rules but launches in compile order only: a
vertex waits for every vertex before it to have been launched (head-of-line blocking).
"""

from __future__ import annotations

import asyncio
import heapq
import time
from dataclasses import dataclass, field

from vmstoolkit.exec.dag import check_acyclic
from vmstoolkit.exec.errors import ExecutionError, InvalidOptionError


# Copy streams are FIFO: a copy queued early, but needed late, delays one that becomes ready
# after it and is needed first. Holding at most COPY_DEPTH copies in flight per copy stream
# (the rest wait in the ready heap, ordered by urgency) fixed that. Sim, 16 LLaMA-7B blocks,
# 8 parts, budget 1/8 of the working set, makespan / lower bound (mean of 3 seeds):
# unlimited 1.109, depth 4 1.076, depth 2 1.060, depth 1 1.044 (fixed order 1.033).
# Depth 1 would leave the copy engine idle for a host round trip between small copies on a
# real GPU, so 2.
COPY_DEPTH = 2


@dataclass
class RunResult:
    executor: str
    makespan_s: float
    n_vertices: int
    launch_order: list[int] = field(default_factory=list)
    finish_order: list[int] = field(default_factory=list)
    host_s: float = 0.0  # host wall time of the whole run


async def _run(mg, backend, *, fixed_order: bool, lookahead: bool, copy_depth: int | None = None) -> RunResult:
    """The executors' common loop.

    Ready vertices wait in one heap per stream (by compile order). A drain launches, while any
    stream may take work, the smallest ready vertex among the streams that may: compute
    streams always may; a copy stream while fewer than ``copy_depth`` of its copies are in
    flight. That is the most urgent launchable vertex first, as one global heap would give,
    but a copy held back by a full stream is not touched again until its stream has room: one
    global heap popped and re-pushed every held-back copy on every completion, O(V) per
    completion and O(V^2) per run (2000 small LLaMA blocks, 41k vertices with thousands of
    reloads waiting: 33 s on the sim backend, now 0.4 s; ``benchmarks/offload_executor_scale.py``).

    Runtime complexity: O((V + E) log V) plus O(S log S) per completion (S: streams, 3 a GPU).
    """
    loop = asyncio.get_running_loop()
    verts = mg.vertices
    n = len(verts)
    succs = mg.succs()
    keys = sorted({(v.gpu, v.stream) for v in verts})
    kid = {k: i for i, k in enumerate(keys)}
    key = [kid[(v.gpu, v.stream)] for v in verts]
    limit = [None if copy_depth is None or s == "compute" else copy_depth for _, s in keys]
    unsat = [len(p) for p in mg.preds]
    ready: list[list[int]] = [[] for _ in keys]  # per stream, a heap of vertex ids
    for v in range(n):
        if unsat[v] == 0:
            ready[key[v]].append(v)
    for h in ready:
        heapq.heapify(h)
    done = loop.create_future()
    state = {"remaining": n, "next": 0}
    launch_order: list[int] = []
    finish_order: list[int] = []
    inflight = [0] * len(keys)

    def release(s: int) -> None:
        unsat[s] -= 1
        if unsat[s] == 0 and not fixed_order:
            heapq.heappush(ready[key[s]], s)

    def launch(v: int) -> None:
        token = backend.launch(verts[v])
        inflight[key[v]] += 1
        launch_order.append(v)
        if lookahead:
            for s in succs[v]:
                if key[s] == key[v]:
                    release(s)
        backend.completion(token).add_done_callback(lambda f, v=v: finished(v, f))

    def finished(v: int, f) -> None:
        if f.cancelled() or f.exception() is not None:
            if not done.done():
                done.set_exception(f.exception() or asyncio.CancelledError())
            return
        finish_order.append(v)
        inflight[key[v]] -= 1
        for s in succs[v]:
            if not (lookahead and key[s] == key[v]):
                release(s)
        state["remaining"] -= 1
        drain()
        if state["remaining"] == 0 and not done.done():
            done.set_result(None)

    def open_(k: int) -> bool:
        return bool(ready[k]) and (limit[k] is None or inflight[k] < limit[k])

    def drain() -> None:
        if fixed_order:
            # launch strictly in compile order
            while state["next"] < n and unsat[state["next"]] == 0:
                launch(state["next"])
                state["next"] += 1
            return
        heads = [(ready[k][0], k) for k in range(len(keys)) if open_(k)]
        heapq.heapify(heads)
        while heads:
            _, k = heapq.heappop(heads)
            launch(heapq.heappop(ready[k]))  # may release more work on stream k (lookahead)
            if open_(k):
                heapq.heappush(heads, (ready[k][0], k))

    t_host = time.perf_counter()
    t0 = backend.clock()
    drain()
    if n == 0:
        done.set_result(None)
    driver = asyncio.ensure_future(backend.drive(done))
    try:
        # the backend's drive loop can fail (the sim backend finds nothing in flight): end the
        # run with its error instead of waiting for a completion that will never come
        await asyncio.wait((done, driver), return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            done.cancel()
            driver.result()  # raises the backend's error
            raise ExecutionError(f"the backend's drive loop ended with {state['remaining']} of {n} vertices unfinished")
        await done
    finally:
        await driver
    makespan = backend.clock() - t0
    return RunResult("fixed-order" if fixed_order else "event-driven", makespan, n, launch_order, finish_order,
                     time.perf_counter() - t_host)


async def run_event_driven(mg, backend, *, lookahead: bool = True, copy_depth: int | None = COPY_DEPTH) -> RunResult:
    """Run ``mg`` on ``backend`` (already ``setup``) launching whatever is ready, most urgent
    (earliest in compile order) first; at most ``copy_depth`` copies queued per copy stream.
    Raises :class:`~vmstoolkit.exec.errors.CycleError` first if ``mg`` has a cycle."""
    check_acyclic(mg)
    return await _run(mg, backend, fixed_order=False, lookahead=lookahead, copy_depth=copy_depth)


async def run_fixed_order(mg, backend, *, lookahead: bool = True) -> RunResult:
    """Run ``mg`` on ``backend`` launching vertices in compile order only (a cycle: as above)."""
    check_acyclic(mg)
    return await _run(mg, backend, fixed_order=True, lookahead=lookahead)


EXECUTORS = {"event-driven": run_event_driven, "fixed-order": run_fixed_order}


async def execute_async(mg, backend, executor: str = "event-driven", **kw) -> RunResult:
    """Set up ``backend`` for ``mg`` and run it on the running event loop (``await`` it from
    async code or a notebook, where a loop is already running)."""
    if executor not in EXECUTORS:
        raise InvalidOptionError(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
    check_acyclic(mg)  # before the backend takes its GPU regions (again in the executor: O(V + E))
    backend.setup(mg)
    return await EXECUTORS[executor](mg, backend, **kw)


def execute(mg, backend, executor: str = "event-driven", **kw) -> RunResult:
    """Set up ``backend`` for ``mg`` and run it to completion on a fresh event loop.

    Inside a running loop (async code, Jupyter) use ``await execute_async(...)`` instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(execute_async(mg, backend, executor, **kw))
    raise ExecutionError("execute() starts its own event loop; inside a running one (async code, "
                       "Jupyter) use `await execute_async(mg, backend, executor)`")
