"""Plans reused across steps whose sequence length changes: a cache keyed by shape bucket.

Note [Shape buckets]
--------------------
Rationale. A memory plan (compiled memory graph) is tied to every tensor's size, so a new
sequence length needs a new plan, and compiling one costs a tenth of a simulated step (16
LLaMA-7B-wide blocks, LoRA, seq 2048: 0.07 s to compile, ``benchmarks/compile_time.py``,
against a 0.69 s simulated step; 0.11 s when the figures below were measured, before the
compiler's placement search was made logarithmic). Planning every step would spend a tenth to a
sixth of the run planning.

Approach. Round each length up to a bucket edge and pad: the graph of the bucket is compiled
once and reused. Edges sit on a ``granule`` grid (256 rows) and may grow geometrically
(``ratio``): ratio 1.0 (the default) gives every multiple of 256, ratio 1.25 gives 256, 512,
768, 1024, 1280, 1792, 2304, 3072, 3840, 4864... A length pays at most one granule, or
``ratio - 1``, of extra rows.

Figures (``benchmarks/train_shape_buckets.py``, 100 steps drawn in 256..4096, 4 LLaMA-7B-wide
blocks, LoRA, budget half the working set at 4096, sim backend, this 2-core machine):

=========== ===== ========== ========= ============= ===========================
buckets     plans planning   simulated planning      (simulated + planning) /
                  (host s)   s         share         simulated at exact lengths
=========== ===== ========== ========= ============= ===========================
exact       100   3.75       18.55     16.8%         1.202
ratio 1.0   15    0.33       19.59     1.7%          1.074
ratio 1.25  9     0.20       20.89     1.0%          1.137
ratio 1.5   6     0.14       21.88     0.6%          1.187
ratio 2.0   4     0.09       25.53     0.3%          1.381
=========== ===== ========== ========= ============= ===========================

Planning every length costs a sixth of the run; the 256-row grid costs 1.7% planning and 5.6%
padding, the best total; coarser buckets plan less but pad more than they save. With a much
wider range of lengths (up to 32k: 128 grid buckets) a ratio above 1 bounds the plan count.

Padding is exact, not an approximation: padded positions are appended after the real ones, the
attention is causal (a real position never reads a padded one), and the loss gradient ``dout``
is zero on padded rows, so every gradient reaching a padded row is zero and the parameter
gradients equal those of the unpadded step (``tests/exec/test_plan_cache.py``).

Budget. The plan of every bucket is compiled for the same budget and checked by the race
checker before it is cached; the compiler never places a buffer outside ``[0, budget)``. A
budget below one vertex's needs raises :class:`BudgetTooSmallError` at the first bucket that
needs more.

Limitations. A bucket's first step pays its compile. A parametric plan (one placement whose
offsets are affine in the length) would avoid recompiles, but Belady eviction decisions change
with the sizes, so it would have to be re-validated per length anyway; the cache needs no such
argument.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from vmstoolkit.exec.checker import check_race_free
from vmstoolkit.exec.compiler import MemoryGraph, compile_memory_graph
from vmstoolkit.exec.errors import InvalidOptionError, InvalidShapeError
from vmstoolkit.exec.graph import LlamaConfig
from vmstoolkit.exec.train_graph import AdamWConfig, TrainGraph, build_train_step

DEFAULT_GRANULE = 256  # rows: a multiple of every GEMM tile height, and of 16-row attention tiles
DEFAULT_RATIO = 1.0  # every multiple of the granule: best total in the Note's table


def bucket_edge(seq: int, granule: int = DEFAULT_GRANULE, ratio: float = DEFAULT_RATIO,
                max_seq: int | None = None) -> int:
    """The smallest bucket edge >= ``seq``: edges start at ``granule`` and each next one is the
    previous times ``ratio`` rounded up to the granule (at least one granule more), the last
    one capped at ``max_seq`` rounded up to the granule. ``ratio`` 1.0 gives every multiple of
    the granule."""
    if seq <= 0:
        raise InvalidShapeError(f"sequence length must be positive, got {seq}")
    if granule <= 0 or ratio < 1.0:
        raise InvalidOptionError(f"granule={granule} must be positive and ratio={ratio} >= 1")
    e = granule
    while e < seq:
        e = max(e + granule, -(-int(np.ceil(e * ratio)) // granule) * granule)
    if max_seq is not None:
        if seq > max_seq:
            raise InvalidShapeError(f"sequence length {seq} exceeds max_seq={max_seq}")
        e = min(e, -(-max_seq // granule) * granule)
    return e


@dataclass
class Plan:
    seq: int  # the bucket's padded length
    train: TrainGraph
    memory: MemoryGraph
    plan_s: float  # host seconds to build, compile and check it


class PlanCache:
    """Training-step plans by bucket for one model, variant and budget (see the Note above)."""

    def __init__(self, config: LlamaConfig, variant: str, budget: int, *, rank: int = 16,
                 adamw: AdamWConfig | None = None, granule: int = DEFAULT_GRANULE,
                 ratio: float = DEFAULT_RATIO, max_seq: int | None = None, check: bool = True,
                 clock=time.perf_counter, recompute: bool = False):
        """``clock`` times planning: wall time by default; ``time.thread_time`` (CPU time of
        this thread) where other processes share the cores and would inflate wall time.
        ``recompute`` compiles every plan with ``compile_memory_graph(..., recompute=True)``."""
        self.config, self.variant, self.budget = config, variant, budget
        self.rank, self.adamw = rank, adamw
        self.granule, self.ratio, self.max_seq, self.check = granule, ratio, max_seq, check
        self.clock, self.recompute = clock, recompute
        self.plans: dict[int, Plan] = {}
        self.hits = self.misses = 0
        self.plan_s = 0.0  # every second spent planning, lookups included

    def bucket(self, seq: int) -> int:
        return bucket_edge(seq, self.granule, self.ratio, self.max_seq)

    def get(self, seq: int) -> Plan:
        """The plan for a step of ``seq`` positions (compiled on the bucket's first use)."""
        t0 = self.clock()
        edge = self.bucket(seq)
        plan = self.plans.get(edge)
        if plan is None:
            self.misses += 1
            tg = build_train_step(replace(self.config, seq=edge), self.variant, rank=self.rank, adamw=self.adamw)
            mg = compile_memory_graph(tg.graph, self.budget, recompute=self.recompute)
            if self.check:
                check_race_free(mg)
            plan = Plan(edge, tg, mg, self.clock() - t0)
            self.plans[edge] = plan
        else:
            self.hits += 1
        self.plan_s += self.clock() - t0
        return plan


def pad_rows(a: np.ndarray, batch: int, seq: int, seq_pad: int) -> np.ndarray:
    """(batch * seq, H) -> (batch * seq_pad, H), zeros after each sequence's real positions."""
    h = a.shape[-1]
    out = np.zeros((batch, seq_pad, h), a.dtype)
    out[:, :seq] = a.reshape(batch, seq, h)
    return out.reshape(batch * seq_pad, h)
