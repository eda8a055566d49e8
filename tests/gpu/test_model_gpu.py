"""On a real GPU only (skipped elsewhere): the tiny checkpoints through the CUDA backend.

    VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_model_gpu.py -q

Greedy tokens equal transformers' (the fixtures, made on the CPU) and prefill logits equal its
logits, at the working set and at a quarter of it (weights and the KV cache moving), on one GPU
and, where the machine has two, on two, and with the backend's events and copies through the
driver (``VMSTOOLKIT_DRIVER_EVENTS=1``); the training step's gradients equal torch.autograd's.
"""

import numpy as np
import pytest

from tests.exec.model.helpers import NAMES, fixture, folder
from tests.gpu.test_real_gpu import _gpu

pytestmark = pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU and VMSTOOLKIT_REAL_GPU=1")


def _generation_equals_transformers(name):
    from vmstoolkit.exec.model.generate import run_generate

    fx = fixture(name)
    rows = list(run_generate(folder(name), prompt_ids=fx["prompt_ids"].tolist(), new_tokens=len(fx["tokens"]),
                             budgets=("1.0", "0.25"), backend="cuda", logits="all"))
    for r in rows:
        assert r["tokens"] == fx["tokens"].tolist(), r["budget_spec"]
        np.testing.assert_allclose(r["prefill_logits"], fx["prefill_logits"], atol=1e-4)
        assert r["prefill_s"] > 0 and r["decode_s"] > 0
    assert rows[1]["reloaded_bytes"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_generation_on_the_gpu_equals_transformers(name):
    _generation_equals_transformers(name)


@pytest.mark.parametrize("name", ["llama-sharded", "qwen2"])
def test_generation_with_driver_events_equals_transformers(name, monkeypatch):
    """The backend's events and copies through the driver (``VMSTOOLKIT_DRIVER_EVENTS=1``,
    exec/backends/driver_events.py): the same tokens and logits, at a quarter of the working set
    too, where weights and the KV cache move by those copies."""
    monkeypatch.setenv("VMSTOOLKIT_DRIVER_EVENTS", "1")
    _generation_equals_transformers(name)


def test_generation_on_two_gpus():
    from numba import cuda

    from vmstoolkit.exec.model.generate import run_generate

    if len(cuda.gpus) < 2:
        pytest.skip("one GPU")
    fx = fixture("qwen2")
    (r,) = run_generate(folder("qwen2"), prompt_ids=fx["prompt_ids"].tolist(), new_tokens=len(fx["tokens"]),
                        budgets=("0.5",), backend="cuda", n_gpus=2)
    assert r["tokens"] == fx["tokens"].tolist()


@pytest.mark.parametrize("variant", ["lora", "full"])
def test_training_gradients_on_the_gpu_equal_torch_autograd(variant):
    from vmstoolkit.exec.backends.cuda import CudaBackend
    from vmstoolkit.exec.compiler import compile_memory_graph, working_set
    from vmstoolkit.exec.executor import execute
    from vmstoolkit.exec.model import load_model
    from vmstoolkit.exec.model.train import train_config, train_values
    from vmstoolkit.exec.train_graph import build_train_step, grads_from_updates

    name = "llama-sharded"
    ck, fx = load_model(folder(name)), fixture(name)
    tg = build_train_step(train_config(ck, len(fx["prompt_ids"])), variant, rank=2)
    adapters = {k[len("lora."):]: v for k, v in fx.items() if k.startswith("lora.")}
    values = train_values(ck, tg, fx["prompt_ids"], dout=fx["train_dout"], adapters=adapters, copy=True)
    mg = compile_memory_graph(tg.graph, working_set(tg.graph) // 3)
    be = CudaBackend(values)
    try:
        execute(mg, be)
        got = grads_from_updates(tg, values, be.result())
    finally:
        be.close()
    for k, v in fx.items():
        if k.startswith(f"grad.{variant}."):
            np.testing.assert_allclose(got[k[len(f"grad.{variant}."):]], v, atol=1e-4 * max(1.0, float(np.abs(v).max())))


@pytest.mark.parametrize("variant", ["lora", "full"])
def test_lm_loss_and_gradients_on_the_gpu_equal_transformers(variant):
    """The causal-LM loss (final norm, LM head, the cross_entropy kernel) through the CUDA backend
    under an offloading plan: transformers' loss and torch.autograd's gradients (fixture_lm.npz)."""
    from tests.exec.model.helpers import lm_fixture
    from vmstoolkit.exec.backends.cuda import CudaBackend
    from vmstoolkit.exec.compiler import compile_memory_graph, working_set
    from vmstoolkit.exec.executor import execute
    from vmstoolkit.exec.model import load_model
    from vmstoolkit.exec.model.train import build_model_train_step, train_values
    from vmstoolkit.exec.train_graph import grads_from_updates, lm_loss

    name = "mistral"
    ck, fx, want = load_model(folder(name)), fixture(name), lm_fixture(name)
    tg = build_model_train_step(ck, len(fx["prompt_ids"]), variant, rank=2)
    adapters = {k[len("lora."):]: v for k, v in fx.items() if k.startswith("lora.")}
    values = train_values(ck, tg, fx["prompt_ids"], adapters=adapters, copy=True)
    mg = compile_memory_graph(tg.graph, int(working_set(tg.graph) * 0.4))
    assert mg.reloaded_bytes > 0
    be = CudaBackend(values)
    try:
        execute(mg, be)
        out = be.result()
    finally:
        be.close()
    assert lm_loss(tg, out) == pytest.approx(float(want[f"loss.{variant}"]), rel=1e-5, abs=1e-5)
    got = grads_from_updates(tg, values, out)
    for k, w in want.items():
        if k.startswith(f"grad.{variant}."):
            scale = max(1e-2, float(np.abs(w).max()))
            np.testing.assert_allclose(got[k[len(f"grad.{variant}."):]], w, rtol=0, atol=1e-4 * scale, err_msg=k)
