"""A backend whose completions arrive on their own (CUDA events polled, host callbacks) runs to
the end: its ``drive`` waits for the run instead of returning at once.

Found on the H200: every run of the CUDA backend ended with "the backend's drive loop ended with
2461 of 2466 vertices unfinished", since the executor treats a drive loop that returns early as
a failed backend (the simulated backend's loop fails that way when nothing is in flight).
"""

import asyncio

import pytest

from tests.exec.helpers import tiny_llama
from vmstoolkit.exec.backends.cuda import CudaBackend
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.executor import execute


class EventBackend:
    """Completions come from the event loop a little later, as CUDA events polled would."""

    drive = CudaBackend.drive  # the code under test: the real backend's drive loop

    def setup(self, mg) -> None:
        self.launched = 0

    def clock(self) -> float:
        return asyncio.get_running_loop().time()

    def launch(self, v):
        self.launched += 1
        fut = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(1e-4, lambda: fut.done() or fut.set_result(None))
        return fut

    def completion(self, token):
        return token

    def result(self):
        return {}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("executor", ["event-driven", "fixed-order"])
def test_a_backend_with_asynchronous_completions_runs_every_vertex(executor):
    g = tiny_llama(parts=1)
    mg = compile_memory_graph(g, int(working_set(g) * 0.5))
    be = EventBackend()
    r = execute(mg, be, executor)
    assert len(r.finish_order) == len(mg.vertices) == be.launched


def test_the_cuda_backends_drive_loop_waits_for_the_run_and_never_raises():
    async def main():
        done = asyncio.get_running_loop().create_future()
        drive = asyncio.ensure_future(CudaBackend({}).drive(done))
        await asyncio.sleep(0.01)
        assert not drive.done()
        done.set_exception(RuntimeError("a kernel failed"))  # the executor reports it, not drive
        await drive

    asyncio.run(main())
