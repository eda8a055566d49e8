"""A launch that fails inside a completion callback ends the run with that error (it was only
logged by asyncio as "Exception in callback", and the run went on: a silently ignored error)."""

import pytest

from tests.exec.helpers import tiny_llama
from vmstoolkit.exec.backends.sim import SimBackend
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.executor import execute


class LaunchFails(SimBackend):
    """The sim backend whose n-th launch raises (after some completions, so inside a callback)."""

    def __init__(self, fail_at: int, **kw):
        super().__init__(**kw)
        self.fail_at, self.launches = fail_at, 0

    def launch(self, *args):
        self.launches += 1
        if self.launches == self.fail_at:
            raise RuntimeError(f"launch {self.fail_at} failed")
        return super().launch(*args)


@pytest.mark.parametrize("executor", ["event-driven", "fixed-order"])
def test_a_failed_launch_ends_the_run_with_its_error(executor):
    g = tiny_llama(parts=1)
    mg = compile_memory_graph(g, int(working_set(g) * 0.5))
    n = len(mg.vertices)
    with pytest.raises(RuntimeError, match=f"launch {n // 2} failed"):
        execute(mg, LaunchFails(n // 2, seed=0), executor)
