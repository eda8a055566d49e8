"""Option values that passed the check and failed later, or were silently taken (issue 37,
items 1 and 9)."""


import pytest
from tests.cli.helpers import run_cli


def _cli(*args):
    """Exit code and both streams, as a user sees them (run in this process: tests/cli/helpers.py)."""
    return run_cli(*args)


def _one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def test_a_ratio_that_overflows_later_is_refused_before_the_replay(small_trace):
    """Item 1: reuse_max_ratio=1e308 passed the check, then raised OverflowError mid-replay."""
    _one_line_error(_cli("replay", str(small_trace), "-a", "vms", "-o", "reuse_max_ratio=1e308"),
                    "reuse_max_ratio", "'1e308'")


def test_a_capacity_beyond_64_bits_is_refused(small_trace):
    _one_line_error(_cli("replay", str(small_trace), "--capacity", "99999999999999999999999GiB"),
                    "--capacity", "99999999999999999999999GiB")


@pytest.mark.parametrize("items", [["-o", "reuse_max_ratio=2", "-o", "reuse_max_ratio=3"],
                                   ["-o", "reuse_max_ratio=2,reuse_max_ratio=3"],
                                   ["-o", "vms:reuse_max_ratio=2", "-o", "vms:reuse_max_ratio=3"]])
def test_a_key_given_twice_is_refused(small_trace, items):
    """Item 9: a repeated -o key was taken silently, the last one winning."""
    _one_line_error(_cli("replay", str(small_trace), "-a", "vms", *items), "reuse_max_ratio", "twice")


def test_sweep_grid_values_are_read_as_o_reads_them(small_trace):
    """Issue 35, item 1: --grid converted values its own weaker way (``1e308``, ``maybe`` taken)."""
    _one_line_error(_cli("sweep", str(small_trace), "-a", "vms", "-g", "reuse_max_ratio=2,1e308"),
                    "reuse_max_ratio", "'1e308'")
    _one_line_error(_cli("sweep", str(small_trace), "-a", "vms", "-g", "coalesce=true,maybe"), "coalesce", "'maybe'")
