"""The reference hooks' entry points, compiled against stand-ins for cuMemAllocAsync/cuMemFreeAsync."""

import sys
from pathlib import Path

import numpy as np
import pytest
from numba import carray, cfunc, types
from numba.core.extending import intrinsic

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import null_hooks  # noqa: E402

from vmstoolkit.integrations.callbacks import roundtrips_from_native_thread  # noqa: E402
from vmstoolkit.integrations.torch import ALLOC_FN, FREE_FN  # noqa: E402

# what the stand-ins saw: [allocations, frees, last size, last freed pointer, next pointer]
SEEN = np.zeros(5, np.uint64)
_seen = SEEN.ctypes.data


@intrinsic
def ctypes_ptr(typingctx, addr):
    sig = types.CPointer(types.uint64)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@cfunc(types.int32(types.CPointer(types.uint64), types.uint64, types.voidptr))
def fake_alloc(out, size, stream):
    s = carray(ctypes_ptr(_seen), 5)
    if size > 1 << 40:
        return 2  # CUDA_ERROR_OUT_OF_MEMORY
    s[0] += 1
    s[2] = size
    s[4] += 4096
    out[0] = s[4]
    return 0


@cfunc(types.int32(types.uint64, types.voidptr))
def fake_free(ptr, stream):
    s = carray(ctypes_ptr(_seen), 5)
    s[1] += 1
    s[3] = ptr
    return 0


@pytest.fixture(params=[False, True], ids=["no-gil", "gil"])
def hook(request):
    SEEN[:] = 0
    alloc, free = null_hooks._compile(fake_alloc.address, fake_free.address, take_gil=request.param)
    return ALLOC_FN(alloc.address), FREE_FN(free.address), alloc, free


def test_requests_reach_the_pool_and_failures_give_null(hook):
    alloc, free, *_ = hook
    p = alloc(1000, 0, None)
    assert p == 4096 and SEEN[0] == 1 and SEEN[2] == 1000
    free(p, 1000, 0, None)
    assert SEEN[1] == 1 and SEEN[3] == 4096
    assert alloc(0, 0, None) is None and SEEN[0] == 1  # size 0: no call, null
    assert alloc(1 << 41, 0, None) is None  # the pool's error: null, as PyTorch expects
    free(None, 0, 0, None)
    assert SEEN[1] == 1  # null: no call


def test_native_thread_round_trips(hook):
    *_, alloc, free = hook
    ok, _ = roundtrips_from_native_thread(alloc.address, free.address, 512, 200)
    assert ok == 200 and SEEN[0] == 200 and SEEN[1] == 200
