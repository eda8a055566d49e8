"""Host memory is planned: the figure adds what the run will hold, and a plan above the host
budget is refused in one line before any value is read or backend made."""

import pytest

from tests.exec.model.helpers import folder
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.errors import HostBudgetError
from vmstoolkit.exec.model import load_model
from vmstoolkit.exec.model.generate import run_generate
from vmstoolkit.exec.model.graph import build_generate
from vmstoolkit.exec.host_plan import check_host_budget, default_host_budget, host_plan
from vmstoolkit.exec.model.train import run_train, train_config
from vmstoolkit.exec.train_graph import build_train_step


def test_mapped_weights_cost_no_ram_unless_pinned():
    ck = load_model(folder("llama-tied"))
    gg = build_generate(ck.config, 5, 3)
    mg = compile_memory_graph(gg.graph, working_set(gg.graph) // 3)
    mapped = set(gg.weights)
    weights = sum(gg.graph.tensors[t].nbytes for t in gg.weights)
    assert host_plan(mg, mapped=mapped).weights == 0
    assert host_plan(mg, mapped=mapped, pinned_copies=True).weights == weights == host_plan(mg).weights
    p = host_plan(mg, mapped=mapped)
    offloads = {v.tensor for v in mg.vertices if v.kind == "offload"}
    assert p.offload == sum(gg.graph.tensors[t].nbytes for t in offloads) > 0
    assert p.state == 5 * 4 and p.outputs == 96 * 4 + 3 * 4  # prompt ids; last logits row and 3 tokens


def test_full_fine_tuning_counts_moments_and_updates():
    ck = load_model(folder("llama-tied"))
    tg = build_train_step(train_config(ck, 8), "full")
    mg = compile_memory_graph(tg.graph, working_set(tg.graph) // 2)
    trainable = tg.trainable_bytes()
    p = host_plan(mg)
    assert p.weights == trainable and p.state == 2 * trainable + 2 * 8 * 32 * 4  # moments, x and dout
    assert p.outputs == 3 * trainable  # updated weights and both moments


def test_refusal_is_one_line_naming_the_figures():
    from vmstoolkit.exec.host_plan import HostPlan

    with pytest.raises(HostBudgetError) as e:
        check_host_budget(HostPlan(weights=26 << 30, state=52 << 30), 58 << 30)
    assert str(e.value) == ("needs 78.00 GiB of host memory (weights 26.00 GiB, inputs 52.00 GiB), 58.00 GiB "
                            "available (--host-budget)")
    check_host_budget(HostPlan(weights=1), None)  # no budget: no check
    assert default_host_budget() is None or default_host_budget() >= 0


def test_runs_are_refused_before_anything_is_read(monkeypatch):
    import vmstoolkit.exec.model.generate as gen
    import vmstoolkit.exec.model.train as train

    def boom(*a, **k):
        raise AssertionError("values read before the host check")

    monkeypatch.setattr(gen, "model_values", boom)
    monkeypatch.setattr(train, "train_values", boom)
    with pytest.raises(HostBudgetError, match=r"available \(--host-budget\)"):
        list(run_generate(folder("qwen2"), prompt_len=4, new_tokens=2, budgets=("1.0", "0.5"), host_budget=1000))
    with pytest.raises(HostBudgetError, match="optimizer state and inputs"):
        list(run_train(folder("mistral"), variant="full", seq=8, steps=1, host_budget=1000))


def test_train_offload_refuses_a_plan_above_the_host_budget():
    """Issue 32: the 13B-width full fine-tune was killed by the kernel; the plan now says first."""
    from vmstoolkit.exec.graph import LlamaConfig
    from vmstoolkit.exec.train_experiment import run_train_experiment

    tiny = LlamaConfig(n_blocks=2, hidden=32, heads=4, kv_heads=2, ffn=48)
    with pytest.raises(HostBudgetError, match=r"updated weights and moments .* 1.00 KiB available"):
        run_train_experiment("sim", "full", ("0.5",), config=tiny, seq=16, steps=1, host_budget=1024)
    assert run_train_experiment("sim", "full", ("0.5",), config=tiny, seq=16, steps=1, host_budget=None)
    # timing alone holds no values: nothing to refuse
    assert run_train_experiment("sim", "full", ("0.5",), config=tiny, seq=16, steps=1, host_budget=1024,
                                check_grads=False)


def test_13b_width_full_fine_tuning_is_refused_on_a_128_gib_host():
    """The issue's shape (12 blocks, 5120 wide, 40/8 heads, FFN 13824, 1536 tokens, full, on cuda
    with the gradient check) needs more than a 128 GiB host has: refused, before any value."""
    from vmstoolkit.exec.graph import LlamaConfig
    from vmstoolkit.exec.train_experiment import check_train_host_memory

    cfg = LlamaConfig(n_blocks=12, seq=1536, hidden=5120, heads=40, kv_heads=8, ffn=13824)
    with pytest.raises(HostBudgetError, match=r"needs 1[0-9]{2}\.\d\d GiB of host memory .* 115.00 GiB available"):
        check_train_host_memory(cfg, "full", [20 << 30], 115 << 30)


@pytest.mark.parametrize("pin", ["in_place", "register", "copy"])
def test_the_plans_staging_bounds_the_pinned_pool_on_fake_host_memory(pin):
    """The pool given the plan's ``staging`` as its hard bound places every slot a backend
    needs, on FakeHostMemory; one byte less is refused in one line before the driver is asked."""
    import numpy as np

    from tests.exec.helpers import FakeHostMemory
    from vmstoolkit.exec.backends.host_memory import PinnedPool
    from vmstoolkit.exec.graph import random_weights

    tg = build_train_step(train_config(load_model(folder("llama-tied")), 16), "lora", rank=2)
    mg = compile_memory_graph(tg.graph, int(working_set(tg.graph) * 0.3))
    staging = host_plan(mg, pin=pin).staging
    offloaded = list(dict.fromkeys(v.tensor for v in mg.vertices if v.kind == "offload"))
    assert staging >= sum(tg.graph.tensors[t].nbytes for t in offloaded) > 0
    for limit, ok in ((staging, True), (staging - 1, False)):
        values = {k: np.ascontiguousarray(v) for k, v in random_weights(tg.graph, 0).items()}
        mem = FakeHostMemory()
        pool = PinnedPool(mem, limit_bytes=limit, register_min_bytes=1 << 20)
        lent: list = []
        if ok:
            pool.place(tg.graph, offloaded, values, pin, lent)
            assert pool.stats.allocated_bytes <= limit
            assert sum(a.nbytes for a in mem.allocated) - pool.stats.in_place_bytes <= limit
        else:
            with pytest.raises(HostBudgetError, match=r"^pinned staging needs .* above its bound of"):
                pool.place(tg.graph, offloaded, values, pin, lent)
        pool.give_back(lent)
        pool.close()


def test_a_bounded_pool_frees_idle_slots_of_other_sizes_before_it_grows():
    from tests.exec.helpers import FakeHostMemory
    from vmstoolkit.exec.backends.host_memory import PinnedPool
    from vmstoolkit.exec.errors import InvalidOptionError

    pool = PinnedPool(FakeHostMemory(), limit_bytes=1000)
    a, b = pool.lend((100,), "float32"), pool.lend((100,), "float32")  # 800 bytes
    pool.give_back([a, b])
    c = pool.lend((150,), "float32")  # 600 bytes: one idle slot is freed to make room, one kept
    assert pool.stats.allocated_bytes == 1000 and pool.stats.lent_bytes == 600
    d = pool.lend((100,), "float32")  # the kept idle slot
    assert pool.stats.allocated_bytes == 1000 and pool.stats.alloc_calls == 3
    with pytest.raises(HostBudgetError, match="1000 B lent"):
        pool.lend((1,), "uint8")
    assert pool.stats.allocated_bytes == 1000  # nothing asked of the driver
    pool.give_back([c, d])
    pool.close()
    with pytest.raises(InvalidOptionError, match="limit_bytes=-1"):
        PinnedPool(limit_bytes=-1)
