"""Where replay jobs run: in this process, in local worker processes, or on a Dask cluster.

:func:`run_jobs` applies one picklable function to a list of jobs and returns the results in
job order, whatever order they finish in, so a table built from them does not depend on where
they ran:

- ``cluster=None`` (default): ``n_workers`` local processes (``concurrent.futures``), or this
  process when there is one worker or one job;
- ``cluster="local:N"``: a Dask ``LocalCluster`` of N single-threaded worker processes, started
  for the run and shut down after it;
- ``cluster="tcp://HOST:PORT"`` (or ``HOST:PORT``): a running Dask scheduler, whose workers may
  be on other machines. They need vmstoolkit installed and the snapshots at the same path (a
  shared filesystem); a missing file is reported with the worker's host name.

Why Dask rather than Ray (``docs/cluster.md``): pure Python wheels, about 25 MB with their
dependencies against about 200 MB; a local cluster is a class in the client process; joining a
cluster is a scheduler address, and starting one is two commands (``dask scheduler``, then
``dask worker ADDRESS`` on each node). Replays hold the GIL, so every worker runs one thread.
"""

from __future__ import annotations

import re
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Callable, TypeVar

from vmstoolkit.errors import ClusterError, VmsError  # noqa: F401 (ClusterError re-exported)

J = TypeVar("J")
R = TypeVar("R")

# How long joining a running scheduler may take before it is reported as unreachable.
CONNECT_TIMEOUT_S = 20
_LOCAL = re.compile(r"local:(\d+)")


def check_cluster_spec(spec: str) -> str:
    """Validate a ``--cluster`` value without connecting: ``local:N`` (N >= 1) or a scheduler
    address (``tcp://HOST:PORT``, ``tls://...``, or ``HOST:PORT``). Returns it stripped."""
    s = spec.strip()
    m = _LOCAL.fullmatch(s)
    if s.startswith("local"):
        if not m or int(m.group(1)) < 1:
            raise ClusterError(f"--cluster {spec!r}: a local cluster is local:N with N workers, N >= 1 (e.g. local:4)")
        return s
    if not re.fullmatch(r"([a-z]+://)?[^\s:/]+:\d+/?", s):
        raise ClusterError(f"--cluster {spec!r}: give local:N or a Dask scheduler address such as tcp://host:8786")
    return s


def _dask():
    try:
        import distributed
    except ImportError:
        raise ClusterError("--cluster needs Dask's distributed scheduler: pip install 'vmstoolkit[cluster]'") from None
    return distributed


def run_jobs(fn: Callable[[J], R], jobs: list[J], n_workers: int = 1, *, cluster: str | None = None,
             on_done: Callable[[J, R], Any] | None = None) -> list[R]:
    """``[fn(job) for job in jobs]``, run where ``cluster`` says (module docstring); ``on_done``
    is called in this process as each job finishes. A job's exception is raised here, the
    others are cancelled."""
    if cluster is not None:
        return _run_dask(fn, jobs, check_cluster_spec(cluster), on_done)
    results: list = [None] * len(jobs)
    if n_workers <= 1 or len(jobs) <= 1:
        for i, job in enumerate(jobs):
            results[i] = fn(job)
            if on_done:
                on_done(job, results[i])
        return results
    pool = ProcessPoolExecutor(max_workers=min(n_workers, len(jobs)), initializer=_quiet_on_interrupt)
    try:
        futures = {pool.submit(fn, job): i for i, job in enumerate(jobs)}
        for fut in as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            if on_done:
                on_done(jobs[i], results[i])
    except BaseException:  # Ctrl-C or a job's error: stop the rest now instead of waiting for them
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return results


def _quiet_on_interrupt() -> None:
    """In a worker: Ctrl-C (which the terminal sends to every process of the group) ends it at
    once and silently; the parent reports the interruption in one line."""
    import os
    import signal

    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))


def _run_dask(fn, jobs, spec: str, on_done) -> list:
    distributed = _dask()
    m = _LOCAL.fullmatch(spec)
    cluster = None
    try:
        if m:
            # processes, one thread each: replays are pure Python and hold the GIL
            cluster = distributed.LocalCluster(n_workers=int(m.group(1)), threads_per_worker=1, processes=True,
                                               dashboard_address=None)
            client = distributed.Client(cluster)
        else:
            try:
                client = distributed.Client(spec, timeout=CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as e:
                raise ClusterError(f"--cluster {spec}: no Dask scheduler answered within {CONNECT_TIMEOUT_S} s "
                                   f"({type(e).__name__}: {' '.join(str(e).split())})") from None
        with client:
            # pure=False: a job is run even if an equal one ran before (timings are measured)
            futures = [client.submit(fn, job, pure=False) for job in jobs]
            index = {f.key: i for i, f in enumerate(futures)}
            results: list = [None] * len(jobs)
            try:
                for fut in distributed.as_completed(futures):
                    i = index[fut.key]
                    results[i] = fut.result()  # re-raises a job's exception here
                    if on_done:
                        on_done(jobs[i], results[i])
            except BaseException:
                client.cancel(futures)
                raise
            return results
    finally:
        if cluster is not None:
            cluster.close()
