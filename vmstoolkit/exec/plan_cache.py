"""Plans reused across steps whose sequence length changes: a cache keyed by shape bucket.

Note [Shape buckets]
--------------------
Rationale. A memory plan (compiled memory graph) is tied to every tensor's size, so a new
sequence length needs a new plan, and compiling one costs about a quarter of a simulated step
(16 LLaMA-7B-wide blocks, LoRA, seq 2048: 0.19 s to compile against a 0.69 s step). Planning
every step would spend a fifth of the run planning.

Approach. Round each length up to a bucket edge and pad: the graph of the bucket is compiled
once and reused. Edges grow geometrically (``ratio``) on a ``granule`` grid: 256, 512, 768,
1024, 1280, 1536, 2048, 2560, 3072, 3840, 4864... for ratio 1.25, granule 256. A length pays at
most ``ratio - 1`` extra rows (less with attention's quadratic part), and the number of plans
grows with the log of the length range: 12 plans cover 256..4096 at ratio 1.25.
``benchmarks/train_shape_buckets.py`` gives the trade-off: exact lengths recompile almost every
step; ratio 1.25 keeps planning near 2% of simulated time for an 11% padding cost on average.

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
from vmstoolkit.exec.graph import LlamaConfig
from vmstoolkit.exec.train_graph import AdamWConfig, TrainGraph, build_train_step

DEFAULT_GRANULE = 256  # rows: a multiple of every GEMM tile height, and of 16-row attention tiles
DEFAULT_RATIO = 1.25  # at most 25% padding; see benchmarks/train_shape_buckets.py


def bucket_edge(seq: int, granule: int = DEFAULT_GRANULE, ratio: float = DEFAULT_RATIO,
                max_seq: int | None = None) -> int:
    """The smallest bucket edge >= ``seq``: edges start at ``granule`` and each next one is the
    previous times ``ratio`` rounded up to the granule (at least one granule more), the last
    one capped at ``max_seq`` rounded up to the granule. ``ratio`` 1.0 gives every multiple of
    the granule."""
    if seq <= 0:
        raise ValueError(f"sequence length must be positive, got {seq}")
    if granule <= 0 or ratio < 1.0:
        raise ValueError(f"granule={granule} must be positive and ratio={ratio} >= 1")
    e = granule
    while e < seq:
        e = max(e + granule, -(-int(np.ceil(e * ratio)) // granule) * granule)
    if max_seq is not None:
        if seq > max_seq:
            raise ValueError(f"sequence length {seq} exceeds max_seq={max_seq}")
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
                 ratio: float = DEFAULT_RATIO, max_seq: int | None = None, check: bool = True):
        self.config, self.variant, self.budget = config, variant, budget
        self.rank, self.adamw = rank, adamw
        self.granule, self.ratio, self.max_seq, self.check = granule, ratio, max_seq, check
        self.plans: dict[int, Plan] = {}
        self.hits = self.misses = 0
        self.plan_s = 0.0  # every second spent planning, lookups included

    def bucket(self, seq: int) -> int:
        return bucket_edge(seq, self.granule, self.ratio, self.max_seq)

    def get(self, seq: int) -> Plan:
        """The plan for a step of ``seq`` positions (compiled on the bucket's first use)."""
        t0 = time.perf_counter()
        edge = self.bucket(seq)
        plan = self.plans.get(edge)
        if plan is None:
            self.misses += 1
            tg = build_train_step(replace(self.config, seq=edge), self.variant, rank=self.rank, adamw=self.adamw)
            mg = compile_memory_graph(tg.graph, self.budget)
            if self.check:
                check_race_free(mg)
            plan = Plan(edge, tg, mg, time.perf_counter() - t0)
            self.plans[edge] = plan
        else:
            self.hits += 1
        self.plan_s += time.perf_counter() - t0
        return plan


def pad_rows(a: np.ndarray, batch: int, seq: int, seq_pad: int) -> np.ndarray:
    """(batch * seq, H) -> (batch * seq_pad, H), zeros after each sequence's real positions."""
    h = a.shape[-1]
    out = np.zeros((batch, seq_pad, h), a.dtype)
    out[:, :seq] = a.reshape(batch, seq, h)
    return out.reshape(batch * seq_pad, h)
