"""On a real GPU only: the CUDA backend with its events and copies through the driver
(``VMSTOOLKIT_DRIVER_EVENTS=1``, exec/backends/driver_events.py) generates transformers' greedy
tokens and prefill logits on the tiny checkpoints, at the working set and at a quarter of it
(where weights and the KV cache are offloaded and reloaded by those copies).

    VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_driver_events_gpu.py -q
"""

import numpy as np
import pytest

from tests.exec.model.helpers import fixture, folder
from tests.gpu.test_real_gpu import _gpu

pytestmark = pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU and VMSTOOLKIT_REAL_GPU=1")


@pytest.mark.parametrize("name", ["llama-sharded", "qwen2"])
def test_generation_with_driver_events_equals_transformers(name, monkeypatch):
    from vmstoolkit.exec.model.generate import run_generate

    monkeypatch.setenv("VMSTOOLKIT_DRIVER_EVENTS", "1")
    fx = fixture(name)
    rows = list(run_generate(folder(name), prompt_ids=fx["prompt_ids"].tolist(), new_tokens=len(fx["tokens"]),
                             budgets=("1.0", "0.25"), backend="cuda", logits="all"))
    for r in rows:
        assert r["tokens"] == fx["tokens"].tolist(), r["budget_spec"]
        np.testing.assert_allclose(r["prefill_logits"], fx["prefill_logits"], atol=1e-4)
    assert rows[1]["reloaded_bytes"] > 0
