"""More budget never means more offload (issue 32's defect): from the unconstrained peak up to
1.5x it, the bytes offloaded plus reloaded never grow as the budget grows.

Before compaction (``compiler.py``'s Note [Compaction instead of eviction]) the tiny
checkpoints' generation graphs offloaded 400-590 bytes of tokens at some budgets up to 1.5x the
peak and nothing at others: a placement that found enough free bytes but no hole large enough
evicted Belady's victims (the tokens, graph outputs used last) and offloaded them.
"""

from __future__ import annotations

import pytest

from tests.exec.helpers import random_graph, tiny_llama, weighted_chain
from tests.exec.model.helpers import folder
from vmstoolkit.exec.compiler import align, compile_memory_graph


def _generate(name: str, prompt_len: int = 8, new_tokens: int = 64):
    def build():
        from vmstoolkit.exec.model.checkpoint import load_model
        from vmstoolkit.exec.model.graph import build_generate

        return build_generate(load_model(folder(name)).config, prompt_len, new_tokens).graph
    return build


def _lora(name: str):
    def build():
        from vmstoolkit.exec.model.checkpoint import load_model
        from vmstoolkit.exec.model.train import train_config
        from vmstoolkit.exec.train_graph import build_train_step

        return build_train_step(train_config(load_model(folder(name)), 8), "lora", rank=2).graph
    return build


GRAPHS = {
    "llama-tied-gen8/64": _generate("llama-tied"),
    "qwen2-gen8/64": _generate("qwen2"),
    "mistral-gen8/64": _generate("mistral"),
    "llama-tied-gen7/6": _generate("llama-tied", 7, 6),
    "llama-tied-lora": _lora("llama-tied"),
    "tiny": tiny_llama,
    "tiny-parts2": lambda: tiny_llama(parts=2),
    "tiny-parts2-2gpu": lambda: tiny_llama(parts=2, n_gpus=2),
    "chain": weighted_chain,
    **{f"random{s}": (lambda s=s: random_graph(s)) for s in range(3)},
}


def unconstrained_peak(graph) -> int:
    """The most bytes one GPU holds at once when the budget holds every tensor."""
    total = sum(align(t.nbytes) for t in graph.tensors)
    return max(compile_memory_graph(graph, total, check_budget=False).peak_bytes)


def budget_grid(lo: int, hi: float) -> list[int]:
    """``lo`` and then 1% steps (the steps ``working_set``'s walk took) while below ``hi``."""
    out = [lo]
    while (b := align(int(out[-1] * 1.01) + 1)) < hi:
        out.append(b)
    return out


@pytest.mark.parametrize("name", GRAPHS)
def test_offload_and_reload_never_grow_with_the_budget(name):
    g = GRAPHS[name]()
    peak = unconstrained_peak(g)
    moved = []
    for b in budget_grid(peak, 1.5 * peak):
        mg = compile_memory_graph(g, b, check_budget=False)
        moved.append((b, mg.offloaded_bytes + mg.reloaded_bytes))
    grew = [(a, b) for a, b in zip(moved, moved[1:]) if b[1] > a[1]]
    assert not grew, f"more budget, more bytes moved ((budget, bytes) pairs): {grew[:4]}"
