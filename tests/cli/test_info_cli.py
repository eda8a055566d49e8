"""``vmstoolkit info`` and the real driver on a machine without a GPU: a clear message, no crash."""

import json

import pytest
from typer.testing import CliRunner

from vmstoolkit.cli import app
from vmstoolkit.errors import NoGPUError
from vmstoolkit.pools import make_driver

runner = CliRunner()


def _has_gpu() -> bool:
    try:
        make_driver("cuda").close()
        return True
    except NoGPUError:
        return False


HAS_GPU = _has_gpu()


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_info_without_gpu_says_so():
    res = runner.invoke(app, ["info", "--json"])
    assert res.exit_code == 0
    info = json.loads(res.stdout)
    assert info["gpu"] is False and info["driver"] == "sim" and info["reason"]
    res = runner.invoke(app, ["info"])
    assert "No usable CUDA GPU" in res.stdout and "simulated VMM driver will be used" in res.stdout


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_cuda_driver_without_gpu_is_a_clear_error(traces_dir):
    with pytest.raises(NoGPUError, match="use the simulated driver"):
        make_driver("cuda")
    res = runner.invoke(app, ["replay", "--device", "cuda", str(traces_dir / "llama-lora.caching.pickle.gz")])
    assert res.exit_code == 1 and "use the simulated driver" in res.output


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_info_with_gpu():
    res = runner.invoke(app, ["info", "--json"])
    info = json.loads(res.stdout)
    assert info["gpu"] and info["granularity"] > 0 and info["total_bytes"] > 0
