"""CUDA backend: the Numba kernels on numba streams, one budgeted region per GPU, pinned host
buffers, completions delivered to the asyncio loop by a host callback or by polling events.

Host memory: weights, inputs and offload slots are pinned as ``pin=`` says (a copy, the
caller's arrays replaced in place, or registered where they are) from a ``PinnedPool`` that
successive backends may share (:mod:`~vmstoolkit.exec.backends.host_memory`, Note [Pinned host
memory]).

Importable without a GPU: numba.cuda, cuda-bindings and the kernels are imported when a backend
is set up. Measured on the H200 by ``experiments/offload_gpu.py`` (``docs/results.md#offload-h200``).

Memory: the compiler placed every buffer at an offset of one region of ``budget`` bytes per GPU,
so the backend takes exactly one allocation per GPU (:func:`take_region`) and makes device
arrays over ``region + offset`` (numba ``MemoryPointer`` + ``DeviceNDArray(gpu_data=...)``).

Streams: ``compute``, ``h2d``, ``d2h`` per GPU (numba streams). Completions:

- ``notify="callback"``: a host function after the vertex (``cuLaunchHostFunc``, see
  :mod:`~vmstoolkit.exec.backends.host_callbacks`) resolves its future with
  ``loop.call_soon_threadsafe`` (no event object needed: the stream order makes "everything
  before this point is done" equal to "this vertex is done");
- ``notify="poll"``: a CUDA event recorded after the vertex; one poller coroutine queries the
  oldest outstanding event of every stream (events of one stream complete in order), spinning on
  ``asyncio.sleep(0)`` for a while, then backing off to 1 ms sleeps.
"""

from __future__ import annotations

import asyncio
import time
import weakref

import numpy as np

from vmstoolkit.exec.backends.base import select_outputs
from vmstoolkit.exec.backends.driver_events import DriverEvents, copy_async
from vmstoolkit.exec.backends.driver_events import enabled as driver_events_enabled
from vmstoolkit.exec.backends.host_callbacks import HostCallbacks, raw_stream
from vmstoolkit.exec.backends.host_memory import PIN_MODES, CudaHostMemory, PinnedPool
from vmstoolkit.exec.backends.numba_exit import guard_library_unload
from vmstoolkit.exec.errors import CudaCallError, InvalidOptionError
from vmstoolkit.exec.graph import TaskGraph, random_weights

SPIN_POLLS = 2000  # sleep(0) rounds before backing off; asyncio timers are 1 ms granular


def take_region(gpu: int, nbytes: int, peers: tuple[int, ...] = (), *, allocator: str = "vms",
                options: dict | None = None):
    """One device allocation of ``nbytes`` on ``gpu`` from a vmstoolkit ``allocator`` (with
    ``options``) over the real VMM driver, accessible from the ``peers`` GPUs too (a copy between
    GPUs reads one region from the other's side). Returns ``(address, release)``; ``release``
    gives the physical memory back (every run takes a new region)."""
    from vmstoolkit.pools import drivers
    from vmstoolkit.pools.registry import make_allocator

    driver = drivers.make_driver("cuda", device=gpu, peers=peers)
    alloc = make_allocator(allocator, driver=driver, **(options or {}))
    addr = alloc.allocate(nbytes)

    def release() -> None:
        alloc.free(addr)
        alloc.close()
        driver.close()

    return addr, release


def pinned(shape, dtype, gpu: int = 0) -> np.ndarray:
    """A page-locked host array usable by every context (portable), allocated in ``gpu``'s,
    freed when the array is collected (:class:`~vmstoolkit.exec.backends.host_memory.CudaHostMemory`)."""
    dtype = np.dtype(dtype)
    return CudaHostMemory(gpu).alloc(int(np.prod(shape)) * dtype.itemsize).view(dtype).reshape(shape)


def random_host_values(graph: TaskGraph, seed: int = 0) -> dict[int, np.ndarray]:
    return random_weights(graph, seed)


_CONCAT = None


def _concat_kernel():
    global _CONCAT
    if _CONCAT is None:
        from numba import cuda

        from vmstoolkit.kernels import _launch

        @_launch.jit  # past Numba's dispatcher once planned, as every kernel of vmstoolkit.kernels
        def concat_cols(dst, src, col0):  # dst[:, col0:col0+w] = src
            i, j = cuda.grid(2)
            if i < src.shape[0] and j < src.shape[1]:
                dst[i, col0 + j] = src[i, j]

        _CONCAT = concat_cols
    return _CONCAT


def launch_concat(stream, parts, out) -> None:
    k = _concat_kernel()
    col = 0
    for p in parts:
        m, w = p.shape
        k[((m + 15) // 16, (w + 15) // 16), (16, 16), stream](out, p, col)
        col += w


def device_view(ctx, base: int, offset: int, shape, dtype):
    from numba.cuda.cudadrv import driver
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    mp = driver.MemoryPointer(ctx, base + offset, nbytes)
    return DeviceNDArray(tuple(shape), _c_strides(shape, dtype.itemsize), dtype, gpu_data=mp)


def _c_strides(shape, itemsize):
    strides, acc = [], itemsize
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def run_kernel(v, stream, ins, outs) -> None:
    """Launch task vertex ``v`` on ``stream`` over device arrays already in the vertex's views."""
    if v.op == "concat":
        launch_concat(stream, ins, outs[0])
    elif v.op == "copy":
        from cuda.bindings import driver as cu

        (err,) = cu.cuMemcpyAsync(outs[0].device_ctypes_pointer.value, ins[0].device_ctypes_pointer.value,
                                  outs[0].nbytes, raw_stream(stream))
        if err != cu.CUresult.CUDA_SUCCESS:
            raise CudaCallError(err.name, f"cuMemcpyAsync of {outs[0].nbytes} bytes for vertex {v.name}")
    else:
        from vmstoolkit.kernels.tasks import KERNEL_TASKS

        KERNEL_TASKS[v.op].launch(stream, ins, outs, **v.params)


class CudaBackend:
    """The :class:`~vmstoolkit.exec.backends.base.Backend` of a real GPU (module docstring)."""

    # launch(v, after): v's stream waits on the GPU for the end events of the vertices ``after``
    # (cuStreamWaitEvent), so the executor need not wait on the host for them
    device_waits = True

    def __init__(self, values: dict[int, np.ndarray], *, notify: str = "poll", host: dict | None = None,
                 pin: str = "copy", pool: PinnedPool | None = None, allocator: str = "vms",
                 allocator_options: dict | None = None, timeline: bool = False,
                 driver_events: bool | None = None):
        """``values``: the host value of every weight and input, by tensor id.

        ``notify``: ``"poll"`` (default: 7-13% shorter makespans than ``"callback"`` on the
        H200, where each host function holds its stream for a GIL hand-off;
        ``docs/results.md#offload-h200``).

        Host memory (:mod:`~vmstoolkit.exec.backends.host_memory`, Note [Pinned host memory]):
        ``pin`` says how ``values`` become pinned: ``"copy"`` (default: a pinned copy per
        backend, ``values`` untouched, host memory doubled), ``"in_place"`` (entries of
        ``values`` that are not pinned are *replaced* by pinned copies, once: the dict is
        mutated), ``"register"`` (the arrays are page-locked where they are with
        ``cuMemHostRegister``: no copy; arrays that cannot be are copied, with a
        :class:`~vmstoolkit.exec.backends.host_memory.PinFallbackWarning`). ``pool``: a
        :class:`~vmstoolkit.exec.backends.host_memory.PinnedPool` shared by successive backends
        (offload slots and registrations are made once; the caller closes it); without one the
        backend frees what it pinned when it closes. The runtime never writes a value: every
        run starts from the same weights (a step's updates are new tensors, read back by
        :meth:`result`).

        ``host``: the older way to share pinned host arrays between runs of one graph (a dict
        by tensor id the backend fills on first use and reads ever after: values changed later
        are not seen); not with ``pool`` or another ``pin``.

        ``allocator`` and ``allocator_options``: the vmstoolkit allocator each GPU's region
        comes from (:func:`take_region`), checked here by the registry without a GPU
        (:class:`~vmstoolkit.errors.ConfigError` naming a bad one).

        ``timeline``: time every vertex on the GPU with a pair of CUDA events around it on its
        stream; after the run :attr:`spans` holds ``(vertex, gpu, stream, start_s, end_s)`` like
        the sim backend's, measured from the first vertex's start on each GPU: the schedule the
        GPU really ran, to set beside the simulated one (:func:`vmstoolkit.exec.plots.plot_schedule`).
        Costs two event records per vertex (a few microseconds of host time each).

        ``driver_events``: the vertices' end events and the copies straight through the driver
        (:mod:`~vmstoolkit.exec.backends.driver_events`) instead of through Numba; default
        ``VMSTOOLKIT_DRIVER_EVENTS=1``, off otherwise (not yet checked on a GPU)."""
        from vmstoolkit.pools.registry import check_allocator

        if notify not in ("callback", "poll"):
            raise InvalidOptionError(f"notify must be 'callback' or 'poll', not {notify!r}")
        if pin not in PIN_MODES:
            raise InvalidOptionError(f"pin must be one of {', '.join(map(repr, PIN_MODES))}, not {pin!r}")
        if host is not None and (pool is not None or pin != "copy"):
            raise InvalidOptionError("host= (pinned copies kept by the caller) cannot be combined with pool= or "
                                     f"pin={pin!r}: a PinnedPool replaces it")
        if pool is not None and pool.closed:
            raise InvalidOptionError("this PinnedPool is closed; make a new one")
        self.values = values
        self.notify = notify
        self.pin = pin
        self._legacy = host
        self.pool = pool if pool is not None else PinnedPool()
        self._own_pool = pool is None
        self._lent: list[np.ndarray] = []
        self._host: dict[int, np.ndarray] = {}
        self.allocator = allocator
        self.allocator_options = check_allocator(allocator, dict(allocator_options or {}))
        self._release: list = []
        self.timeline = timeline
        self.driver_events = driver_events_enabled() if driver_events is None else bool(driver_events)
        self._events = DriverEvents() if self.driver_events else None
        self._marks: list = []  # (vertex, gpu, stream, start event, end event) with timeline
        self._spans: list | None = None

    def setup(self, mg) -> None:
        from numba import cuda

        self.mg = mg
        g = mg.graph
        if mg.n_gpus > 1:
            guard_library_unload()  # numba-cuda unloads kernels shared by several GPUs twice at exit
        self.ctx, self.base, self.streams, self._release = [], [], [], []
        for gpu in range(mg.n_gpus):
            with cuda.gpus[gpu]:
                ctx = cuda.current_context()
                addr, rel = take_region(gpu, mg.budget, peers=tuple(range(mg.n_gpus)), allocator=self.allocator,
                                        options=self.allocator_options)
                self.ctx.append(ctx)
                self.base.append(addr)
                self._release.append(rel)
                self.streams.append({k: cuda.stream() for k in ("compute", "h2d", "d2h")})
        with cuda.gpus[0]:  # weights and inputs, and a slot for each offload
            offloaded = list(dict.fromkeys(v.tensor for v in mg.vertices if v.kind == "offload"))
            self._host = self.pool.place(g, offloaded, self.values, self.pin, self._lent, legacy=self._legacy)
        self._views: dict[int, object] = {}
        for b in mg.preloaded:
            with cuda.gpus[mg.buffers[b].gpu]:
                self.view(b).copy_to_device(self._host[mg.buffers[b].tensor])
        for gpu in range(mg.n_gpus):
            with cuda.gpus[gpu]:
                cuda.synchronize()
        self._pending: dict[tuple[int, str], list] = {}
        self._ends: dict[int, object] = {}  # vertex id -> the event recorded after it
        self._poller = None
        self._callbacks: HostCallbacks | None = None
        self._marks, self._spans = [], None

    def view(self, bid: int, shape=None):
        key = (bid, shape)
        a = self._views.get(key)
        if a is None:
            b = self.mg.buffers[bid]
            t = self.mg.graph.tensors[b.tensor]
            a = device_view(self.ctx[b.gpu], self.base[b.gpu], b.offset, shape or t.shape, t.dtype)
            self._views[key] = a
        return a

    def clock(self) -> float:
        return time.perf_counter()

    def launch(self, v, after=()):
        from numba import cuda

        multi = self.mg.n_gpus > 1
        if multi:
            cm = cuda.gpus[v.gpu]
            cm.__enter__()
        try:
            s = self.streams[v.gpu][v.stream]
            events = self._events
            rs = raw_stream(s) if events is not None else None
            for u in after:  # the executor arms only on predecessors of v's own GPU
                self._ends[u].wait(rs if events is not None else s)
            if self.timeline:
                start = cuda.event(timing=True)
                start.record(s)
            if events is not None and v.kind in ("reload", "offload", "move"):
                if v.kind == "reload":
                    copy_async("h2d", self.view(v.writes[0]), self._host[v.tensor], rs)
                elif v.kind == "offload":
                    copy_async("d2h", self.view(v.reads[0]), self._host[v.tensor], rs)
                else:
                    copy_async("d2d", self.view(v.writes[0]), self.view(v.reads[0]), rs)
            elif v.kind == "reload":
                self.view(v.writes[0]).copy_to_device(self._host[v.tensor], stream=s)
            elif v.kind == "offload":
                self.view(v.reads[0]).copy_to_host(self._host[v.tensor], stream=s)
            elif v.kind == "move":  # compaction: device to device, never overlapping (compiler.py)
                self.view(v.writes[0]).copy_to_device(self.view(v.reads[0]), stream=s)
            else:
                tv = self.mg.graph.vertices[v.task]
                n_in = len(tv.inputs)
                ins = [self.view(b, tv.views[i]) for i, b in enumerate(v.reads)]
                outs = [self.view(b, tv.views[n_in + i]) for i, b in enumerate(v.writes)]
                run_kernel(tv, s, ins, outs)
            if self.timeline:
                end = cuda.event(timing=True)
                end.record(s)
                self._marks.append((v.id, v.gpu, v.stream, start, end))
            if events is not None:
                ev = events.new(v.gpu)
                ev.record(rs)
            else:
                ev = cuda.event(timing=False)
                ev.record(s)
            self._ends[v.id] = ev
            if self.notify == "callback":
                if self._callbacks is None:
                    self._callbacks = HostCallbacks(asyncio.get_running_loop())
                return self._callbacks.after(s)
            fut = asyncio.get_running_loop().create_future()
            self._pending.setdefault((v.gpu, v.stream), []).append((ev, fut))
            if self._poller is None or self._poller.done():
                self._poller = asyncio.ensure_future(self._poll())
            return fut
        finally:
            if multi:
                cm.__exit__(None, None, None)

    def completion(self, token):
        return token

    async def _poll(self) -> None:
        spins, delay = 0, 0.0
        while any(self._pending.values()):
            progressed = False
            for q in self._pending.values():
                while q and q[0][0].query():
                    _, fut = q.pop(0)
                    if not fut.done():
                        fut.set_result(None)
                    progressed = True
            if progressed:
                spins, delay = 0, 0.0
                await asyncio.sleep(0)
            elif spins < SPIN_POLLS:
                spins += 1
                await asyncio.sleep(0)
            else:
                delay = min(1e-3, max(1e-4, delay * 2))
                await asyncio.sleep(delay)

    async def drive(self, done) -> None:
        """Completions arrive by themselves (events polled by :meth:`_poll`, or host callbacks):
        this loop only waits for the run to end. It must not return before ``done`` resolves:
        the executor takes a drive loop that ends early for a failed backend. ``done``'s
        exception, if any, is the executor's to report."""
        await asyncio.wait((done,))

    @property
    def spans(self) -> list[tuple[int, int, str, float, float]]:
        """With ``timeline=True``, after a run: ``(vertex, gpu, stream, start_s, end_s)`` per
        launched vertex in launch order, seconds from the earliest start on its GPU (waits for
        the events); empty without a timeline. Read before :meth:`close`."""
        if self._spans is None:
            from numba import cuda

            first: dict[int, object] = {}
            out = []
            for vid, gpu, stream, start, end in self._marks:  # events of one GPU, in its context
                with cuda.gpus[gpu]:
                    end.synchronize()
                    first.setdefault(gpu, start)
                    t0 = first[gpu].elapsed_time(start) / 1e3
                    out.append((vid, gpu, stream, t0, t0 + start.elapsed_time(end) / 1e3))
            lo = {g: min((a for _, gg, _, a, _ in out if gg == g), default=0.0) for g in first}
            self._spans = [(vid, gpu, st, a - lo[gpu], b - lo[gpu]) for vid, gpu, st, a, b in out]
        return self._spans

    def result(self, ids=None) -> dict[int, np.ndarray]:
        from numba import cuda

        out = {}
        for t, bid in select_outputs(self.mg.output_location, ids):
            if bid >= 0:
                with cuda.gpus[self.mg.buffers[bid].gpu]:
                    out[t] = self.view(bid).copy_to_host()
            else:
                out[t] = np.array(self._host[t])
        return out

    def close(self) -> None:
        """Wait for the GPUs, give each region back, then the host slots (to a shared pool, or
        freed with a private one). Idempotent."""
        from numba import cuda

        for gpu, rel in enumerate(self._release):
            with cuda.gpus[gpu]:
                cuda.synchronize()
                if self._events is not None:  # after the synchronize: no stream still waits on one
                    self._events.close(gpu)
                rel()
        self._release = []
        self._ends = {}
        lent, self._lent, self._host = self._lent, [], {}
        self.pool.give_back(lent)
        if self._own_pool:
            self.pool.close()


def op_seconds(graph: TaskGraph, vertex_seconds) -> dict[str, float]:
    """Seconds summed per op kind (``v.op``) from one time per vertex (in ``graph.vertices``
    order), the largest first. Raises InvalidOptionError when the counts differ."""
    if len(vertex_seconds) != len(graph.vertices):
        raise InvalidOptionError(f"{len(vertex_seconds)} vertex times for {len(graph.vertices)} vertices")
    total: dict[str, float] = {}
    for v, sec in zip(graph.vertices, vertex_seconds):
        total[v.op] = total.get(v.op, 0.0) + float(sec)
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def direct_forward(graph: TaskGraph, values: dict[int, np.ndarray], repeats: int = 3, outputs=None,
                   breakdown: bool = False, vertex_seconds: list | None = None, timings: dict | None = None):
    """The block-by-block forward with the same kernels, every tensor its own device array,
    every weight resident, launched back to back on one stream per GPU with no events.
    Returns ``(outputs, best seconds)``: the equality reference (the graph's outputs, or those in
    ``outputs``) and the compute time. With ``breakdown``, one more pass brackets every vertex
    with CUDA events on its stream and the result is ``(outputs, best seconds, seconds per op
    kind)`` (:func:`op_seconds`; the events add a little time that the best time does not see;
    in the CUDA simulator events time nothing and every figure is meaningless). ``vertex_seconds``:
    a list that the breakdown pass fills with every vertex's seconds, in ``graph.vertices``
    order (implies ``breakdown``). ``timings``: a dict that gets the host seconds of each phase
    (``upload_s``: every tensor to the device; ``warmup_s``: the first pass, which JIT-compiles
    the kernels a process has not compiled yet; ``passes_s``; ``breakdown_s``; ``readback_s``);
    ``outputs=[]`` reads nothing back."""
    from numba import cuda

    n_gpus = graph.n_gpus
    if n_gpus > 1:
        guard_library_unload()
    dev: dict[int, object] = {}
    streams = []
    for gpu in range(n_gpus):
        with cuda.gpus[gpu]:
            streams.append(cuda.stream())
    lap = _Laps(timings)
    for t in graph.tensors:
        with cuda.gpus[t.gpu]:
            dev[t.id] = cuda.to_device(values[t.id]) if t.id in values else cuda.device_array(t.shape, t.dtype)
    lap("upload_s")

    def launch(v):
        n_in = len(v.inputs)
        if v.op == "copy":
            src_gpu = graph.tensors[v.inputs[0]].gpu
            streams[src_gpu].synchronize()
        ins = [dev[t].reshape(v.views[i]) for i, t in enumerate(v.inputs)]
        outs = [dev[t].reshape(v.views[n_in + i]) for i, t in enumerate(v.outputs)]
        run_kernel(v, streams[v.gpu], ins, outs)

    def once():
        for v in graph.vertices:
            with cuda.gpus[v.gpu]:
                launch(v)
        for gpu in range(n_gpus):
            streams[gpu].synchronize()

    once()  # compile and warm up
    lap("warmup_s")
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t0)
    lap("passes_s")
    per_op = None
    if breakdown or vertex_seconds is not None:
        marks = []
        for v in graph.vertices:
            with cuda.gpus[v.gpu]:
                start, end = cuda.event(), cuda.event()
                start.record(streams[v.gpu])
                launch(v)
                end.record(streams[v.gpu])
                marks.append((start, end))
        for gpu in range(n_gpus):
            streams[gpu].synchronize()
        secs = [start.elapsed_time(end) / 1e3 for start, end in marks]
        if vertex_seconds is not None:
            vertex_seconds[:] = secs
        per_op = op_seconds(graph, secs) if breakdown else None
        lap("breakdown_s")
    outs = {t: dev[t].copy_to_host() for t in (graph.outputs if outputs is None else outputs)}
    lap("readback_s")
    return (outs, best) if per_op is None else (outs, best, per_op)


class _Laps:
    """``lap(name)``: host seconds since the previous lap into ``timings[name]`` (if given)."""

    def __init__(self, timings: dict | None):
        self.timings, self.t = timings, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[name] = self.timings.get(name, 0.0) + now - self.t
        self.t = now


def copy_bandwidth(nbytes: int = 1 << 28, gpu: int = 0) -> dict[str, float]:
    """Pinned host <-> device bandwidth in bytes/s (best of 3)."""
    from numba import cuda

    with cuda.gpus[gpu]:
        h = pinned((nbytes,), np.uint8, gpu)
        d = cuda.device_array(nbytes, np.uint8)
        s = cuda.stream()
        res = {}
        for name, fn in (("h2d", lambda: d.copy_to_device(h, stream=s)), ("d2h", lambda: d.copy_to_host(h, stream=s))):
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                s.synchronize()
                best = min(best, time.perf_counter() - t0)
            res[name] = nbytes / best
    return res


# task graph -> (compute seconds, copy bandwidths, seconds per task vertex), for as long as the
# graph lives: keyed by the graph itself, not id(graph), which a later graph (another bucket's)
# may reuse once it is freed
_LB_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def measure_lower_bound(mg, values) -> dict:
    """The larger of max(back-to-back compute time, H2D bytes / measured bandwidth, D2H bytes /
    bandwidth) (``resource_s``) and the precedence bound (``precedence_s``,
    :func:`vmstoolkit.exec.bounds.precedence_bound`) over each vertex's time in one more direct
    pass timed vertex by vertex with CUDA events, copies at the measured bandwidths.

    Measured once per task graph (every budget's plan of one graph shares it); nothing is read
    back (a full fine-tune's updated weights and moments are tens of GB). ``direct_s`` says
    where the measurement's host time went (:func:`direct_forward`'s ``timings``: ``warmup_s``
    is mostly the JIT of a process's first kernels), empty when the cache served it."""
    from vmstoolkit.exec.bounds import precedence_bound

    direct: dict[str, float] = {}
    if mg.graph not in _LB_CACHE:
        per_vertex: list[float] = []
        _, compute = direct_forward(mg.graph, values, vertex_seconds=per_vertex, outputs=[], timings=direct)
        _LB_CACHE[mg.graph] = (compute, copy_bandwidth(), per_vertex)
    compute, bw, per_vertex = _LB_CACHE[mg.graph]
    h2d = max(mg.bytes_moved("reload", g) for g in range(mg.n_gpus)) / bw["h2d"]
    d2h = max(mg.bytes_moved("offload", g) for g in range(mg.n_gpus)) / bw["d2h"]
    # a move (compaction's device copy) is not measured: counted as free, the bound stays a bound
    durations = [v.nbytes / bw["h2d"] if v.kind == "reload" else v.nbytes / bw["d2h"] if v.kind == "offload"
                 else 0.0 if v.kind == "move" else per_vertex[v.task] for v in mg.vertices]
    prec = precedence_bound(mg, durations)
    prec_s = None if prec is None else prec[0]
    resource = max(compute, h2d, d2h)
    return {"compute_s": compute, "h2d_s": h2d, "d2h_s": d2h, "resource_s": resource, "precedence_s": prec_s,
            "lower_bound_s": max(resource, prec_s or 0.0), "h2d_bytes_per_s": bw["h2d"], "d2h_bytes_per_s": bw["d2h"],
            "direct_s": direct}
