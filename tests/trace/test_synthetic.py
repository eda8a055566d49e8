"""The synthetic workload generator: seeded, typed, unique addresses, balanced, marked synthetic."""

from __future__ import annotations

import pytest

from vmstoolkit.errors import ConfigError
from vmstoolkit.pools import make_allocator
from vmstoolkit.trace import Action, replay
from vmstoolkit.trace.synthetic import KINDS, SyntheticConfig, parse_synthetic_spec, synthetic_trace


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_a_valid_replayable_trace(kind):
    t = synthetic_trace(kind, seed=1, steps=3)
    assert t.name == f"synthetic-{kind}-seed1" and t.source == "synthetic" and t.allocator_settings["synthetic"]
    live: dict[int, int] = {}
    for e in t.events:
        assert isinstance(e.action, Action) and e.size > 0 and e.stream == 0
        if e.action is Action.ALLOC:
            assert e.addr not in live
            live[e.addr] = e.size
        else:
            assert live.pop(e.addr) == e.size  # frees name a live allocation, with its size
    addrs = [e.addr for e in t.events if e.action is Action.ALLOC]
    assert len(addrs) == len(set(addrs)), "addresses are never reused"
    r = replay(t, make_allocator("pytorch-caching"))
    assert not r.oom and r.unmatched_frees == 0 and r.peak_allocated > 0


def test_seeded_and_deterministic():
    assert synthetic_trace("full", seed=3).events == synthetic_trace("full", seed=3).events
    assert synthetic_trace("full", seed=3).events != synthetic_trace("full", seed=4).events


def test_patterns_differ_as_described():
    c = SyntheticConfig(steps=2)
    peak = {k: replay(synthetic_trace(k, 0, config=c), make_allocator("pytorch-expandable")).peak_allocated
            for k in ("full", "recompute", "offload", "zero")}
    # recomputation, offload and ZeRO sharding all hold less than plain training
    assert peak["recompute"] < peak["full"] and peak["offload"] < peak["full"] and peak["zero"] < peak["full"]


def test_seqgrow_grows():
    t = synthetic_trace("seqgrow", 0, steps=3)
    biggest = max(e.size for e in t.events if e.action is Action.ALLOC and e.size < 10**10)
    t2 = synthetic_trace("seqgrow", 0, steps=5)
    assert max(e.size for e in t2.events if e.action is Action.ALLOC) > biggest


def test_specs_and_errors():
    assert parse_synthetic_spec("synthetic:lora") == ("lora", 0)
    assert parse_synthetic_spec("synthetic:zero:7") == ("zero", 7)
    with pytest.raises(ConfigError, match="'nope'"):
        parse_synthetic_spec("synthetic:nope")
    with pytest.raises(ConfigError, match="'x'"):
        parse_synthetic_spec("synthetic:zero:x")
    with pytest.raises(ConfigError, match="unknown synthetic workload"):
        synthetic_trace("nope")
