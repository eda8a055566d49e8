"""On a real GPU only (skipped elsewhere): ``CudaBackend(timeline=True)`` times what the GPU ran.

    VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_timeline_gpu.py -q

Each vertex gets a span on its stream; a stream runs one thing at a time, so its spans do not
overlap; they fit in the run's host-measured makespan; the outputs equal a run without the
timeline. (The CPU twin, ``tests/exec/test_timeline.py``, checks the bookkeeping with fake events.)
"""

import numpy as np
import pytest

from tests.exec.helpers import weighted_chain
from tests.gpu.test_real_gpu import _gpu

pytestmark = pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU and VMSTOOLKIT_REAL_GPU=1")


def test_timeline_spans_are_the_gpus_schedule():
    from vmstoolkit.exec.backends.cuda import CudaBackend
    from vmstoolkit.exec.compiler import compile_memory_graph, working_set
    from vmstoolkit.exec.executor import execute
    from vmstoolkit.exec.graph import random_weights

    g = weighted_chain(8, (2048, 4096))  # 32 MiB weights: copies of ~1 ms, visible on the timeline
    values = random_weights(g, 0)
    mg = compile_memory_graph(g, working_set(g) // 2)
    assert mg.offloaded_bytes > 0 and mg.reloaded_bytes > 0
    outs = []
    for timeline in (False, True):
        be = CudaBackend(values, timeline=timeline)
        try:
            res = execute(mg, be)
            outs.append(be.result())
            spans = be.spans
        finally:
            be.close()
    assert sorted(s[0] for s in spans) == [v.id for v in mg.vertices]
    assert min(s[3] for s in spans) == 0.0 and max(s[4] for s in spans) <= res.makespan_s * 1.05 + 1e-3
    for stream in ("compute", "h2d", "d2h"):
        on = sorted((a, b) for _, _, st, a, b in spans if st == stream)
        assert all(b >= a for a, b in on)
        assert all(nxt[0] >= cur[1] - 1e-6 for cur, nxt in zip(on, on[1:])), f"{stream} spans overlap"
    copies = [b - a for vid, _, st, a, b in spans if st != "compute"]
    assert min(copies) > 1e-4  # a 32 MiB copy takes about 0.6 ms at ~55 GB/s, not nothing
    for t in outs[0]:
        np.testing.assert_array_equal(outs[1][t], outs[0][t])
