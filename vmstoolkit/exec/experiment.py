"""The offload experiment: makespan against GPU budget, per executor (pure functions).

``run_offload_experiment`` builds a LLaMA prefill graph, measures its no-offload working set,
and for budgets from the whole working set down to a fraction of it compiles a memory graph and
runs it with each executor, returning one row per (budget, executor). Printing happens in the
CLI (``vmstoolkit.cli.offload``).
"""

from __future__ import annotations

import math
import time

from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.errors import BudgetTooSmallError, InvalidBudgetError
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.graph import LlamaConfig, build_llama

DEFAULT_FRACTIONS = (1.0, 0.75, 0.5, 0.375, 0.25, 0.125)
EXECUTORS = ("event-driven", "fixed-order")


def run_offload_experiment(backend: str = "sim", n_gpus: int = 1, *, config: LlamaConfig | None = None,
                           parts: int = 1, fractions=DEFAULT_FRACTIONS, executors=EXECUTORS,
                           seed: int = 0, jitter: float = 0.05, repeats: int = 1) -> list[dict]:
    """Rows with ``budget``, ``budget_fraction``, ``executor``, ``makespan_s``, ``lower_bound_s``
    (max of compute time, H2D bytes / bandwidth, D2H bytes / bandwidth), ``compute_s``,
    ``h2d_s``, ``d2h_s``, ``offloaded_bytes`` (GPU -> host), ``reloaded_bytes`` (host -> GPU),
    ``fits_without_offload``, ``vertices``, ``compile_s``. A budget below one vertex's needs
    gives a row with ``error`` and no timings. ``makespan_s`` is the best of ``repeats`` runs.
    """
    for frac in fractions:
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not (math.isfinite(frac) and frac > 0):
            raise InvalidBudgetError(f"budget fraction {frac!r}: must be a positive finite number (1 = the working set)")
    if backend == "cuda":
        require_gpus(n_gpus)  # before minutes of compiling
    cfg = config or LlamaConfig()
    graph = build_llama(cfg, parts=parts, n_gpus=n_gpus)
    ws = working_set(graph)
    if backend == "sim":
        from vmstoolkit.exec.backends.sim import CostModel, SimBackend

        cost = CostModel()

        def make_backend(i):
            return SimBackend(cost, seed=seed + i, jitter=jitter)

        def lower_bound(mg):
            return cost.lower_bound(mg)
    elif backend == "cuda":
        from vmstoolkit.exec.backends.cuda import CudaBackend, measure_lower_bound, random_host_values

        values = random_host_values(graph, seed)

        def make_backend(i):
            return CudaBackend(values)

        def lower_bound(mg):
            return measure_lower_bound(mg, values)
    else:
        raise ValueError(f"unknown backend {backend!r} (choose 'sim' or 'cuda')")

    rows = []
    for frac in fractions:
        budget = int(ws * frac)
        base = {"budget": budget, "budget_fraction": frac, "working_set": ws, "n_gpus": n_gpus,
                "blocks": cfg.n_blocks, "parts": parts, "backend": backend,
                "fits_without_offload": budget >= ws}
        t0 = time.perf_counter()
        try:
            mg = compile_memory_graph(graph, budget)
        except BudgetTooSmallError as e:
            rows.extend({**base, "executor": ex, "error": str(e)} for ex in executors)
            continue
        compile_s = time.perf_counter() - t0
        lb = lower_bound(mg)
        for ex in executors:
            spans = []
            for i in range(repeats):
                be = make_backend(i)
                spans.append(execute(mg, be, ex).makespan_s)
                if hasattr(be, "close"):
                    be.close()  # give the GPU region back
            rows.append({**base, "executor": ex, "makespan_s": min(spans), **lb,
                         "offloaded_bytes": mg.offloaded_bytes, "reloaded_bytes": mg.reloaded_bytes,
                         "vertices": len(mg.vertices), "compile_s": compile_s})
    return rows


def require_gpus(n: int) -> None:
    """Raise :class:`~vmstoolkit.errors.NoGPUError` (one line) unless this machine has ``n``
    usable CUDA GPUs for the cuda backend."""
    from vmstoolkit.errors import NoGPUError
    from vmstoolkit.pools.cuda_driver import cuda_init

    try:
        cuda_init(n - 1)
    except NoGPUError as e:
        reason = " ".join(str(e).split()).split("; use the simulated driver")[0]
        raise NoGPUError(f"the cuda backend needs {n} CUDA GPU(s): {reason}; the sim backend runs without one") from None


def plot_makespan(rows: list[dict], path) -> None:
    """Makespan and lower bound against budget (GiB), one line per executor."""

    from matplotlib.figure import Figure  # no pyplot: the caller's backend is left alone

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ok = [r for r in rows if "makespan_s" in r]
    for ex in dict.fromkeys(r["executor"] for r in ok):
        pts = sorted((r["budget"] / 2**30, r["makespan_s"]) for r in ok if r["executor"] == ex)
        ax.plot(*zip(*pts), marker="o", label=ex)
    lb = sorted({(r["budget"] / 2**30, r["lower_bound_s"]) for r in ok})
    if lb:
        ax.plot(*zip(*lb), "k--", label="lower bound")
    ax.set_xlabel("GPU budget per GPU (GiB)")
    ax.set_ylabel("makespan (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
