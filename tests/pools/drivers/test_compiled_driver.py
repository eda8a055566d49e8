"""The compiled simulated driver against the Python reference: random programs (hypothesis),
faults included; every call's result or error, and the final state, must be the same."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmstoolkit.errors import VmsError
from vmstoolkit.pools import make_allocator, make_driver
from vmstoolkit.pools.drivers.base import OPERATIONS
from vmstoolkit.pools.drivers.compiled import CompiledSimulatedDriver
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.units import MiB

G = 2 * MiB
CAP = 64 * MiB


def _outcome(f, *args):
    try:
        return ("ok", f(*args))
    except VmsError as e:
        return (type(e).__name__, str(e))


def _state(d):
    handles = sorted(d.live_handles())
    return {
        "handles": handles, "aliases": [d.aliases(h) for h in range(0, 40)],
        "reservations": d.live_reservations(), "mappings": d.live_mappings(), "allocs": d.live_allocs(),
        "physical": (d.physical_bytes, d.peak_physical_bytes), "calls": dict(d.calls), "info": d.mem_info(),
        "empty": d.is_empty(), "leaks": d.leak_report(), "races": list(d.races), "syncs": d.syncs,
    }


@st.composite
def programs(draw):
    """A list of (op, args) over small address and handle pools, so calls often hit real objects."""
    n = draw(st.integers(1, 60))
    # a prologue of ranges and handles, so that most maps can succeed
    ops = [("reserve", (16 * G, 0)), ("reserve", (8 * G, 0))]
    ops += [("create", (draw(st.sampled_from([G, G, 2 * G, 4 * G])),)) for _ in range(draw(st.integers(0, 6)))]
    # biased to calls that succeed, so that later calls meet mappings, aliases and released handles
    sizes = st.sampled_from([G] * 8 + [2 * G] * 3 + [4 * G, 3 * G, G // 2, 0, -G, 8 * G])
    slots = st.sampled_from([0] * 4 + [1, 1, 2, 3, 5, 9])  # offsets in granules from a reservation start
    handles = st.sampled_from([1, 2, 3, 1, 2, 3, 4, 5, 6, 0, -1, 12])
    for _ in range(n):
        op = draw(st.sampled_from(["create", "create", "reserve", "map", "map", "map", "release", "free_address",
                                   "unmap", "unmap", "set_access", "memset", "memset", "mem_alloc", "mem_free",
                                   "fault", "enqueue", "sync", "event", "create_mapped", "map_many"]))
        if op == "create":
            ops.append((op, (draw(sizes),)))
        elif op == "release":
            ops.append((op, (draw(handles),)))
        elif op == "reserve":
            ops.append((op, (draw(sizes), draw(st.sampled_from([0, G, 4 * G])))))
        elif op in ("free_address", "unmap", "set_access", "memset"):
            ops.append((op, (draw(st.integers(0, 3)), draw(slots), draw(sizes))))
        elif op == "map":
            ops.append((op, (draw(st.integers(0, 3)), draw(slots), draw(sizes), draw(handles),
                             draw(st.sampled_from([0, 0, 0, G, 2 * G, 3])))))
        elif op == "create_mapped":  # sizes and counts that fit, overlap, overflow the range or the device
            ops.append((op, (draw(st.integers(0, 3)), draw(slots), draw(sizes), draw(st.sampled_from([1, 2, 3, 5, 0, 40])))))
        elif op == "map_many":
            ops.append((op, (draw(st.integers(0, 3)), draw(slots), draw(sizes), draw(st.lists(handles, max_size=5)))))
        elif op == "mem_alloc":
            ops.append((op, (draw(st.sampled_from([512, 4096, 3 * MiB, CAP, 1])),)))
        elif op == "mem_free":
            ops.append((op, (draw(st.integers(-1, 5)),)))
        elif op == "fault":
            ops.append((op, (draw(st.sampled_from(OPERATIONS)), draw(st.integers(1, 8)),
                             draw(st.sampled_from([None, "CUDA_ERROR_UNKNOWN", "CUDA_ERROR_OUT_OF_MEMORY"])))))
        elif op == "enqueue":
            ops.append((op, (draw(st.integers(0, 5)), draw(slots), draw(st.sampled_from([G, 4096])),
                             draw(st.integers(0, 2)))))
        elif op == "event":
            ops.append((op, (draw(st.integers(0, 2)), draw(st.integers(0, 2)))))
        else:
            ops.append((op, (draw(st.booleans()),)))
    return ops


class _Undos:
    """What a transaction is told to undo, in order (the batched calls register their steps)."""

    def __init__(self) -> None:
        self.steps = []

    def undo(self, op, a, b):
        self.steps.append((op, a, b))

    def undo_steps(self, steps):
        self.steps.extend(steps)


def _batched(f, *args):
    tx = _Undos()
    return _outcome(f, *args, tx), tx.steps


def _run(d, program):
    """Run ``program`` on ``d``; addresses are picked from what this driver returned so far (the
    same in both drivers while they agree)."""
    ranges, ptrs, out = [], [], []

    def va(k, slot):
        return (ranges[k % len(ranges)] if ranges else 0x7F00_0000_0000) + slot * G

    for op, a in program:
        if op == "create":
            r = _outcome(d.create, *a)
        elif op == "release":
            r = _outcome(d.release, *a)
        elif op == "reserve":
            r = _outcome(d.reserve, *a)
            if r[0] == "ok":
                ranges.append(r[1])
        elif op == "free_address":
            r = _outcome(d.free_address, va(a[0], a[1]), a[2])
        elif op == "map":
            r = _outcome(d.map, va(a[0], a[1]), a[2], a[3], a[4])
        elif op in ("unmap", "set_access", "memset"):
            r = _outcome(getattr(d, op), va(a[0], a[1]), a[2])
        elif op == "create_mapped":
            r = _batched(d.create_mapped, va(a[0], a[1]), a[2], a[3])
        elif op == "map_many":
            r = _batched(d.map_many, va(a[0], a[1]), a[2], a[3])
        elif op == "mem_alloc":
            r = _outcome(d.mem_alloc, *a)
            if r[0] == "ok":
                ptrs.append(r[1])
        elif op == "mem_free":
            r = _outcome(d.mem_free, ptrs[a[0] % len(ptrs)] + (a[0] < 0) if ptrs else 12345)
        elif op == "fault":
            r = _outcome(d.fail_on, *a)
        elif op == "enqueue":
            r = _outcome(d.enqueue_use, va(a[0], a[1]), a[2], a[3])
        elif op == "event":
            ev = d.record_event(a[0])
            d.stream_wait(a[1], ev)
            r = ("ok", d.event_done(ev))
        else:
            r = _outcome(d.synchronize if a[0] else d.finish)
        out.append((op, r))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs())
def test_random_programs_give_the_same_results_and_state(program):
    ref, fast = SimulatedDriver(capacity=CAP), CompiledSimulatedDriver(capacity=CAP)
    assert _run(fast, program) == _run(ref, program)
    assert _state(fast) == _state(ref)


def test_batched_calls_count_fail_and_undo_as_the_calls_they_stand_for():
    """create_mapped / map_many on the compiled driver (one compiled loop), by hand: a fault
    inside the batch, the device filling up in the middle, a map that overlaps; the reference
    driver runs them call by call."""
    program = [("reserve", (16 * G, 0)), ("create_mapped", (0, 0, G, 3)), ("fault", ("create", 5, None)),
               ("create_mapped", (0, 3, G, 3)), ("create_mapped", (0, 8, G, 2)), ("fault", ("map", 9, None)),
               ("map_many", (0, 10, G, [1, 2, 3])), ("map_many", (0, 12, G, [1, 2])), ("map_many", (0, 1, G, [4])),
               ("create_mapped", (0, 13, 2 * G, 40)), ("create_mapped", (0, 14, G // 2, 1)), ("map_many", (0, 14, G, [99])),
               ("reserve", (64 * G, 0)), ("create_mapped", (1, 0, G, 40))]  # the device fills up inside the batch
    ref, fast = SimulatedDriver(capacity=CAP), CompiledSimulatedDriver(capacity=CAP)
    got, want = _run(fast, program), _run(ref, program)
    assert got == want
    errors = [r[0][1] for op, r in want if op in ("create_mapped", "map_many") and r[0][0] != "ok"]
    assert len(errors) == 7 and any("injected fault" in e for e in errors) and any("OUT_OF_MEMORY" in e for e in errors)
    assert _state(fast) == _state(ref)


def test_tables_grow(tmp_path):
    ref, fast = SimulatedDriver(), CompiledSimulatedDriver()
    for d in (ref, fast):
        va = d.reserve(3000 * G)
        for i in range(3000):  # more than every table's first size
            h = d.create(G)
            d.map(va + (2999 - i) * G, G, h)  # inserted before every other mapping
            d.mem_alloc(4096)
        d.reserve(G) and [d.reserve(G) for _ in range(300)]
    assert _state(fast) == _state(ref)


def test_the_mappings_gap_moves_under_random_maps_and_unmaps():
    """The mappings' table is a gap buffer: maps, unmaps (single and multi-page), access, memset
    and reads at random places, the table growing in between, agree with the reference call by call."""
    import random

    ref, fast = SimulatedDriver(capacity=8192 * G), CompiledSimulatedDriver(capacity=8192 * G)
    out = {id(ref): [], id(fast): []}
    for d in (ref, fast):
        r = random.Random(7)
        va = d.reserve(2400 * G)
        hs = [d.create(G) for _ in range(2400)]
        mapped = set()
        log = out[id(d)]
        for _ in range(6000):
            p = r.randrange(2400)
            k = r.choice([1, 1, 1, 2, 3])
            if p in mapped:
                log.append(_outcome(d.unmap, va + p * G, k * G))  # several pages: fails unless all mapped
                if log[-1][0] == "ok":
                    mapped -= set(range(p, p + k))
            else:
                log.append(_outcome(d.map, va + p * G, G, hs[p]))
                mapped.add(p)
                log.append(_outcome(d.set_access, va + p * G, G))
            q = r.randrange(2400)
            log.append(_outcome(d.memset, va + q * G, r.choice([1, 2]) * G))
            if r.random() < 0.01:
                log.append(sorted(d.live_mappings().items()))
    assert out[id(ref)] == out[id(fast)]
    assert _state(fast) == _state(ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_calls_among_many_mappings_agree_with_the_reference(seed):
    """create_mapped / map_many at random places of two large ranges among thousands of mappings,
    with unmaps in between (the gap moves): batches that fit (one range, no overlap: the compiled
    loop checks the addresses once) and batches that overlap a mapping or leave their range (call
    by call), each with the same results, undos and state as the reference driver's calls."""
    import random

    r = random.Random(seed)
    program = [("reserve", (2048 * G, 0)), ("reserve", (512 * G, 0))]
    for _ in range(300):
        op = r.choice(["create_mapped", "create_mapped", "map_many", "unmap", "unmap", "set_access"])
        k, slot = r.randrange(2), r.randrange(2100)
        if op == "create_mapped":
            program.append((op, (k, slot, G, r.choice([1, 3, 8, 40]))))
        elif op == "map_many":
            program.append((op, (k, slot, G, [r.randrange(1, 600) for _ in range(r.choice([1, 4, 12]))])))
        elif op == "unmap":
            program.append((op, (k, slot, r.choice([1, 1, 3]) * G)))
        else:
            program.append((op, (k, slot, 8 * G)))
    ref, fast = SimulatedDriver(capacity=4096 * G), CompiledSimulatedDriver(capacity=4096 * G)
    got, want = _run(fast, program), _run(ref, program)
    assert got == want
    outcomes = {(op, r[0][0] == "ok") for op, r in want if op in ("create_mapped", "map_many")}
    assert outcomes == {("create_mapped", True), ("create_mapped", False), ("map_many", True), ("map_many", False)}
    assert _state(fast) == _state(ref)


def test_a_rolled_back_batch_undoes_what_the_calls_one_by_one_would():
    """The compiled driver registers a batch's undos as one StepRun, read only on rollback: a
    failure after the batch (set_access) rolls back to the same driver state as the reference's
    undos registered call by call."""
    from vmstoolkit.pools.drivers.teardown import Graveyard
    from vmstoolkit.pools.drivers.txn import StepRun, Transaction

    assert list(StepRun(0, G, [7, 8, 9], 2)) == [("release", 7, G), ("unmap", 0, G), ("release", 8, G),
                                                 ("unmap", G, G), ("release", 9, G)]
    assert list(StepRun(4 * G, G, None, 2)) == [("unmap", 4 * G, G), ("unmap", 5 * G, G)] and len(StepRun(0, G, [1], 1)) == 2
    states = []
    for d in (SimulatedDriver(capacity=CAP), CompiledSimulatedDriver(capacity=CAP)):
        keep = d.create(G)
        d.fail_on("set_access", 1)
        with pytest.raises(VmsError, match="injected fault"):
            with Transaction(Graveyard(d)) as tx:
                va = d.reserve(8 * G)
                tx.undo("free_address", va, 8 * G)
                d.create_mapped(va, G, 3, tx)
                d.map_many(va + 3 * G, G, [keep, keep], tx)
                d.set_access(va, 5 * G)
        d.release(keep)
        assert d.is_empty(), d.leak_report()
        states.append(_state(d))
    assert states[0] == states[1]


@pytest.mark.parametrize("name", ["vms", "paged", "pytorch-expandable", "gmlake", "native", "pytorch-caching"])
def test_allocators_on_both_drivers_agree(name, traces_dir, bundled_trace):
    from vmstoolkit.trace import replay

    trace = bundled_trace(traces_dir / "llama-lora.caching.pickle.gz")
    results = []
    for d in (SimulatedDriver(), CompiledSimulatedDriver()):
        a = make_allocator(name, d)
        r = replay(trace, a, compiled=False)
        results.append((r.peak_reserved, r.peak_allocated, dict(r.driver_calls), r.oom, d.peak_physical_bytes))
        a.close()
        assert d.is_empty(), d.leak_report()
    assert results[0] == results[1]


def test_make_driver_gives_the_compiled_driver_and_the_reference_on_request():
    assert type(make_driver("sim")) is CompiledSimulatedDriver
    assert type(make_driver("sim-reference")) is SimulatedDriver


def test_holes_and_partial_unmaps_by_hand():
    """The rare layouts random programs seldom build: a hole inside a range whose mapped sizes add
    up, a partial unmap, a map over a released handle, access on half a range."""
    program = [("reserve", (8 * G, 0)), ("create", (G,)), ("create", (2 * G,)), ("create", (4 * G,)),
               ("map", (0, 0, G, 1, 0)), ("map", (0, 2, 2 * G, 2, 0)),
               ("unmap", (0, 0, 3 * G)), ("unmap", (0, 0, 2 * G)), ("set_access", (0, 0, 4 * G)),
               ("set_access", (0, 2, 2 * G)), ("memset", (0, 2, G)), ("memset", (0, 0, G)),
               ("release", (2,)), ("map", (0, 5, G, 2, 0)), ("unmap", (0, 2, 2 * G)), ("release", (2,)),
               ("map", (0, 4, 4 * G, 3, 0)), ("free_address", (0, 0, 8 * G)), ("unmap", (0, 4, 4 * G)),
               ("unmap", (0, 0, G)), ("release", (1,)), ("release", (3,)), ("free_address", (0, 0, 8 * G))]
    ref, fast = SimulatedDriver(capacity=CAP), CompiledSimulatedDriver(capacity=CAP)
    got, want = _run(fast, program), _run(ref, program)
    assert got == want
    assert any("spans a hole" in str(r[1]) for _, r in want) and any("without access" in str(r[1]) for _, r in want)
    assert _state(fast) == _state(ref) and fast.is_empty()
