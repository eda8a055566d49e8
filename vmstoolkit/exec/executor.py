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

Note [Scheduling at shapes nobody tuned]
----------------------------------------
Rationale. Issue 32: LoRA on 12 blocks 5120 wide (40 heads, 8 KV heads, FFN 13824, 1 x 1536) at
half its working set ran at 1.27x its bound on the H200, fixed-order a little faster; the
project's own shape sits at 0.99-1.06x. That step moves 13.9 GB in 688 reloads, 400 of them
LoRA adapters and their Adam moments of 0.1-1 MB, against 0.58 s of compute, and our GEMM
launches cost 70-225 us of host time each (``experiments/results/gemm-h200/run8``). The sim
backend with the default costs (6 us a launch) put the executor at 1.06x; with the H200's host
costs (:meth:`~vmstoolkit.exec.backends.sim.CostModel.h200`) it gives 1.09x at half and 1.23x at
a quarter. Two host round trips were in the way: (1) a compute vertex whose reload had been
launched still waited for the host to see the copy finish before it was queued, while the
host was busy launching 150-us GEMMs; (2) at most two copies in flight per copy stream meant a
host round trip every two 20-us copies.

Approach. (1) With a backend that can make a stream wait on the GPU (``device_waits``: the sim
and CUDA backends, ``cuStreamWaitEvent``), a compute vertex whose predecessors are all launched
on its GPU is *armed* and may be queued at once, its stream waiting on the copies' events.
Copies are never armed: a copy queued behind a wait would hold up every copy after it in its
FIFO (armed copies took prefill at 512 tokens from 1.06x to 1.38x of its bound in the sim).
(2) Besides ``COPY_DEPTH``, a copy stream takes more copies while those in flight hold at
most ``COPY_WINDOW`` bytes.

Figures (sim backend, :meth:`CostModel.h200`, jitter 5%, mean of 3 seeds, step / max(compute,
copies), before -> after): the issue's shape at half 1.093 -> 1.063, at a quarter 1.231 ->
1.177 (fixed-order 1.162, 1.380); 16 LLaMA-7B blocks LoRA at 2048 tokens, a quarter 1.156 ->
1.122; prefill at 512 tokens, half 1.178 -> 1.164; with the default costs the same cases within
0.6% of before (Yi-34B LoRA at a quarter excepted: 1.256 -> 1.300 with the default costs,
which the copy window costs; with the H200's, 1.286 -> 1.277). What remains at a quarter is
mostly the bound: max(compute, copies) ignores that the reloads a vertex needs must all pass the
one copy stream before it. :mod:`vmstoolkit.exec.bounds`' precedence bound is 1.105x that at the
issue's shape at a quarter, and the step 1.10x of it (``experiments/results/untuned-shapes``).

Note [Compute streams in compile order]
---------------------------------------
Rationale. A stream runs its work in the order it was queued. With lookahead and armed
launches, the event-driven executor queued compute far ahead of the GPU (130 ms of it at once,
Yi-34B at half the working set on the sim backend), in whatever order vertices became
launchable: a block's backward went in before the AdamW updates of the block before, whose Adam
moments were still being reloaded. The updates then ran 90 ms late, and a weight reload that
reused their bytes waited for them: event-driven 1.083x its bound, fixed-order 1.038x.

Approach. ``compute_in_order`` (default): a compute stream takes only its first unlaunched
vertex in compile order, when it is ready or armed, and while fewer than ``COMPUTE_DEPTH`` (16)
of its vertices are in flight; copies still go in any order (most urgent ready one first),
which is where launching out of order pays. The depth is a measured choice (``COMPUTE_DEPTH``),
not a derived one: with the H200's host costs the host is a serial resource (a GEMM launch
150 us) and a bounded compute queue leaves it freer for copies, but the copy stream's idle gaps
of ~1.7-1.9 ms before each 88 MB reload in Mistral-7B's backward at a quarter stay with it (not
explained yet).

Figures (``experiments/results/untuned-shapes``, sim, H200 costs, on the compiler's prefetching
graphs, step before -> after): Yi-34B at half 0.482 -> 0.456 s (fixed-order 0.462), at a quarter
0.487 -> 0.484; the issue's shape at a quarter 0.628 -> 0.624; Qwen2-7B at half 0.584 -> 0.554,
Mistral-7B 0.566 -> 0.556; at a quarter both 0.5% slower (0.639 -> 0.642, 0.645 -> 0.647), and
with the depth of 16: 0.628 and 0.641 (Qwen2-7B 1.08x its bound). Fixed-order is unchanged.
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
# ... unless the copies in flight are small: up to COPY_WINDOW bytes (1.2 ms at 54 GB/s) may be
# queued, so that a run of small copies (LoRA adapters and their moments: 0.3-1 MB each) does not
# leave the copy engine idle for a host round trip every two copies. Note [Scheduling at shapes
# nobody tuned].
COPY_WINDOW = 64 << 20
# With compute in compile order (Note [Compute streams in compile order]), a compute stream takes
# more work while fewer than COMPUTE_DEPTH of its vertices are in flight: enough queued that it
# never waits for a host round trip (4 and 8 lose at half the working set), few enough that the
# host, which pays 150 us a GEMM launch on the H200, is not spent far ahead of the GPU. Chosen
# on the tuning shapes (the 5120-wide case and 16 LLaMA-2-7B blocks, LoRA, 1536 tokens,
# sim, H200 costs; sum of four steps at half and a quarter): unlimited 2.389 s, 4: 2.478,
# 8: 2.395, 16: 2.362, 32: 2.369.
COMPUTE_DEPTH = 16


@dataclass
class RunResult:
    executor: str
    makespan_s: float
    n_vertices: int
    launch_order: list[int] = field(default_factory=list)
    finish_order: list[int] = field(default_factory=list)
    host_s: float = 0.0  # host wall time of the whole run


async def _run(mg, backend, *, fixed_order: bool, lookahead: bool, copy_depth: int | None = None,
               copy_window: int = 0, device_waits: bool = False, compute_in_order: bool = False,
               compute_depth: int | None = None) -> RunResult:
    """The executors' common loop.

    Ready vertices wait in one heap per stream (by compile order). A drain launches, while any
    stream may take work, the smallest ready vertex among the streams that may: compute
    streams always may; a copy stream while fewer than ``copy_depth`` of its copies are in
    flight, or while its bytes in flight, the next copy's included, stay within
    ``copy_window``. That is the most urgent launchable vertex first, as one global heap would give,
    but a copy held back by a full stream is not touched again until its stream has room: one
    global heap popped and re-pushed every held-back copy on every completion, O(V) per
    completion and O(V^2) per run (2000 small LLaMA blocks, 41k vertices with thousands of
    reloads waiting: 33 s on the sim backend, now 0.4 s; ``benchmarks/offload_executor_scale.py``).

    With ``device_waits`` (the backend's ``launch(v, after)`` makes the stream wait on the GPU
    for the ends of the vertices ``after``), a vertex whose predecessors are all *launched* on
    its GPU is *armed*: it may go before they finish, its stream waiting for them on the device,
    with no host round trip in between. A compute stream takes the smallest of its ready and
    armed vertices; a copy stream takes an armed copy only when it is idle and has nothing
    ready (a copy queued behind a wait holds up every copy after it). Note [Scheduling at
    shapes nobody tuned] says why.

    With ``compute_in_order``, a compute stream takes its vertices in compile order only (its
    first unlaunched one, when it is ready or armed), and while fewer than ``compute_depth``
    (None: no limit) of them are in flight; copies still go in any order. Note [Compute streams
    in compile order] says why.

    Runtime complexity: O((V + E) log V) plus O(S log S) per completion (S: streams, 3 a GPU).
    """
    loop = asyncio.get_running_loop()
    verts = mg.vertices
    n = len(verts)
    succs = mg.succs()
    preds = mg.preds
    keys = sorted({(v.gpu, v.stream) for v in verts})
    kid = {k: i for i, k in enumerate(keys)}
    key = [kid[(v.gpu, v.stream)] for v in verts]
    is_copy = [s != "compute" for _, s in keys]
    limit = [None if copy_depth is None or not c else copy_depth for c in is_copy]
    unsat = [len(p) for p in preds]
    unlaunched = [len(p) for p in preds]
    launched = [False] * n
    finished_ = [False] * n
    # a vertex may be armed only if every predecessor is on its GPU (a wait across GPUs is not asked of backends)
    armable = [device_waits and not fixed_order and not is_copy[key[v]]
               and all(verts[u].gpu == verts[v].gpu for u in preds[v]) for v in range(n)]
    in_order = [compute_in_order and not fixed_order and not c for c in is_copy]
    members: list[list[int]] = [[] for _ in keys]  # per stream, its vertex ids in compile order
    for v in range(n):
        members[key[v]].append(v)
    first = [0] * len(keys)  # per stream, index into members of its first unlaunched vertex
    ready: list[list[int]] = [[] for _ in keys]  # per stream, a heap of vertex ids
    armed: list[list[int]] = [[] for _ in keys]  # per stream, a heap of armed vertex ids (stale entries skipped)
    for v in range(n):
        if unsat[v] == 0 and not in_order[key[v]]:
            ready[key[v]].append(v)
    for h in ready:
        heapq.heapify(h)
    done = loop.create_future()
    state = {"remaining": n, "next": 0}
    launch_order: list[int] = []
    finish_order: list[int] = []
    inflight = [0] * len(keys)
    inflight_bytes = [0] * len(keys)

    def release(s: int) -> None:
        unsat[s] -= 1
        if unsat[s] == 0 and not fixed_order and not launched[s] and not in_order[key[s]]:
            heapq.heappush(ready[key[s]], s)

    def launch(v: int, after=None) -> None:
        token = backend.launch(verts[v], after) if after else backend.launch(verts[v])
        launched[v] = True
        inflight[key[v]] += 1
        inflight_bytes[key[v]] += verts[v].nbytes
        launch_order.append(v)
        for s in succs[v]:
            unlaunched[s] -= 1
            if lookahead and key[s] == key[v]:
                release(s)
            if armable[s] and unlaunched[s] == 0 and unsat[s] > 0 and not in_order[key[s]]:
                heapq.heappush(armed[key[s]], s)
        backend.completion(token).add_done_callback(lambda f, v=v: finished(v, f))

    def finished(v: int, f) -> None:
        # A done-callback's exception would only be logged by asyncio and the run would go on (or
        # stall): whatever fails here (a launch that drain() makes) ends the run with that error.
        try:
            _finished(v, f)
        except BaseException as e:
            if not done.done():
                done.set_exception(e)

    def _finished(v: int, f) -> None:
        if done.done():  # the run already failed: launch nothing more
            return
        if f.cancelled() or f.exception() is not None:
            done.set_exception(f.exception() or asyncio.CancelledError())
            return
        finish_order.append(v)
        finished_[v] = True
        inflight[key[v]] -= 1
        inflight_bytes[key[v]] -= verts[v].nbytes
        for s in succs[v]:
            if not (lookahead and key[s] == key[v]):
                release(s)
        state["remaining"] -= 1
        drain()
        if state["remaining"] == 0 and not done.done():
            done.set_result(None)

    def armed_top(k: int) -> int | None:
        h = armed[k]
        while h and (launched[h[0]] or unsat[h[0]] == 0):  # launched, or ready since: stale
            heapq.heappop(h)
        return h[0] if h else None

    def pick(k: int) -> tuple[int, bool] | None:
        """The vertex stream ``k`` would take now, and whether it goes armed; None if none."""
        if in_order[k]:
            if compute_depth is not None and inflight[k] >= compute_depth:
                return None
            m, i = members[k], first[k]
            while i < len(m) and launched[m[i]]:
                i += 1
            first[k] = i
            if i == len(m):
                return None
            v = m[i]
            if unsat[v] == 0:
                return v, False
            if armable[v] and unlaunched[v] == 0:
                return v, True
            return None
        r = ready[k]
        if r and (limit[k] is None or inflight[k] < limit[k]
                  or inflight_bytes[k] + verts[r[0]].nbytes <= copy_window):
            if is_copy[k] or not device_waits:
                return r[0], False
            a = armed_top(k)
            return (r[0], False) if a is None or r[0] < a else (a, True)
        if device_waits and not is_copy[k]:
            a = armed_top(k)
            if a is not None:
                return a, True
        return None

    def go(k: int, v: int, arm: bool) -> None:
        if arm:
            launch(v, [u for u in preds[v] if not finished_[u] and key[u] != key[v]])
        elif in_order[k]:
            launch(v)
        else:
            heapq.heappop(ready[k])
            launch(v)  # may release more work on stream k (lookahead)

    def drain() -> None:
        if fixed_order:
            # launch strictly in compile order
            while state["next"] < n and unsat[state["next"]] == 0:
                launch(state["next"])
                state["next"] += 1
            return
        heads = []
        for k in range(len(keys)):
            p = pick(k)
            if p is not None:
                heads.append((p[0], k, p[1]))
        heapq.heapify(heads)
        while heads:
            v, k, arm = heapq.heappop(heads)
            go(k, v, arm)
            p = pick(k)
            if p is not None:
                heapq.heappush(heads, (p[0], k, p[1]))

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


async def run_event_driven(mg, backend, *, lookahead: bool = True, copy_depth: int | None = COPY_DEPTH,
                           copy_window: int = COPY_WINDOW, device_waits: bool | None = None,
                           compute_in_order: bool = True, compute_depth: int | None = COMPUTE_DEPTH) -> RunResult:
    """Run ``mg`` on ``backend`` (already ``setup``) launching whatever is ready, most urgent
    (earliest in compile order) first; per copy stream at most ``copy_depth`` copies queued, or
    more while they hold at most ``copy_window`` bytes. ``device_waits``: arm vertices whose
    predecessors are launched (:func:`_run`); by default when the backend says it can
    (``backend.device_waits``). ``compute_in_order``: compute streams take their vertices in
    compile order, at most ``compute_depth`` in flight (Note [Compute streams in compile order]);
    copies go in any order either way.
    Raises :class:`~vmstoolkit.exec.errors.CycleError` first if ``mg`` has a cycle."""
    check_acyclic(mg)
    if compute_depth is not None and (isinstance(compute_depth, bool) or not isinstance(compute_depth, int)
                                      or compute_depth < 1):
        raise InvalidOptionError(f"compute_depth {compute_depth!r}: must be a whole number of at least 1, or None")
    if device_waits is None:
        device_waits = bool(getattr(backend, "device_waits", False))
    elif device_waits and not getattr(backend, "device_waits", False):
        raise InvalidOptionError(f"device_waits=True, but {type(backend).__name__} cannot make a stream wait on the GPU")
    return await _run(mg, backend, fixed_order=False, lookahead=lookahead, copy_depth=copy_depth,
                      copy_window=copy_window, device_waits=device_waits, compute_in_order=compute_in_order,
                      compute_depth=compute_depth)


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
