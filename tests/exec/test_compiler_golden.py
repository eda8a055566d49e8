"""Compiled memory graphs stay identical across refactors of the compiler.

``compiler_golden.json`` holds, for prefill and both training variants (and small random graphs)
at several budgets, a SHA-256 of everything the compiler produces: every vertex (kind, op,
stream, reads, writes, FLOPs, bytes, recompute flag), every buffer (tensor, GPU, offset, size,
writer, readers), the reduced edges and their kinds, the preloaded buffers, where outputs end and
the peak bytes. The budgets are fractions of each graph's ``budget_base``: its working set as the
compiler found it before compaction (issue 32's defect), frozen so that a change of
:func:`working_set` alone moves no case's budget. The working sets are pinned too.
It was written by the compiler before it was split into named steps and made near-linear
(issue 19 / issue 17, commit 7818467) and must only be rewritten on purpose, when a change is
meant to alter compiled graphs (the last time: the compiler's prefetch by need time, issue 32
item 7; the ``prefetch=False`` cases kept the digests recorded before it):

    python tests/exec/test_compiler_golden.py --write

(``budget_base`` is kept from the file being rewritten.) Compaction instead of eviction (Note
[Compaction instead of eviction] in ``compiler.py``) changed no case's digest (no case's budget holds
its graph's live peak but those at 1.0, which never met a fragmented region), only working sets:
``full4`` 13329876736 -> 12809749248, ``lora4`` 5996354816 -> 5648836864, ``lora8-gqa``
7000526080 -> 6862587904, ``random0`` 7168 -> 6912, ``random2`` 6400 -> 6144; the budgets
between, where fragmentation alone used to force an offload or a reload, now compact instead.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from tests.exec.helpers import random_graph, tiny_llama
from vmstoolkit.exec.compiler import MemoryGraph, compile_memory_graph, working_set
from vmstoolkit.exec.graph import LlamaConfig, build_llama
from vmstoolkit.exec.train_graph import build_train_step

GOLDEN = Path(__file__).with_name("compiler_golden.json")

GRAPHS = {
    "prefill4": lambda: build_llama(LlamaConfig(n_blocks=4)),
    "prefill4-parts2-2gpu": lambda: build_llama(LlamaConfig(n_blocks=4), parts=2, n_gpus=2),
    "tiny-parts2": lambda: tiny_llama(parts=2),
    "lora4": lambda: build_train_step(LlamaConfig(n_blocks=4), "lora").graph,
    "full4": lambda: build_train_step(LlamaConfig(n_blocks=4), "full").graph,
    "lora8-gqa": lambda: build_train_step(LlamaConfig(n_blocks=8, seq=512, kv_heads=8), "lora").graph,
    **{f"random{s}": (lambda s=s: random_graph(s)) for s in range(3)},
}

# (graph, fraction of its working set, compile options). 0.1 of prefill4 and of full4 take the
# compiler's fragmentation fallback (evict a whole GPU and place again).
BASE_CASES = [
    ("prefill4", 1.0, {}), ("prefill4", 0.5, {}), ("prefill4", 0.1, {}), ("prefill4", 0.25, {"preload": False}),
    ("prefill4-parts2-2gpu", 0.5, {}), ("prefill4-parts2-2gpu", 0.15, {}),
    ("tiny-parts2", 0.25, {}), ("tiny-parts2", 0.1, {"preload": False}),
    ("lora4", 1.0, {}), ("lora4", 0.5, {}), ("lora4", 0.25, {}), ("lora4", 0.1, {}),
    ("lora4", 0.5, {"recompute": True}), ("lora4", 0.25, {"recompute": True}),
    ("full4", 0.5, {}), ("full4", 0.25, {}), ("full4", 0.1, {}),
    ("full4", 0.25, {"recompute": True}), ("full4", 0.1, {"recompute": True}),
    ("lora8-gqa", 0.3, {}), ("lora8-gqa", 0.3, {"recompute": True}),
    *[(f"random{s}", f, {}) for s in range(3) for f in (0.5, 0.25)],
]
# Every case twice: as compiled by default (with prefetch, since 2026-12-02), and with
# ``prefetch=False``, whose digests are those the compiler wrote before prefetch existed (the
# old path stays byte-identical).
CASES = [*BASE_CASES, *[(g, f, {**o, "prefetch": False}) for g, f, o in BASE_CASES]]


def _key(graph: str, fraction: float, options: dict) -> str:
    opts = ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    return f"{graph}@{fraction}" + (f":{opts}" if opts else "")


def digest(mg: MemoryGraph) -> str:
    """SHA-256 of everything the compiler decided (JSON of plain values, in vertex/buffer order)."""
    doc = {
        "budget": mg.budget, "n_gpus": mg.n_gpus,
        "vertices": [[v.id, v.kind, v.op, v.name, v.gpu, v.stream, v.task, v.tensor, list(v.reads),
                      list(v.writes), v.flops, v.nbytes, v.recompute] for v in mg.vertices],
        "buffers": [[b.id, b.tensor, b.gpu, b.offset, b.size, b.writer, list(b.readers), list(b.inherited)]
                    for b in mg.buffers],
        "preds": [list(p) for p in mg.preds],
        "kinds": sorted([u, v, k] for (u, v), k in mg.kinds.items()),
        "preloaded": mg.preloaded,
        "output_location": sorted(mg.output_location.items()),
        "peak_bytes": mg.peak_bytes,
        "edges_before_reduction": mg.edges_before_reduction,
    }
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()


def record(graph: str, fraction: float, options: dict, ws: int) -> dict:
    mg = compile_memory_graph(GRAPHS[graph](), int(ws * fraction), **options)
    s = mg.summary()
    return {"summary": json.loads(json.dumps(s)), "sha256": digest(mg)}


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", CASES, ids=lambda c: _key(*c))
def test_compiled_graph_matches_the_recorded_one(case, golden):
    graph, fraction, options = case
    ws = golden["budget_base"][graph]
    assert record(graph, fraction, options, ws) == golden["cases"][_key(*case)]


@pytest.mark.parametrize("graph", ["prefill4", "tiny-parts2", "random0", "lora4"])
def test_working_set_matches_the_recorded_one(graph, golden):
    assert working_set(GRAPHS[graph]()) == golden["working_set"][graph]


def test_the_golden_file_covers_every_case(golden):
    assert set(golden["cases"]) == {_key(*c) for c in CASES}
    assert set(golden["working_set"]) == set(golden["budget_base"]) == set(GRAPHS)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/exec/test_compiler_golden.py --write")
    ws = {name: working_set(build()) for name, build in GRAPHS.items()}
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    base = {name: old.get("budget_base", {}).get(name, ws[name]) for name in GRAPHS}
    cases = {_key(*c): record(*c, base[c[0]]) for c in CASES}
    GOLDEN.write_text(json.dumps({"budget_base": base, "working_set": ws, "cases": cases}, indent=1, sort_keys=True)
                      + "\n")
    print(f"wrote {len(cases)} compiled graphs to {GOLDEN}")
