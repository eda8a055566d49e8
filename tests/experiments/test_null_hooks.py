"""The reference hooks' entry points, compiled against stand-ins for cuMemAllocAsync/cuMemFreeAsync."""

import sys
from pathlib import Path

import numpy as np
import pytest
from numba import carray, cfunc, types

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import null_hooks  # noqa: E402

from vmstoolkit.integrations.callbacks import roundtrips_from_native_thread  # noqa: E402
from vmstoolkit.integrations.native_torch import pointer_to  # noqa: E402
from vmstoolkit.integrations.torch import ALLOC_FN, FREE_FN  # noqa: E402

# what the stand-ins saw: [allocations, frees, last size, last freed pointer, next pointer, current context]
SEEN = np.zeros(6, np.uint64)
CTX = 77
_seen = SEEN.ctypes.data
ctypes_ptr = pointer_to(types.uint64)


@cfunc(types.int32(types.uint64))
def fake_set_ctx(ctx):
    s = carray(ctypes_ptr(_seen), 6)
    s[5] = ctx
    return 0


@cfunc(types.int32(types.CPointer(types.uint64), types.uint64, types.voidptr))
def fake_alloc(out, size, stream):
    s = carray(ctypes_ptr(_seen), 6)
    if s[5] != CTX:
        return 201  # CUDA_ERROR_INVALID_CONTEXT: this thread has none
    if size > 1 << 40:
        return 2  # CUDA_ERROR_OUT_OF_MEMORY
    s[0] += 1
    s[2] = size
    s[4] += 4096
    out[0] = s[4]
    return 0


@cfunc(types.int32(types.uint64, types.voidptr))
def fake_free(ptr, stream):
    s = carray(ctypes_ptr(_seen), 6)
    if s[5] != CTX:
        return 201
    s[1] += 1
    s[3] = ptr
    return 0


ERRORS = np.zeros(2, np.uint64)


@pytest.fixture(params=[False, True], ids=["no-gil", "gil"])
def hook(request):
    SEEN[:] = 0
    ERRORS[:] = 0
    alloc, free = null_hooks._compile(fake_alloc.address, fake_free.address, request.param,
                                      fake_set_ctx.address, CTX, ERRORS)
    return ALLOC_FN(alloc.address), FREE_FN(free.address), alloc, free


def test_requests_reach_the_pool_and_failures_give_null(hook):
    alloc, free, *_ = hook
    p = alloc(1000, 0, None)  # no context yet: set, then served
    assert p == 4096 and SEEN[0] == 1 and SEEN[2] == 1000 and SEEN[5] == CTX
    free(p, 1000, 0, None)
    assert SEEN[1] == 1 and SEEN[3] == 4096
    assert alloc(0, 0, None) is None and SEEN[0] == 1  # size 0: no call, null
    assert ERRORS[0] == 0
    assert alloc(1 << 41, 0, None) is None  # the pool's error: null, as PyTorch expects, and counted
    assert ERRORS[0] == 1 and ERRORS[1] == 2
    SEEN[5] = 0
    free(4096, 1000, 0, None)  # the free retries after setting the context too
    assert SEEN[1] == 2 and ERRORS[0] == 1
    free(None, 0, 0, None)
    assert SEEN[1] == 2  # null: no call


def test_native_thread_round_trips(hook):
    *_, alloc, free = hook
    ok, _ = roundtrips_from_native_thread(alloc.address, free.address, 512, 200)
    assert ok == 200 and SEEN[0] == 200 and SEEN[1] == 200
