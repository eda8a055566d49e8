"""Training a checkpoint's blocks: the gradients of the runtime's step (sim backend, numpy kernels
through the offloading plan) equal torch.autograd's on the tiny checkpoints, LoRA and full,
at budgets that offload; and what training refuses."""

import numpy as np
import pytest

from tests.exec.model.helpers import TRAIN_NAMES, fixture, folder
from vmstoolkit.exec.backends.sim import SimBackend
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.errors import CheckpointError, InvalidOptionError
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.model import load_model
from vmstoolkit.exec.model.train import run_train, train_config, train_values
from vmstoolkit.exec.train_graph import build_train_step, grads_from_updates


def grads(name, variant, fraction):
    ck = load_model(folder(name))
    fx = fixture(name)
    ids = fx["prompt_ids"]
    tg = build_train_step(train_config(ck, len(ids)), variant, rank=2)
    adapters = {k[len("lora."):]: v for k, v in fx.items() if k.startswith("lora.")}
    values = train_values(ck, tg, ids, dout=fx["train_dout"], adapters=adapters)
    np.testing.assert_allclose(values[tg.x], fx["train_x"], atol=0)
    mg = compile_memory_graph(tg.graph, int(working_set(tg.graph) * fraction))
    be = SimBackend(numerics=True, values=values, jitter=0.0)
    execute(mg, be, "event-driven")
    return grads_from_updates(tg, values, be.result()), fx, mg


CASES = [(n, v) for n in TRAIN_NAMES for v in ("lora", "full") if not (n == "qwen2" and v == "full")]


@pytest.mark.parametrize("name,variant", CASES)
def test_gradients_equal_torch_autograd(name, variant):
    got, fx, mg = grads(name, variant, 0.4)
    assert mg.offloaded_bytes > 0 and mg.reloaded_bytes > 0
    want = {k[len(f"grad.{variant}."):]: v for k, v in fx.items() if k.startswith(f"grad.{variant}.")}
    assert set(got) == set(want)
    for k, w in want.items():
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(got[k], w, rtol=0, atol=5e-5 * scale, err_msg=k)


def test_run_train_rows_check_gradients_against_the_reference():
    rows = list(run_train(folder("llama-tied"), variant="full", budgets=("0.5", "0.25"), seq=16, steps=2, rank=2,
                          executors=("event-driven", "fixed-order")))
    assert [(r["budget_spec"], r["executor"]) for r in rows] == [
        ("0.5", "event-driven"), ("0.5", "fixed-order"), ("0.25", "event-driven"), ("0.25", "fixed-order")]
    for r in rows:
        assert r["max_abs_grad_err"] is not None and r["max_abs_grad_err"] < 1e-3
        assert r["step_s"] >= r["lower_bound_s"] * 0.999 and len(r["steps_s"]) == 2
        assert r["host_plan_bytes"] > 0 and r["peak_bytes"] <= r["budget"]
    assert rows[2]["reloaded_bytes"] > rows[0]["reloaded_bytes"]
    (q,) = run_train(folder("qwen2"), variant="lora", budgets=("0.3",), seq=16, steps=1, rank=2)
    assert q["max_abs_grad_err"] < 1e-3 and q["reloaded_bytes"] > 0  # the numpy reference adds the biases too


def test_qwen2_lora_keeps_its_biases_and_full_fine_tuning_is_refused():
    ck = load_model(folder("qwen2"))
    tg = build_train_step(train_config(ck, 4), "lora", rank=2)
    assert sum(v.op == "bias_add" for v in tg.graph.vertices) == 3 * ck.config.n_blocks
    with pytest.raises(CheckpointError, match="full fine-tuning of a qwen2 checkpoint is not supported"):
        next(run_train(folder("qwen2"), variant="full", seq=8, steps=1))


def test_training_on_two_gpus_is_refused():
    with pytest.raises(InvalidOptionError, match="--gpus 2"):
        next(run_train(folder("llama-tied"), seq=8, steps=1, n_gpus=2))
