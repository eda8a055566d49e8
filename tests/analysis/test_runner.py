"""Replay jobs on a Dask cluster give the same results as local processes, byte for byte
(issue 16, "Sweeps past one machine"). Needs ``dask[distributed]`` (the ``cluster`` and ``test``
extras): CI runs these with a two-worker local cluster."""

from __future__ import annotations

import json

import pytest

from vmstoolkit.analysis import runner
from vmstoolkit.analysis.fragmentation import plan_jobs, run_jobs
from vmstoolkit.analysis.runner import ClusterError, check_cluster_spec
from vmstoolkit.errors import VmsError
from vmstoolkit.trace.bundled import bundled_trace_paths

TIMING = ("seconds", "events_per_second")  # wall time: the only fields allowed to differ


def canonical(results) -> str:
    """Every figure of every replay (timelines included), timings left out, as one string."""
    out = []
    for r in results:
        d = {k: v for k, v in r.as_dict().items() if k not in TIMING}
        out.append({**d, "timeline": r.timeline})
    return json.dumps(out, sort_keys=True, default=str)


@pytest.fixture(scope="module")
def bundled_jobs():
    """Both recorded runs of the smallest bundled workload (what costs is each worker process's
    start, not the replays: the local-process pool is checked in test_fragmentation_table)."""
    specs = [str(p) for mode in ("caching", "expandable") for p in bundled_trace_paths(mode) if "llama-full" in p.name]
    assert len(specs) == 2
    return plan_jobs(specs, ["pytorch-caching", "vms"], timeline_workload="llama-full")


@pytest.fixture(scope="module")
def local_results(bundled_jobs):
    return canonical(run_jobs(bundled_jobs, 1))


def test_two_worker_local_cluster_matches_one_process(bundled_jobs, local_results):
    done = []
    on_cluster = run_jobs(bundled_jobs, cluster="local:2", on_done=lambda j, r: done.append(j))
    assert sorted(map(repr, done)) == sorted(map(repr, bundled_jobs))  # each reported once
    assert [(r.trace, r.allocator) for r in on_cluster] == \
        [(j.spec.split("/")[-1].removesuffix(".pickle.gz"), j.allocator) for j in bundled_jobs]  # job order
    assert sum(r.timeline is not None for r in on_cluster) == 4  # both llama-full traces x 2
    assert canonical(on_cluster) == local_results


def test_joining_a_running_scheduler(bundled_jobs, local_results):
    distributed = pytest.importorskip("distributed")  # the test above fails loudly without it
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as c:
        on_cluster = run_jobs(bundled_jobs, cluster=c.scheduler_address)
    assert canonical(on_cluster) == local_results


def test_a_job_error_on_a_worker_reaches_the_caller(tmp_path):
    jobs = plan_jobs([str(tmp_path / "missing.pickle.gz")], ["vms"], timeline_workload=None)
    with pytest.raises(VmsError, match="missing.pickle.gz"):
        run_jobs(jobs, cluster="local:1")


@pytest.mark.parametrize("spec", ["local:0", "local:x", "local", "two", "tcp://host", "http://a b:1"])
def test_malformed_cluster_values(spec):
    with pytest.raises(ClusterError, match="--cluster"):
        check_cluster_spec(spec)


@pytest.mark.parametrize("spec", ["local:1", "local:16", "tcp://10.0.0.5:8786", "scheduler:8786", "tls://a.b:8786"])
def test_wellformed_cluster_values(spec):
    assert check_cluster_spec(spec) == spec


def test_an_unreachable_scheduler_is_one_line(monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(runner, "CONNECT_TIMEOUT_S", 2)
    jobs = plan_jobs(["synthetic:zero"], ["native"], timeline_workload=None)
    with pytest.raises(ClusterError, match=f"127.0.0.1:{port}") as e:
        run_jobs(jobs, cluster=f"tcp://127.0.0.1:{port}")
    assert "\n" not in str(e.value)


def test_without_dask_the_error_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_dask(name, *a, **kw):
        if name.split(".")[0] in ("distributed", "dask"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_dask)
    with pytest.raises(ClusterError, match=r"vmstoolkit\[cluster\]"):
        run_jobs(plan_jobs(["synthetic:zero"], ["native"], None), cluster="local:2")
