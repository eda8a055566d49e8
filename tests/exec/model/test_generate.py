"""Greedy generation from the tiny checkpoints equals transformers' ``generate`` on them, and the
prefill logits equal its logits to fp32 noise, with every budget from the working set down to a
fraction where the weights and the KV cache go to the host and back."""

import numpy as np
import pytest

from tests.exec.model.helpers import NAMES, fixture, folder
from vmstoolkit.exec.errors import BudgetTooSmallError, InvalidShapeError
from vmstoolkit.exec.model import load_model
from vmstoolkit.exec.model.generate import generate, run_generate


def rows(name, budgets, **kw):
    fx = fixture(name)
    return fx, list(run_generate(folder(name), prompt_ids=fx["prompt_ids"].tolist(), new_tokens=len(fx["tokens"]),
                                 budgets=budgets, logits="all", **kw))


@pytest.mark.parametrize("name", NAMES)
def test_tokens_and_logits_equal_transformers_at_every_budget(name):
    fx, rs = rows(name, ("1.0", "0.5", "0.25"))
    assert [r["budget_fraction"] for r in rs] == pytest.approx([1.0, 0.5, 0.25], abs=1e-3)
    scale = float(np.abs(fx["prefill_logits"]).max())
    for r in rs:
        assert r["tokens"] == fx["tokens"].tolist(), r["budget_spec"]
        np.testing.assert_allclose(r["prefill_logits"], fx["prefill_logits"], rtol=0, atol=2e-5 * max(1.0, scale))
        assert r["prompt_ids"] == fx["prompt_ids"].tolist() and r["numerics"] is True
    assert rs[0]["moved_bytes"] == 0  # the working set holds everything
    assert rs[2]["reloaded_bytes"] > 0 and rs[2]["offloaded_bytes"] > 0
    assert all(r["peak_bytes"] <= r["budget"] for r in rs)


def test_the_kv_cache_is_a_value_the_plan_offloads():
    from vmstoolkit.exec.compiler import compile_memory_graph, working_set
    from vmstoolkit.exec.model.graph import build_generate

    cfg = load_model(folder("llama-tied")).config
    gg = build_generate(cfg, 7, 6)
    mg = compile_memory_graph(gg.graph, working_set(gg.graph) // 4)
    moved = {gg.graph.tensors[v.tensor].name for v in mg.vertices if v.kind == "offload"}
    assert any(n.endswith(("kcache", "vcache", ".kr", ".v")) for n in moved), sorted(moved)[:10]


def test_two_gpus_give_the_same_tokens():
    fx, (r,) = rows("llama-tied", ("0.5",), n_gpus=2)
    assert r["tokens"] == fx["tokens"].tolist() and r["n_gpus"] == 2


def test_rows_carry_timings_and_bytes():
    fx, (r,) = rows("qwen2", ("0.3",))
    for k in ("prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s", "offloaded_bytes",
              "reloaded_bytes", "moved_bytes", "host_plan_bytes", "compile_s", "makespan_s", "lower_bound_s"):
        assert r[k] is not None and r[k] >= 0, k
    assert 0 < r["prefill_s"] < r["makespan_s"]
    assert r["decode_tokens_per_s"] == pytest.approx((len(fx["tokens"]) - 1) / r["decode_s"])
    assert r["makespan_s"] >= r["lower_bound_s"] * 0.999


def test_generate_api_and_bad_prompts():
    fx = fixture("mistral")
    assert generate(folder("mistral"), fx["prompt_ids"].tolist(), 3) == fx["tokens"][:3].tolist()
    with pytest.raises(InvalidShapeError, match="prompt id 96 is outside the vocabulary"):
        generate(folder("mistral"), [1, 96], 2)
    with pytest.raises(BudgetTooSmallError):
        generate(folder("mistral"), [1, 2], 2, budget="1KiB")


def test_a_budget_too_small_gives_a_row_with_the_reason():
    _, (r,) = rows("llama-tied", ("2KiB",))
    assert "no schedule fits" in r["error"] and "tokens" not in r


@pytest.mark.slow
def test_cuda_backend_on_the_simulator_equals_the_sim_backend(sim_gpu, monkeypatch, tmp_path):
    """The real kernels (Numba's simulator) through the CUDA backend: embedding, biases, cache
    appends, attention over the cache and argmax run as on a GPU, on the first block of the Qwen2
    checkpoint (the simulator's GEMM takes a second a call: 16 of them here, about 20 s)."""
    import json
    import shutil

    from numba import cuda

    from tests.exec.helpers import FakeHostMemory
    from vmstoolkit.exec.backends.host_memory import PinnedPool

    class Event:  # timing events of the fake GPU: every vertex takes no time
        def record(self, stream):
            pass

        def query(self):
            return True

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 0.0

        def wait(self, stream):  # a stream waiting on it: every vertex is done at once here
            pass

    monkeypatch.setattr(cuda, "event", lambda timing=True: Event())
    monkeypatch.setattr("vmstoolkit.exec.model.generate.require_gpus", lambda n: None)
    one = tmp_path / "qwen2-1"
    shutil.copytree(folder("qwen2"), one)
    cfg = json.loads((one / "config.json").read_text())
    cfg.update(num_hidden_layers=1, layer_types=["full_attention"])
    (one / "config.json").write_text(json.dumps(cfg))  # the second block's tensors stay, unread
    kw = dict(prompt_ids=[5, 17, 2], new_tokens=2, budgets=("0.4",), logits="all")
    (want,) = run_generate(one, **kw)  # the sim backend's numpy (equal to transformers above)
    with PinnedPool(FakeHostMemory()) as pool:
        (r,) = run_generate(one, backend="cuda", pool=pool, warmup=False, **kw)
    assert r["tokens"] == want["tokens"]
    np.testing.assert_allclose(r["prefill_logits"], want["prefill_logits"], atol=1e-5)
    assert r["moved_bytes"] > 0
