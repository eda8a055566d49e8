"""The causal-LM loss of a training step (``build_train_step(loss="lm")``: final norm, LM head,
softmax cross-entropy against the next token): its value equals transformers' ``loss`` and its
gradients torch.autograd's on the tiny checkpoints, through an offloading plan on the sim
backend; the cross-entropy kernel equals its reference in the CUDA simulator."""

import numpy as np
import pytest

from tests.exec.model.helpers import TRAIN_NAMES, fixture, folder, lm_fixture
from vmstoolkit.exec.backends.sim import SimBackend
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.errors import InvalidShapeError
from vmstoolkit.exec.executor import execute
from vmstoolkit.exec.graph import LlamaConfig
from vmstoolkit.exec.model import load_model
from vmstoolkit.exec.model.train import build_model_train_step, run_train, train_values
from vmstoolkit.exec.train_graph import build_train_step, grads_from_updates, lm_labels, lm_loss
from vmstoolkit.exec.train_reference import reference_loss, reference_train_step
from vmstoolkit.kernels.cross_entropy import cross_entropy_ref

CASES = [(n, v) for n in TRAIN_NAMES for v in ("lora", "full") if not (n == "qwen2" and v == "full")]


def step(name, variant, fraction):
    ck = load_model(folder(name))
    fx = fixture(name)
    ids = fx["prompt_ids"]
    tg = build_model_train_step(ck, len(ids), variant, rank=2)
    adapters = {k[len("lora."):]: v for k, v in fx.items() if k.startswith("lora.")}
    values = train_values(ck, tg, ids, adapters=adapters)
    mg = compile_memory_graph(tg.graph, int(working_set(tg.graph) * fraction))
    be = SimBackend(numerics=True, values=values, jitter=0.0)
    execute(mg, be, "event-driven")
    out = be.result()
    return tg, values, out, mg


@pytest.mark.parametrize("name,variant", CASES)
def test_lm_loss_and_gradients_equal_transformers(name, variant):
    tg, values, out, mg = step(name, variant, 0.4)
    assert mg.offloaded_bytes > 0 and mg.reloaded_bytes > 0
    want = lm_fixture(name)
    assert lm_loss(tg, out) == pytest.approx(float(want[f"loss.{variant}"]), rel=2e-6, abs=2e-6)
    got = grads_from_updates(tg, values, out)
    wg = {k[len(f"grad.{variant}."):]: v for k, v in want.items() if k.startswith(f"grad.{variant}.")}
    assert set(got) == set(wg)
    for k, w in wg.items():
        scale = max(1e-2, float(np.abs(w).max()))
        np.testing.assert_allclose(got[k], w, rtol=0, atol=2e-5 * scale, err_msg=k)


def test_the_float64_reference_is_the_same_loss():
    tg, values, out, _ = step("llama-sharded", "lora", 1.0)
    ref, _ = reference_train_step(tg, values)
    assert reference_loss(tg, values) == pytest.approx(float(lm_fixture("llama-sharded")["loss.lora"]), rel=1e-6)
    got = grads_from_updates(tg, values, out)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-5 * max(1e-2, float(np.abs(ref[k]).max())))


def test_labels_are_the_next_token_within_each_sequence():
    np.testing.assert_array_equal(lm_labels([5, 6, 7, 8, 9, 10], batch=2), [6, 7, -1, 9, 10, -1])
    loss_rows, d = cross_entropy_ref(np.zeros((3, 4), np.float32), np.array([1, -1, 2], np.int32))
    np.testing.assert_allclose(loss_rows, [np.log(4) / 2, 0, np.log(4) / 2], rtol=1e-6)
    np.testing.assert_array_equal(d[1], 0)  # an ignored row has no gradient
    np.testing.assert_allclose(d[0], [0.125, -0.375, 0.125, 0.125], rtol=1e-6)


def test_run_train_reports_transformers_loss():
    fx = fixture("mistral")
    (row,) = run_train(folder("mistral"), variant="full", budgets=("0.5",), seq=len(fx["prompt_ids"]), steps=1,
                       rank=2, token_ids=fx["prompt_ids"])
    assert row["loss"] == pytest.approx(float(lm_fixture("mistral")["loss.full"]), rel=2e-6)
    assert row["max_abs_grad_err"] < 1e-4 and row["loss_kind"] == "lm"
    (dot,) = run_train(folder("mistral"), variant="full", budgets=("0.5",), seq=8, steps=1, rank=2, loss="dot")
    assert dot["loss"] is None and dot["max_abs_grad_err"] < 1e-3


def test_lm_loss_needs_the_vocabulary():
    with pytest.raises(InvalidShapeError, match="vocab=None"):
        build_train_step(LlamaConfig(n_blocks=1, seq=4, hidden=16, heads=2, kv_heads=2, ffn=32), "lora", rank=2, loss="lm")


def test_cross_entropy_kernel_equals_its_reference_in_the_simulator():
    from numba import cuda

    from vmstoolkit.kernels.tasks import KERNEL_TASKS

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 37)) * 3).astype(np.float32)
    lab = np.array([3, 36, -1, 0, 12], np.int32)
    loss, d = cuda.device_array(5, np.float32), cuda.device_array((5, 37), np.float32)
    KERNEL_TASKS["cross_entropy"].launch(0, [cuda.to_device(x), cuda.to_device(lab)], [loss, d])
    want_loss, want_d = cross_entropy_ref(x, lab)
    np.testing.assert_allclose(loss.copy_to_host(), want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d.copy_to_host(), want_d, rtol=1e-5, atol=1e-7)
