"""The training-under-a-budget experiment: step time against budget, per executor, for a fixed
or a changing sequence length (pure functions; printing happens in ``vmstoolkit.cli.train_offload``).

``run_train_experiment`` returns one row per (budget, executor) with exactly the keys of issue
17: ``budget``, ``executor``, ``variant``, ``step_s`` (mean over steady steps: every step but
the first of each bucket), ``lower_bound_s`` (same steps), ``offloaded_bytes`` and
``reloaded_bytes`` (per steady step), ``recomputed_flops`` (per steady step; 0 unless
``recompute``, see ``vmstoolkit.exec.compiler.RECOMPUTE_OPS``), ``plan_s`` (planning seconds per step, compiles and cache
lookups included) and ``max_abs_grad_err`` (largest gradient difference against the numpy
reference on the sim backend, or the direct all-on-GPU computation with the same kernels on
cuda; ``None`` when not checked).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from vmstoolkit.exec.backends import BackendKind, backend_kind, lower_bound, make_backend
from vmstoolkit.exec.compiler import working_set
from vmstoolkit.exec.errors import InvalidBudgetError, InvalidOptionError, InvalidShapeError
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.experiment import BudgetSpec
from vmstoolkit.exec.graph import LlamaConfig
from vmstoolkit.exec.plan_cache import DEFAULT_GRANULE, DEFAULT_RATIO, Plan, PlanCache, pad_rows
from vmstoolkit.exec.plots import save_schedules
from vmstoolkit.exec.train_graph import AdamWConfig, build_train_step, grads_from_updates, lm_loss, random_train_values

EXECUTORS = ("event-driven", "fixed-order")
ROW_KEYS = ("budget", "executor", "variant", "step_s", "lower_bound_s", "offloaded_bytes", "reloaded_bytes",
            "recomputed_flops", "plan_s", "max_abs_grad_err")
# Numerics on the sim backend run the numpy kernels for real: only below this many FLOPs per
# step (a few seconds of numpy) unless asked for.
SIM_CHECK_FLOPS = 2e10


class BudgetSpecError(InvalidBudgetError):
    """A ``--budget`` of ``experiment train-offload`` that is neither a size nor a fraction in (0, 1]."""


def parse_budget(spec, working_set_bytes) -> int:
    """A budget in bytes from what ``experiment offload`` takes too (:meth:`BudgetSpec.parse`:
    ``"8GiB"``, ``"0.5"``, ``"50%"``; an ``int`` is bytes), a fraction here in (0, 1] of the
    no-offload working set (``working_set_bytes()``, computed on first need): a training step
    under a budget above its working set offloads nothing."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec <= 0:
            raise BudgetSpecError(f"budget must be positive, got {spec!r}")
        return spec
    try:
        b = BudgetSpec.parse(spec)
    except InvalidBudgetError as e:
        raise BudgetSpecError(str(e)) from None
    if b.fraction is None:
        return b.nbytes
    if b.fraction > 1.0:
        raise BudgetSpecError(f"budget fraction must be in (0, 1], got {spec!r}")
    return b.resolve(working_set_bytes())


@dataclass
class StepRecord:
    seq: int
    bucket: int
    first_of_bucket: bool
    step_s: float  # makespan (simulated seconds on sim)
    lower_bound_s: float
    offloaded_bytes: int
    reloaded_bytes: int
    recomputed_flops: float
    plan_s: float  # planning seconds spent for this step
    max_abs_grad_err: float | None


def step_values(plan: Plan, seq: int, seed: int, base: dict | None = None) -> dict[int, np.ndarray]:
    """Host values for one step of ``seq`` real positions in ``plan``'s bucket: random weights
    (or those of ``base``), x and dout, both zero on the padded rows."""
    tg = plan.train
    values = dict(base) if base is not None else random_train_values(tg, seed)
    b = tg.config.batch
    for t in (tg.x, tg.dout):
        real = values[t].reshape(b, plan.seq, -1)[:, :seq].reshape(b * seq, -1)
        values[t] = pad_rows(real, b, seq, plan.seq)
    return values


class _Sim:
    def __init__(self, seed, jitter, check):
        from vmstoolkit.exec.backends.sim import CostModel

        self.cost, self.seed, self.jitter, self.check = CostModel(), seed, jitter, check
        self.needs_values = check  # timing alone needs no numbers
        self.timeline = False  # the sim backend records its spans anyway
        self.last = None  # (memory graph, seconds, spans) of the last step
        self.last_loss = None  # the last step's loss (loss="lm" graphs, with numerics)

    def close(self) -> None:
        pass

    def run(self, plan, executor, values, i):
        be = make_backend(BackendKind.sim, cost=self.cost, seed=self.seed + i, jitter=self.jitter, numerics=self.check,
                          values=values)
        span = execute(plan.memory, be, executor).makespan_s
        self.last = (plan.memory, span, list(be.spans))
        err = None
        if self.check:
            from vmstoolkit.exec.train_reference import reference_train_step

            want, _ = reference_train_step(plan.train, values)
            out = be.result()
            got = grads_from_updates(plan.train, values, out)
            if plan.train.loss == "lm":
                self.last_loss = lm_loss(plan.train, out)
            err = max(float(np.max(np.abs(got[n] - want[n]))) for n in want)
        return span, lower_bound(BackendKind.sim, plan.memory, cost=self.cost)["lower_bound_s"], err


class _Cuda:
    def __init__(self, check):
        self.check = check
        self.needs_values = True
        self._direct: dict[tuple[int, int], dict] = {}
        self.pool = None  # PinnedPool: each bucket's weights registered once, slots pinned once
        self.timeline = False  # CUDA events around every vertex (run_train_experiment's schedule_dir)
        self.last = None  # (memory graph, seconds, spans) of the last step, with timeline
        self.last_loss = None  # the last step's loss (loss="lm" graphs)
        self.staging_limit = None  # the pool's bound (the host plans' largest staging), set before the first run

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def run(self, plan, executor, values, i):
        from vmstoolkit.exec.backends.cuda import direct_forward
        from vmstoolkit.exec.backends.host_memory import PinnedPool

        self.pool = self.pool or PinnedPool(limit_bytes=self.staging_limit)
        # register, not in place: a step's values are a new dict, so replacing its entries would pin the
        # bucket's weights again every step; registered, they are pinned once
        be = make_backend(BackendKind.cuda, values=values, pin="register", pool=self.pool, timeline=self.timeline)
        try:
            res = execute(plan.memory, be, executor)
            out = be.result()
            self.last = (plan.memory, res.makespan_s, list(be.spans)) if self.timeline else None
            if plan.train.loss == "lm":
                self.last_loss = lm_loss(plan.train, out)
        finally:
            be.close()
        err = None
        if self.check:
            key = (id(plan.train), id(values[plan.train.x]))
            if key not in self._direct:
                ref, _ = direct_forward(plan.train.graph, values, repeats=1)
                self._direct[key] = grads_from_updates(plan.train, values, ref)
            want = self._direct[key]
            got = grads_from_updates(plan.train, values, out)
            err = max(float(np.max(np.abs(got[n] - want[n]))) for n in want)
        return res.makespan_s, lower_bound(BackendKind.cuda, plan.memory, values=values)["lower_bound_s"], err


def run_steps(cache: PlanCache, seqs, runner, executor: str, seed: int = 0,
              weights: dict[int, dict] | None = None) -> list[StepRecord]:
    """Run one training step per length in ``seqs`` through ``cache``'s plans. ``weights``:
    bucket -> random values, drawn once per bucket and kept there for the caller's next call
    (every budget and executor of one experiment builds the same tensors in the same order)."""
    out = []
    weights = {} if weights is None else weights
    for i, seq in enumerate(seqs):
        before, misses = cache.plan_s, cache.misses
        plan = cache.get(int(seq))
        plan_s = cache.plan_s - before
        values = None
        if runner.needs_values:
            if plan.seq not in weights:
                weights[plan.seq] = random_train_values(plan.train, seed)
            values = step_values(plan, int(seq), seed, weights[plan.seq])
        span, lb, err = runner.run(plan, executor, values, i)
        mg = plan.memory
        out.append(StepRecord(int(seq), plan.seq, cache.misses > misses, span, lb, mg.offloaded_bytes,
                              mg.reloaded_bytes, mg.recomputed_flops, plan_s, err))
    return out


def summarize(budget: int, executor: str, variant: str, steps: list[StepRecord]) -> dict:
    steady = [s for s in steps if not s.first_of_bucket] or steps
    errs = [s.max_abs_grad_err for s in steps if s.max_abs_grad_err is not None]
    return {
        "budget": budget,
        "executor": executor,
        "variant": variant,
        "step_s": float(np.mean([s.step_s for s in steady])),
        "lower_bound_s": float(np.mean([s.lower_bound_s for s in steady])),
        "offloaded_bytes": int(np.mean([s.offloaded_bytes for s in steady])),
        "reloaded_bytes": int(np.mean([s.reloaded_bytes for s in steady])),
        "recomputed_flops": float(np.mean([s.recomputed_flops for s in steady])),
        "plan_s": sum(s.plan_s for s in steps) / len(steps),
        "max_abs_grad_err": max(errs) if errs else None,
    }


def step_lengths(seq: int | None, seq_range: tuple[int, int] | None, steps: int | None, seed: int = 0) -> list[int]:
    """``steps`` lengths: ``seq`` every step (default 3 steps), or uniform in ``seq_range``
    (inclusive, default 100 steps)."""
    if seq is not None and seq_range is not None:
        raise InvalidOptionError("give a fixed sequence length or a range, not both")
    if seq_range is not None:
        lo, hi = seq_range
        if not 0 < lo <= hi:
            raise InvalidShapeError(f"sequence range {lo}:{hi} must satisfy 0 < A <= B")
        return [int(s) for s in np.random.default_rng(seed).integers(lo, hi + 1, steps or 100)]
    seq = 2048 if seq is None else seq
    if seq <= 0:
        raise InvalidShapeError(f"sequence length must be positive, got {seq}")
    return [seq] * (steps or 3)


def check_train_host_memory(cfg: LlamaConfig, variant: str, budgets, host_budget: int | None, *, rank: int = 16,
                            adamw: AdamWConfig | None = None, recompute: bool = False, real: bool = True,
                            check_grads: bool = True, materialized: bool = True) -> None:
    """Refuse (:class:`~vmstoolkit.exec.errors.HostBudgetError`, one line) a training run whose
    plan at one of ``budgets`` needs more host memory than ``host_budget`` (-1: the default
    budget; None: no check)."""
    from vmstoolkit.exec.compiler import compile_memory_graph
    from vmstoolkit.exec.errors import BudgetTooSmallError
    from vmstoolkit.exec.host_plan import TRAIN_LABELS, check_host_budget, default_host_budget, host_plan

    hb = default_host_budget() if host_budget == -1 else host_budget
    if hb is None or not materialized:
        return
    tg = build_train_step(cfg, variant, rank=rank, adamw=adamw)
    for budget in budgets:
        try:
            mg = compile_memory_graph(tg.graph, budget, recompute=recompute)
        except BudgetTooSmallError:
            continue  # the run says so itself
        check_host_budget(host_plan(mg, sim_numerics=not real, reference=real and check_grads), hb,
                          labels=TRAIN_LABELS)


def run_train_experiment(backend: str = "sim", variant: str = "lora", budgets=("0.5", "0.25"), *,
                         config: LlamaConfig | None = None, seq: int | None = None,
                         seq_range: tuple[int, int] | None = None, steps: int | None = None, rank: int = 16,
                         executors=EXECUTORS, seed: int = 0, jitter: float = 0.05,
                         check_grads: bool | None = None, adamw: AdamWConfig | None = None,
                         granule: int = DEFAULT_GRANULE, ratio: float = DEFAULT_RATIO,
                         recompute: bool = False, schedule_dir=None, host_budget: int | None = None) -> list[dict]:
    """Rows of :data:`ROW_KEYS`, one per (budget, executor). Budget fractions are of the
    no-offload working set at the longest bucket of the run. Raises BudgetTooSmallError (naming
    the vertex, its bytes and the budget) when a budget cannot hold one vertex. ``recompute``
    lets the compiler rerun cheap producers instead of offloading their outputs.

    ``schedule_dir``: for each budget, ``schedule_<bytes>B.png`` (the last step's schedule under
    each executor, one above the other: :func:`vmstoolkit.exec.plots.schedules_figure`) and
    ``.json`` (their spans) there; on the cuda backend every vertex is then timed with CUDA events
    (``CudaBackend(timeline=True)``, a few microseconds of host time each).

    ``host_budget``: bytes of host memory the run may hold (-1: available memory less a margin,
    :func:`vmstoolkit.exec.host_plan.default_host_budget`; None: no check). Each budget's plan at
    the longest bucket is added up (:func:`vmstoolkit.exec.host_plan.host_plan`: weights, AdamW
    moments, updates read back, offload slots, the gradient check's reference) before any value
    is drawn, and a plan above it raises :class:`~vmstoolkit.exec.errors.HostBudgetError` in one
    line (issue 32: a 13B-width full fine-tune was killed by the kernel instead)."""
    cfg = config or LlamaConfig()
    seqs = step_lengths(seq, seq_range, steps, seed)
    buckets = {"granule": granule, "ratio": ratio, "max_seq": max(seqs)}
    probe = PlanCache(cfg, variant, 1, rank=rank, adamw=adamw, **buckets)
    longest = max(probe.bucket(s) for s in seqs)

    def ws():
        return working_set(build_train_step(replace(cfg, seq=longest), variant, rank=rank, adamw=adamw).graph)

    ws_cache: list[int] = []

    def ws_once():
        if not ws_cache:
            ws_cache.append(ws())
        return ws_cache[0]

    resolved = [parse_budget(b, ws_once) for b in budgets]
    kind = backend_kind(backend)
    if check_grads is None:
        if kind.real:
            check_grads = True
        else:
            tg = build_train_step(replace(cfg, seq=longest), variant, rank=rank, adamw=adamw)
            check_grads = sum(v.flops for v in tg.graph.vertices) <= SIM_CHECK_FLOPS
    runner = _Cuda(check_grads) if kind.real else _Sim(seed, jitter, check_grads)
    runner.timeline = schedule_dir is not None
    check_train_host_memory(replace(cfg, seq=longest), variant, resolved, host_budget, rank=rank, adamw=adamw,
                            recompute=recompute, real=kind.real, check_grads=check_grads,
                            materialized=runner.needs_values)
    rows = []
    weights: dict[int, dict] = {}  # bucket -> values, shared by every budget and executor: drawn
    # once (13 GB of weights at the 13B width took seconds to draw for each executor)
    try:
        for budget in resolved:
            last = {}
            for ex in executors:
                cache = PlanCache(cfg, variant, budget, rank=rank, adamw=adamw, recompute=recompute, **buckets)
                recs = run_steps(cache, seqs, runner, ex, seed, weights)
                rows.append(summarize(budget, ex, variant, recs))
                last[ex] = runner.last
            if schedule_dir is not None:
                save_schedules(schedule_dir, budget, last, "GPU, CUDA events" if kind.real else "simulated")
    finally:
        runner.close()
    return rows

