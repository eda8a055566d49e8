"""CUDA graph private pools on the simulated driver, with PyTorch's semantics: a capture's
allocations come from its pool; memory freed inside the pool serves only that pool until it is
released; pools can be shared; released pools give their memory back."""

import pytest

from vmstoolkit.errors import ConfigError, InvalidFreeError
from vmstoolkit.pools import make_allocator, make_driver
from vmstoolkit.pools.graph_pools import REUSE_SLACK, PrivatePools
from vmstoolkit.units import GiB, MiB

G1, G2 = (1, 0), (2, 0)


@pytest.fixture(params=["vms", "paged", "pytorch-caching"])
def upstream(request):
    a = make_allocator(request.param, make_driver("sim", capacity=1 * GiB))
    yield a
    a.close()


def test_a_block_freed_inside_a_pool_is_reused_by_that_pool_only(upstream):
    pools = PrivatePools(upstream)
    pools.use(G1)
    x = pools.allocate(G1, 8 * MiB, 0)
    pools.free(x)  # freed inside the capture: still the pool's
    assert x in upstream.live_allocations(), "the upstream allocator must not get the block back"
    eager = upstream.allocate(8 * MiB, 0)  # an eager tensor between replays
    assert eager != x
    assert pools.allocate(G1, 8 * MiB, 0) == x  # the pool's next request of that size reuses it
    pools._check()
    upstream.free(eager)


def test_a_pools_freed_block_serves_its_own_stream_only(upstream):
    """PyTorch's pools key cached blocks by stream: a block freed inside a pool may still be read
    by work queued on its stream, so another stream's request must not get it (nothing orders the
    two streams); the same stream's request does."""
    pools = PrivatePools(upstream)
    pools.use(G1)
    s1, s2 = 7, 9
    x = pools.allocate(G1, 8 * MiB, s1)
    pools.free(x)
    y = pools.allocate(G1, 8 * MiB, s2)
    assert y != x, "a block cached from stream 7 was handed to stream 9"
    assert pools.allocate(G1, 8 * MiB, s1) == x
    pools.free(y)
    assert pools.allocate(G1, 8 * MiB, s2) == y  # and stream 9's block serves stream 9 again
    pools._check()


def test_another_pool_never_gets_a_pools_freed_block(upstream):
    pools = PrivatePools(upstream)
    pools.use(G1)
    pools.use(G2)
    x = pools.allocate(G1, 4 * MiB, 0)
    pools.free(x)
    y = pools.allocate(G2, 4 * MiB, 0)
    assert y != x and pools.owner(x) == G1 and pools.owner(y) == G2
    pools._check()


def test_a_shared_pool_serves_both_graphs_and_lives_until_its_last_release(upstream):
    """``torch.cuda.graph(g2, pool=g1.pool())``: the second capture uses the first's pool."""
    pools = PrivatePools(upstream)
    assert pools.use(G1) == 1
    a = pools.allocate(G1, 2 * MiB, 0)
    pools.free(a)
    assert pools.use(G1) == 2  # the second graph shares the pool
    assert pools.allocate(G1, 2 * MiB, 0) == a
    pools.free(a)
    assert pools.release(G1) == 1  # the first graph is reset: the pool stays for the second
    assert a in upstream.live_allocations()
    assert pools.release(G1) == 0
    assert a not in upstream.live_allocations() and len(pools) == 0
    pools._check()


def test_release_gives_cached_blocks_back_at_once_and_live_ones_when_freed(upstream):
    pools = PrivatePools(upstream)
    pools.use(G1)
    cached = pools.allocate(G1, 3 * MiB, 0)
    out = pools.allocate(G1, 5 * MiB, 0)  # a graph output the program still holds
    pools.free(cached)
    before = upstream.allocated_bytes
    pools.release(G1)
    assert upstream.allocated_bytes == before - 3 * MiB
    assert out in upstream.live_allocations() and pools.live_blocks(G1) == {out: 5 * MiB}
    with pytest.raises(ConfigError, match="released"):
        pools.allocate(G1, MiB, 0)
    pools.free(out)  # the program drops the output: straight back upstream
    assert out not in upstream.live_allocations() and len(pools) == 0
    pools._check()


def test_the_live_allocations_of_a_pool_are_what_cudagraph_trees_check(upstream):
    pools = PrivatePools(upstream)
    pools.use(G1)
    a, b = pools.allocate(G1, MiB, 0), pools.allocate(G1, 3 * MiB, 0)
    assert pools.live_blocks(G1) == {a: MiB, b: 3 * MiB}
    pools.free(a)
    assert pools.live_blocks(G1) == {b: 3 * MiB}


def test_take_back_restores_a_cached_block_at_its_address(upstream):
    """cudagraph trees' setCheckpointPoolState puts a freed block back where it was."""
    pools = PrivatePools(upstream)
    pools.use(G1)
    a = pools.allocate(G1, 6 * MiB, 0)
    pools.free(a)
    assert pools.take_back(G1, a, 6 * MiB)
    assert pools.live_blocks(G1) == {a: 6 * MiB}
    assert not pools.take_back(G1, a, 6 * MiB)  # live already
    pools.free(a)
    assert not pools.take_back(G1, a, 7 * MiB)  # too small for that request
    assert not pools.take_back(G2, a, MiB)  # another pool's
    pools._check()


def test_reuse_takes_the_smallest_block_that_fits_within_the_slack(upstream):
    pools = PrivatePools(upstream)
    pools.use(G1)
    big = pools.allocate(G1, 64 * MiB, 0)
    small = pools.allocate(G1, 3 * MiB, 0)
    pools.free(big)
    pools.free(small)
    assert pools.allocate(G1, 2 * MiB, 0) == small  # 1 MiB larger: within the slack
    fresh = pools.allocate(G1, 4 * MiB, 0)
    assert fresh != big, "a 64 MiB block must not serve a 4 MiB request (more than twice, beyond the slack)"
    assert pools.allocate(G1, 64 * MiB - REUSE_SLACK, 0) == big


def test_bad_use_is_refused_by_name(upstream):
    pools = PrivatePools(upstream)
    with pytest.raises(ConfigError, match=r"no private pool \(9, 9\)"):
        pools.allocate((9, 9), MiB, 0)
    pools.use(G1)
    with pytest.raises(InvalidFreeError, match="no private pool"):
        pools.free(0x1234)
    pools.release(G1)  # its last use: the pool is gone
    with pytest.raises(ConfigError, match=r"no private pool \(1, 0\)"):
        pools.release(G1)
