"""The offload experiment: makespan against GPU budget, per executor (pure functions).

``run_offload_experiment`` builds a LLaMA prefill graph, measures its no-offload working set,
and for budgets from the whole working set down to a fraction of it compiles a memory graph and
runs it with each executor, returning one row per (budget, executor). ``sweep_budgets`` is that
loop for any graph, backend factory and reference output (the GPU scripts in ``experiments/``
call it). Printing happens in the CLI (``vmstoolkit.cli.offload``).
"""

from __future__ import annotations

import math
import re
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from vmstoolkit.exec.backends import backend_kind, lower_bound, make_backend, require_gpus  # noqa: F401 - require_gpus: its old home
from vmstoolkit.exec.compiler import MemoryGraph, compile_memory_graph, working_set
from vmstoolkit.exec.errors import BudgetTooSmallError, InvalidBudgetError
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.graph import LlamaConfig, TaskGraph, build_llama
from vmstoolkit.exec.plots import save_schedules

DEFAULT_FRACTIONS = (1.0, 0.75, 0.5, 0.375, 0.25, 0.125)
EXECUTORS = ("event-driven", "fixed-order")
# A plain number is a fraction of the working set. Above this it is far more likely a byte
# count missing its unit ("--budget 4096") than a wish for ten working sets: refuse it and say so.
MAX_FRACTION = 10.0
_FRACTION = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(%?)\s*")


@dataclass(frozen=True)
class BudgetSpec:
    """One GPU budget per GPU: ``nbytes`` bytes, or a ``fraction`` of the graph's no-offload
    working set (known only once the graph is built). ``text`` is what the user wrote."""

    nbytes: int | None = None
    fraction: float | None = None
    text: str = ""

    def __eq__(self, other) -> bool:  # the spelling does not matter
        return isinstance(other, BudgetSpec) and (self.nbytes, self.fraction) == (other.nbytes, other.fraction)

    def __hash__(self) -> int:
        return hash((self.nbytes, self.fraction))

    @classmethod
    def parse(cls, text: str) -> "BudgetSpec":
        """``"12GiB"``, ``"512MiB"``, ``"4096B"``: a size (units required); ``"0.5"``, ``"50%"``:
        a fraction of the working set, positive and at most :data:`MAX_FRACTION`. Raises
        :class:`InvalidBudgetError` naming ``text`` otherwise (NaN, infinities, zero, negatives,
        unknown units)."""
        from vmstoolkit.units import parse_size

        t = str(text).strip()
        m = _FRACTION.fullmatch(t)
        if m:
            f = float(m.group(1)) / (100.0 if m.group(2) else 1.0)
            if not 0 < f <= MAX_FRACTION:
                hint = f"; a size needs its unit ({t}B, or KiB, MiB, GiB)" if f > MAX_FRACTION and not m.group(2) else ""
                raise InvalidBudgetError(f"budget {text!r}: a fraction of the working set must be above 0 and at "
                                         f"most {MAX_FRACTION:g}{hint}")
            return cls(fraction=f, text=t)
        if not re.search(r"[a-zA-Z]", t) or t.lower().lstrip("+-").startswith(("nan", "inf")):
            raise InvalidBudgetError(f"budget {text!r}: give a size such as 12GiB or a fraction of the working "
                                     f"set such as 0.5 or 50%")
        try:
            n = parse_size(t)
        except ValueError as e:
            raise InvalidBudgetError(f"budget {text!r}: {e}; or give a fraction of the working set such as 0.5") from None
        if n <= 0:
            raise InvalidBudgetError(f"budget {text!r}: must be more than 0 bytes")
        return cls(nbytes=n, text=t)

    def resolve(self, working_set: int) -> int:
        """Bytes per GPU for a graph whose working set is ``working_set`` bytes."""
        return self.nbytes if self.nbytes is not None else int(working_set * self.fraction)


def run_offload_experiment(backend: str = "sim", n_gpus: int = 1, *, config: LlamaConfig | None = None,
                           parts: int = 1, fractions=DEFAULT_FRACTIONS, executors=EXECUTORS,
                           seed: int = 0, jitter: float = 0.05, repeats: int = 1,
                           budgets: list[BudgetSpec | str] | None = None, schedule_dir=None) -> list[dict]:
    """Rows with ``budget``, ``budget_fraction`` (of the working set), ``budget_spec`` (as
    given), ``executor``, ``makespan_s``, ``lower_bound_s`` (max of compute time, H2D bytes /
    bandwidth, D2H bytes / bandwidth), ``compute_s``, ``h2d_s``, ``d2h_s``, ``offloaded_bytes``,
    ``reloaded_bytes``, ``fits_without_offload``, ``vertices``, ``compile_s``, and the model's
    shape. A budget below one vertex's needs gives a row with ``error`` (the reason) and no
    timings. ``makespan_s`` is the best of ``repeats`` runs, ``makespans_s`` all of them;
    ``peak_bytes`` is the most bytes the plan holds at once on one GPU (:func:`sweep_budgets`).

    ``budgets`` (sizes or fractions, :class:`BudgetSpec` or its text), in the order given,
    replace ``fractions`` (fractions of the working set).

    ``schedule_dir``: for each budget, the first run under each executor drawn and saved there
    (:func:`vmstoolkit.exec.plots.save_schedules`: ``schedule_<bytes>B.png`` and ``.json``); on
    the cuda backend that run times every vertex with CUDA events.

    What moves: ``offloaded_bytes`` are GPU -> host copies, made only for activations evicted
    before their last use, once each (weights and inputs have a host copy from the start, so
    evicting them copies nothing: they are dropped); ``reloaded_bytes`` are host -> GPU copies:
    weights that did not fit at the start and every dropped or offloaded tensor brought back.
    Offloaded 0 with reloads climbing means only weights were dropped.
    """
    if budgets is None:
        for frac in fractions:
            if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not (math.isfinite(frac) and frac > 0):
                raise InvalidBudgetError(f"budget fraction {frac!r}: must be a positive finite number (1 = the working set)")
        specs = [BudgetSpec(fraction=float(f), text=f"{f:g}") for f in fractions]
    else:
        specs = [b if isinstance(b, BudgetSpec) else BudgetSpec.parse(b) for b in budgets]
    kind = backend_kind(backend)
    if kind.real:
        require_gpus(n_gpus)  # before minutes of compiling
    cfg = config or LlamaConfig()
    graph = build_llama(cfg, parts=parts, n_gpus=n_gpus)
    ws = working_set(graph)
    cost = values = pool = None
    if kind.real:
        from vmstoolkit.exec.backends.cuda import random_host_values
        from vmstoolkit.exec.backends.host_memory import PinnedPool

        values = random_host_values(graph, seed)
        pool = PinnedPool()  # values pinned in place by the first run, slots pinned once: every run shares them
    else:
        from vmstoolkit.exec.backends.sim import CostModel

        cost = CostModel()

    def new_backend(i):
        return make_backend(kind, cost=cost, seed=seed + i, jitter=jitter, values=values, pin="in_place", pool=pool,
                            timeline=schedule_dir is not None and i == 0)

    def bound(mg):
        return lower_bound(kind, mg, cost=cost, values=values)

    budget_rows = []
    for spec in specs:
        budget = spec.resolve(ws)
        budget_rows.append(({"budget": budget,
                             "budget_fraction": spec.fraction if spec.fraction is not None else budget / ws,
                             "budget_spec": spec.text, "working_set": ws, "n_gpus": n_gpus, "blocks": cfg.n_blocks,
                             "parts": parts, "seq": cfg.seq, "hidden": cfg.hidden, "heads": cfg.heads, "ffn": cfg.ffn,
                             "backend": kind.value, "fits_without_offload": budget >= ws}, budget))
    first: dict[int, dict] = {}  # budget -> executor -> (memory graph, makespan, spans) of its first run

    def observe(be, res, fields, ex, i):
        if i == 0:
            first.setdefault(fields["budget"], {})[ex] = (be.mg, res.makespan_s, list(be.spans))
    try:
        rows = list(sweep_budgets(graph, budget_rows, new_backend, bound, executors=executors, repeats=repeats,
                                  observe=observe if schedule_dir is not None else None))
    finally:
        if pool is not None:
            pool.close()
    for budget, runs in first.items():
        save_schedules(schedule_dir, budget, runs, "GPU, CUDA events" if kind.real else "simulated")
    return rows


def sweep_budgets(graph: TaskGraph, budgets: Iterable[tuple[dict, int]], make_backend: Callable[[int], object],
                  lower_bound: Callable[[MemoryGraph], dict], *, executors=EXECUTORS, repeats: int = 1,
                  reference: Mapping | None = None, read: Callable[[object], Mapping] | None = None,
                  rtol: float = 1e-3, keep_going: bool = False, check_runs: int | None = None,
                  observe: Callable | None = None) -> Iterator[dict]:
    """Compile ``graph`` at each budget and run the memory graph with each executor, ``repeats``
    times, each run on a fresh ``make_backend(repeat)`` closed afterwards even when the run fails
    (a GPU backend gives its region back). Yields one row per (budget, executor), as it is measured.
    Every run starts from the same values: the runtime never writes a weight or input (a training
    step's updated weights and moments are new tensors), so backends that share pinned values
    across runs (``CudaBackend(values, pin="in_place" or "register", pool=one PinnedPool)``, which
    pin once instead of once a run) time the same step at every repeat.

    ``budgets``: ``(fields, nbytes)`` pairs; ``fields`` start each row of that budget. A row then
    has ``executor``, ``makespan_s`` (the best run), ``makespans_s`` (every run), the fields of
    ``lower_bound(memory_graph)`` (``lower_bound_s`` and its terms), ``offloaded_bytes``,
    ``reloaded_bytes``, ``vertices``, ``compile_s``, ``peak_bytes`` (most bytes in use at once
    on one GPU) and ``host_s``: wall seconds spent over all runs in making backends, executing,
    reading and checking, and closing (``backend``, ``execute``, ``check``, ``close``): where a
    sweep's time goes besides the steps themselves. A budget below one vertex's needs gives rows with ``error`` (the reason) and no
    timings.

    ``reference``: key -> expected array (tensor ids, for the default ``read``). Each run's
    ``read(backend)`` (default: its ``result()``), read before the backend closes, is compared
    with it on the reference's keys:
    the row gets ``max_abs_err`` (largest over runs and tensors), ``ref_max_abs`` (the reference's
    largest magnitude) and ``equal`` (``max_abs_err <= rtol * max(1, ref_max_abs)``).
    ``check_runs``: read and compare only the first that many runs of each (budget, executor)
    (default: every run; reading back a full fine-tuning step's 39 GB of weights and moments costs
    more host time than the step); the row's ``checked_runs`` says how many were.

    ``observe(backend, result, fields, executor, repeat)``: called after each run that completes,
    before the backend closes (e.g. to keep a run's ``spans``).

    ``keep_going``: a run or compile that raises gives its row ``error`` (type and message) and
    ``traceback`` and the sweep goes on (a long GPU session keeps its other results); otherwise the
    exception propagates."""
    read = read or (lambda be: be.result())
    scale = max(float(np.max(np.abs(a))) for a in reference.values()) if reference else None
    for fields, budget in budgets:
        t0 = time.perf_counter()
        try:
            mg = compile_memory_graph(graph, budget)
        except BudgetTooSmallError as e:
            yield from ({**fields, "executor": ex, "error": str(e)} for ex in executors)
            continue
        except Exception as e:
            if not keep_going:
                raise
            yield from ({**fields, "executor": ex, **_failure(e)} for ex in executors)
            continue
        compile_s = time.perf_counter() - t0
        lb = lower_bound(mg)
        for ex in executors:
            row = {**fields, "executor": ex}
            host = dict.fromkeys(("backend", "execute", "check", "close"), 0.0)

            def lap(phase: str, since: float) -> float:
                now = time.perf_counter()
                host[phase] += now - since
                return now

            try:
                spans, err = [], 0.0
                for i in range(repeats):
                    clock = time.perf_counter()
                    be = make_backend(i)
                    clock = lap("backend", clock)
                    try:
                        res = execute(mg, be, ex)
                        spans.append(res.makespan_s)
                        clock = lap("execute", clock)
                        if observe is not None:
                            observe(be, res, fields, ex, i)
                        if reference is not None and (check_runs is None or i < check_runs):
                            got = read(be)
                            err = max(err, max(float(np.max(np.abs(got[t] - ref))) for t, ref in reference.items()))
                            clock = lap("check", clock)
                    finally:
                        be.close()  # give the GPU region back
                        lap("close", clock)
            except Exception as e:
                if not keep_going:
                    raise
                yield {**row, **lb, **_failure(e)}
                continue
            row.update(makespan_s=min(spans), **lb, offloaded_bytes=mg.offloaded_bytes,
                       reloaded_bytes=mg.reloaded_bytes, vertices=len(mg.vertices), compile_s=compile_s,
                       makespans_s=spans, peak_bytes=max(mg.peak_bytes), host_s=host)
            if reference is not None:
                row.update(max_abs_err=err, ref_max_abs=scale, equal=bool(err <= rtol * max(1.0, scale)),
                           checked_runs=repeats if check_runs is None else min(repeats, check_runs))
            yield row


def _failure(e: Exception) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}


def plot_makespan(rows: list[dict], path, title: str | None = None):
    """Makespan and lower bound against budget (GiB), one line per executor; returns the Figure.

    The title names the model and backend (from the rows, unless ``title`` is given). Where a
    makespan is below its row's ``lower_bound_s`` (on a GPU the compute term is a measured run of
    the direct forward, so an estimate), the line is labelled as an estimate and the figure says
    how many points beat it. The y axis
    spans the data, not zero to the top: the executors differ by a few percent, which a
    zero-based axis flattens (the axis label's values say where it starts)."""

    from matplotlib.figure import Figure  # no pyplot: the caller's backend is left alone

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    ok = [r for r in rows if "makespan_s" in r]
    for ex in dict.fromkeys(r["executor"] for r in ok):
        pts = sorted((r["budget"] / 2**30, r["makespan_s"]) for r in ok if r["executor"] == ex)
        ax.plot(*zip(*pts), marker="o", label=ex)
    lb = sorted({(r["budget"] / 2**30, r["lower_bound_s"]) for r in ok})
    below = sum(r["makespan_s"] < r["lower_bound_s"] * (1 - 1e-3) for r in ok)
    if lb and below:
        # On a GPU the compute term is a measured time of the direct forward (a different
        # program: every tensor its own array, no reuse), not a floor; say so where runs beat it.
        ax.plot(*zip(*lb), "k--", label="bound estimate: max(direct forward, copies)")
        ax.annotate(f"{below} point{'s' if below != 1 else ''} below the estimate: its compute term is a measured "
                    "run of the direct forward, not a floor", xy=(0.01, 0.01), xycoords="figure fraction", fontsize=7)
    elif lb:
        ax.plot(*zip(*lb), "k--", label="lower bound")
    ax.set_xlabel("GPU budget per GPU (GiB)")
    ax.set_ylabel("makespan (s)")
    ax.margins(y=0.08)
    ax.set_title(title if title is not None else _title(rows), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return fig


def _title(rows: list[dict]) -> str:
    """"Makespan against GPU budget: LLaMA prefill, 16 blocks" over "seq 2048, hidden 4096,
    heads 32; sim backend, 1 GPU", from whichever of those fields the rows carry."""
    r = rows[0] if rows else {}
    first = "Makespan against GPU budget: LLaMA prefill" + (f", {r['blocks']} blocks" if "blocks" in r else "")
    second = [", ".join(f"{k} {r[k]}" for k in ("seq", "hidden", "heads") if k in r)]
    gpus = r.get("n_gpus", r.get("gpus"))
    second.append(", ".join(x for x in (f"{r['backend']} backend" if "backend" in r else "",
                                         f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "") if x))
    second = "; ".join(x for x in second if x)
    return first + (f"\n{second}" if second else "")
