"""Greedy generation from a checkpoint under a GPU budget: one memory plan per budget over the
whole run (:mod:`.graph`), run on the sim or the cuda backend.

:func:`run_generate` yields one row per budget: the prompt and generated ids, the timings split
at the prefill's last vertex (``prefill_s``: the prompt through the model up to the first new
token, from the backend's spans; ``decode_s``: the rest of the makespan; both ``None`` on cuda
with several GPUs, whose spans have a clock per GPU), tokens per second of each, bytes moved each way, the plan's
peak GPU bytes and host bytes (:mod:`vmstoolkit.exec.host_plan`), compile seconds.

Numerics. On cuda the kernels compute every token. On the sim backend the numpy kernels run when
the generation is small (at most :data:`SIM_NUMERICS_FLOPS`, or when asked); otherwise it
simulates the timing alone and the row's ``tokens`` is ``None`` (``numerics: false``): a
simulated 7B run has no tokens to show, and none are made up.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from vmstoolkit.exec.backends import backend_kind
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.errors import BudgetTooSmallError, InvalidOptionError, InvalidShapeError
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.experiment import BudgetSpec, require_gpus
from vmstoolkit.exec.model.checkpoint import Checkpoint, load_model
from vmstoolkit.exec.model.graph import build_generate
from vmstoolkit.exec.host_plan import check_host_budget, default_host_budget, host_plan
from vmstoolkit.exec.model.progress import Stages

SIM_NUMERICS_FLOPS = 5e10  # a few seconds of numpy


def prompt_from(ckpt: Checkpoint, prompt_ids=None, prompt_len: int | None = None, seed: int = 0) -> list[int]:
    """The prompt: ``prompt_ids`` checked against the vocabulary, or ``prompt_len`` ids drawn
    with ``seed``."""
    vocab = ckpt.config.vocab
    if prompt_ids is not None:
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise InvalidShapeError("the prompt is empty: give at least one token id")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise InvalidShapeError(f"prompt id {bad[0]} is outside the vocabulary (0 .. {vocab - 1})")
        return ids
    if prompt_len is None or prompt_len < 1:
        raise InvalidShapeError(f"prompt_len={prompt_len!r}: must be at least 1 (or give prompt ids)")
    return np.random.default_rng(seed).integers(0, vocab, prompt_len).tolist()


def model_values(ckpt: Checkpoint, weights: dict[int, str]) -> dict[int, np.ndarray]:
    """Tensor id -> the checkpoint's array (a view of the mapped file for float32)."""
    cache: dict[str, np.ndarray] = {}
    out = {}
    for t, name in weights.items():
        if name not in cache:
            cache[name] = ckpt.get(name)
        out[t] = cache[name]
    return out


def _prefill_end(mg, be, first_token_vertex: int) -> float:
    """End of the prefill's argmax on the backend's spans (seconds from the run's start)."""
    ends = {v: end for v, _, _, _, end in be.spans}
    for mv in mg.vertices:
        if mv.kind == "compute" and mv.task == first_token_vertex and mv.id in ends:
            return ends[mv.id]
    return float("nan")


def run_generate(model, *, prompt_ids=None, prompt_len: int | None = None, new_tokens: int = 16,
                 budgets=("1.0",), backend: str = "sim", n_gpus: int = 1, host_budget: int | None = -1,
                 executor: str = "event-driven", numerics: bool | None = None, logits: str = "last",
                 seed: int = 0, jitter: float = 0.0, stages: Stages | None = None,
                 too_small_rows: bool = True, pool=None, warmup: bool | None = None,
                 bound_pool: bool = False) -> Iterator[dict]:
    """Rows of a greedy generation (module docstring), one per budget in ``budgets`` (sizes or
    fractions of the working set, :class:`~vmstoolkit.exec.experiment.BudgetSpec` text).

    ``model``: a folder or a :class:`Checkpoint`. ``host_budget``: bytes (``None``: no check;
    ``-1``, the default: :func:`default_host_budget`). A plan above it is refused with one line
    before any backend is made. ``logits="all"`` keeps the prefill's logits of every position
    (the row's ``prefill_logits``, for comparing with transformers). A budget below one
    vertex's needs gives a row with ``error`` (or, without ``too_small_rows``, raises
    :class:`~vmstoolkit.exec.errors.BudgetTooSmallError`). ``pool``: the
    :class:`~vmstoolkit.exec.backends.host_memory.PinnedPool` of the cuda runs (default: one made
    here for all the budgets, weights pinned once, closed at the end). ``warmup``: on cuda, one
    untimed run first, which JIT-compiles the kernels (default: on cuda). ``bound_pool``: give
    ``pool`` the plans' largest pinned staging as its hard bound (``limit_bytes``) once every
    budget is planned (the pool made here always is)."""
    stages = stages or Stages()
    kind = backend_kind(backend)
    backend, real = kind.value, kind.real
    specs = [b if isinstance(b, BudgetSpec) else BudgetSpec.parse(b) for b in budgets]
    if real:
        require_gpus(n_gpus)
    if real and pool is None:
        from vmstoolkit.exec.backends.host_memory import PinnedPool

        with PinnedPool() as own:  # weights pinned once for every budget, slots too; bounded by the plans
            yield from run_generate(model, prompt_ids=prompt_ids, prompt_len=prompt_len, new_tokens=new_tokens, budgets=specs, backend=backend,
                                    n_gpus=n_gpus, host_budget=host_budget, executor=executor, numerics=numerics,
                                    logits=logits, seed=seed, jitter=jitter, stages=stages,
                                    too_small_rows=too_small_rows, pool=own, warmup=warmup, bound_pool=True)
        return
    with stages.stage("loading the checkpoint"):
        ckpt = model if isinstance(model, Checkpoint) else load_model(model)
        ids = prompt_from(ckpt, prompt_ids, prompt_len, seed)
    with stages.stage("building the task graph"):
        gg = build_generate(ckpt.config, len(ids), new_tokens, logits=logits, n_gpus=n_gpus)
        graph = gg.graph
        flops = sum(v.flops for v in graph.vertices)
    if numerics is None:
        numerics = real or flops <= SIM_NUMERICS_FLOPS
    if real and not numerics:
        raise InvalidOptionError(f"the {backend} backend always computes (numerics cannot be off)")
    with stages.stage("measuring the working set"):
        ws = working_set(graph) if any(s.fraction is not None for s in specs) else None
    hb = default_host_budget() if host_budget == -1 else host_budget
    mapped = {t for t, name in gg.weights.items() if ckpt.is_mapped(name)}
    base = {"model": str(ckpt.folder), "model_type": ckpt.config.model_type, "backend": backend, "n_gpus": n_gpus,
            "executor": executor, "prompt_len": len(ids), "new_tokens": new_tokens, "working_set": ws,
            "prompt_ids": ids, "numerics": bool(numerics)}
    values = None
    warm = not (real if warmup is None else warmup)
    planned = []  # every budget planned and its host memory checked before anything is allocated
    for spec in specs:
        budget = spec.resolve(ws) if spec.fraction is not None else spec.nbytes
        row = {**base, "budget": budget, "budget_spec": spec.text,
               "budget_fraction": budget / ws if ws else None}
        with stages.stage(f"planning at {spec.text}"):
            try:
                mg = compile_memory_graph(graph, budget)
            except BudgetTooSmallError as e:
                if not too_small_rows:
                    raise
                planned.append(({**row, "error": str(e)}, None, 0))
                continue
        plan = host_plan(mg, mapped=mapped, pinned_copies=real, sim_numerics=not real and numerics,
                         materialized=numerics, pin="in_place" if real else None)
        check_host_budget(plan, hb)
        row.update(plan.as_row(), host_budget=hb, compile_s=stages.times[f"planning at {spec.text}"],
                   vertices=len(mg.vertices), peak_bytes=max(mg.peak_bytes), offloaded_bytes=mg.offloaded_bytes,
                   reloaded_bytes=mg.reloaded_bytes, moved_bytes=mg.offloaded_bytes + mg.reloaded_bytes)
        planned.append((row, mg, plan.staging))
    if bound_pool and pool is not None:
        pool.limit_bytes = max((p[2] for p in planned if p[1] is not None), default=0)
    for row, mg, _ in planned:
        if mg is None:
            yield row
            continue
        spec_text = row["budget_spec"]
        if values is None and numerics:
            values = model_values(ckpt, gg.weights)
            values[gg.prompt] = np.asarray(ids, np.int32)
        if not warm:
            with stages.stage("JIT compiling the kernels (a first run)"):
                _run_once(mg, kind, values, executor, seed, jitter, pool)
            warm = True
        with stages.stage(f"generating at {spec_text}"):
            res = _run_once(mg, kind, values, executor, seed, jitter, pool, first=gg.first_token_vertex,
                            outputs=[gg.logits, *gg.tokens] if numerics else None)
        makespan, prefill_s, lb, out = res
        decode_s = None if prefill_s is None else makespan - prefill_s
        row.update(makespan_s=makespan, prefill_s=prefill_s, decode_s=decode_s, lower_bound_s=lb,
                   prefill_tokens_per_s=len(ids) / prefill_s if prefill_s else None,
                   decode_tokens_per_s=(new_tokens - 1) / decode_s if new_tokens > 1 and decode_s else None)
        if out is not None:
            row["tokens"] = [int(out[t][0]) for t in gg.tokens]
            if logits == "all":
                row["prefill_logits"] = out[gg.logits]
        else:
            row["tokens"] = None
        yield row


def _run_once(mg, kind, values, executor, seed, jitter, pool, first=-1, outputs=None):
    """(makespan, prefill seconds, lower bound, outputs or None) of one run on a fresh backend
    of ``kind`` (a :class:`~vmstoolkit.exec.backends.BackendKind`)."""
    from vmstoolkit.exec.backends import make_backend

    if not kind.real:
        from vmstoolkit.exec.backends.sim import CostModel

        cost = CostModel()
        be = make_backend(kind, cost=cost, seed=seed, jitter=jitter, numerics=values is not None, values=values)
        lb = cost.lower_bound(mg)["lower_bound_s"]
    else:  # the lower bound of a whole generation would need every tensor resident at once: not measured
        be = make_backend(kind, values=values, timeline=True, pin="in_place", pool=pool)
        lb = None
    try:
        res = execute(mg, be, executor)
        out = be.result(outputs) if outputs is not None else None
        # the CUDA backend's spans count from each GPU's own first vertex: one GPU's are the run's clock
        one_clock = not kind.real or mg.n_gpus == 1
        prefill = _prefill_end(mg, be, first) if first >= 0 and one_clock else None
    finally:
        be.close()
    return res.makespan_s, prefill, lb, out


def generate(model, prompt_ids, new_tokens: int, *, budget="1.0", backend: str = "sim", **kw) -> list[int]:
    """The greedy continuation of ``prompt_ids`` (a list of ids) by ``model`` under ``budget``."""
    row = next(run_generate(model, prompt_ids=prompt_ids, new_tokens=new_tokens, budgets=(budget,),
                            backend=backend, numerics=True, too_small_rows=False, **kw))
    return row["tokens"]


__all__ = ["run_generate", "generate", "prompt_from", "model_values"]
