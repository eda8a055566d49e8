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


@pytest.mark.parametrize("name", TRAIN_NAMES)
@pytest.mark.parametrize("variant", ["lora", "full"])
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


def test_qwen2_training_is_refused_in_one_line():
    with pytest.raises(CheckpointError, match="training a qwen2 checkpoint is not supported: its q/k/v biases"):
        next(run_train(folder("qwen2"), seq=8, steps=1))


def test_training_on_two_gpus_is_refused():
    with pytest.raises(InvalidOptionError, match="--gpus 2"):
        next(run_train(folder("llama-tied"), seq=8, steps=1, n_gpus=2))
