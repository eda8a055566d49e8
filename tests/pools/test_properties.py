"""Seeded property tests: random allocate/free sequences keep every pool invariant."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmstoolkit.errors import OutOfMemoryError
from vmstoolkit.pools import make_allocator
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.units import MiB

G = 2 * MiB
CAPACITY = 48 * G

sizes = st.one_of(
    st.integers(1, MiB),  # small pool
    st.integers(MiB + 1, 6 * G),
    st.integers(6 * G, 20 * G),
)
ops = st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 10**6)), min_size=1, max_size=80)


def _run(name: str, program) -> None:
    a = make_allocator(name, SimulatedDriver(capacity=CAPACITY))
    live: list[int] = []
    for is_alloc, size, pick in program:
        if is_alloc or not live:
            try:
                p = a.allocate(size)
            except OutOfMemoryError:
                # OOM only when memory truly lacks: the chunks live blocks hold and this request's
                # (native: each block its own chunks; vms and gmlake: large blocks' chunks, the
                # small pool's segments, and one chunk for a small request).
                held = a.live_allocations().values()
                if name == "native":
                    used, need = sum(-(-s // G) for s in held), -(-size // G)
                else:
                    used = sum(-(-s // G) for s in held if s > MiB) + len(a.small.segments)
                    need = -(-size // G) if size > MiB else 1
                assert (used + need) * G > CAPACITY, f"{name} OOM with memory to spare: {used} + {need} chunks"
            else:
                live.append(p)
                a.driver.memset(p, size)  # fully mapped and accessible
        else:
            a.free(live.pop(pick % len(live)))
        a._check()
    a.close()
    assert a.driver.is_empty(), a.driver.leak_report()


@pytest.mark.parametrize("name", ["vms", "gmlake", "native"])
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(program=ops)
def test_random_programs_keep_invariants(name, program):
    _run(name, program)
