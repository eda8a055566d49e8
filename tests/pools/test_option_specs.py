"""Property tests of the one option syntax and of sizes (issue 35, item 7; issue 37, items 1
and 9): what is written reads back, the CLI's ``-o`` and a spec agree, and a value the check
takes never fails later.
"""

import doctest
from dataclasses import fields
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vmstoolkit.pools.constants as constants
import vmstoolkit.pools.options as options_module
import vmstoolkit.pools.registry as registry_module
import vmstoolkit.units as units
from vmstoolkit.errors import ConfigError
from vmstoolkit.pools.options import format_options
from vmstoolkit.pools.registry import (
    allocator_names, check_allocator, make_allocator, options_class, parse_allocator_spec, resolve_option_items,
)
from vmstoolkit.units import GiB, KiB, MAX_SIZE, MiB, TiB, format_size, parse_size

UNITS = {"": 1, "B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB, "K": KiB, "M": MiB, "G": GiB,
         "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "gib": GiB}
CONFIGS = ["max_split_size_mb:128", "garbage_collection_threshold:0.6", "roundup_power2_divisions:4",
           "max_split_size_mb:256,garbage_collection_threshold:0.8"]
TRUE, FALSE = ["true", "True", "yes", "on", "1"], ["false", "FALSE", "no", "off", "0"]


@pytest.mark.parametrize("module", [options_module, registry_module, constants, units])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


# -- sizes ---------------------------------------------------------------------------------------
@given(st.integers(0, MAX_SIZE))
def test_a_byte_count_reads_back(n):
    assert parse_size(str(n)) == n == parse_size(n) == parse_size(f" {n} B ", whole=True)


@given(st.integers(0, 10**22), st.sampled_from(sorted(UNITS)))
def test_a_count_of_units_is_exact_or_refused(n, unit):
    want = n * UNITS[unit]
    if want > MAX_SIZE:
        with pytest.raises(ValueError, match="larger than"):
            parse_size(f"{n}{unit}")
    else:
        assert parse_size(f"{n}{unit}") == want


@given(st.integers(0, 10**6), st.integers(0, 999), st.sampled_from(["KiB", "MiB", "GiB", "MB", "GB"]))
def test_decimals_are_read_exactly(whole, thousandths, unit):
    text = f"{whole}.{thousandths:03d}{unit}"
    exact = (whole * 1000 + thousandths) * UNITS[unit]
    assert parse_size(text) == round(Fraction(exact, 1000))  # exact, rounded once (half to even)
    if exact % 1000:
        with pytest.raises(ValueError, match="not a whole number of bytes"):
            parse_size(text, whole=True)


@given(st.integers(0, 1 << 50))
def test_what_format_size_writes_reads_back_within_its_rounding(n):
    text = format_size(n)
    unit = next((f for u, f in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)) if text.endswith(u)), 1)
    assert abs(parse_size(text) - n) <= unit // 200 + 1  # two decimals: half a hundredth of the unit


# -- option specs ----------------------------------------------------------------------------------
def _text(f, draw) -> str:
    """A value of field ``f`` as a user types it."""
    meta = f.metadata
    kind, lo, hi = meta["kind"], meta["min"], meta["max"]
    if meta["retired"]:  # takes only its default
        return draw(st.sampled_from(FALSE)) if kind == "bool" else str(f.default)
    if meta["choices"]:
        return draw(st.sampled_from(meta["choices"]))
    if kind == "bool":
        return draw(st.sampled_from(TRUE + FALSE))
    if kind == "str":
        return draw(st.sampled_from(CONFIGS))
    if kind == "float":
        x = draw(st.floats(lo if lo is not None else -1e6, hi if hi is not None else 1e6, allow_nan=False))
        short = f"{x:.6g}"  # as a user types it, when rounding keeps it in range
        inside = (lo is None or float(short) >= lo) and (hi is None or float(short) <= hi)
        return draw(st.sampled_from([repr(x), short if inside else repr(x)]))
    lo, hi = int(lo or 0), int(hi if hi is not None else 1 << 40)
    if meta["power_of_two"]:
        return str(1 << draw(st.integers(lo.bit_length() - 1, hi.bit_length() - 1)))
    if kind == "size":
        n = draw(st.integers(max(lo, 1) // MiB + 1, hi // MiB if hi >= MiB else 1 << 20))
        if f.name in ("va_bytes", "small_va_bytes"):
            n += n % 2  # whole 2 MiB pages
        return draw(st.sampled_from([str(n * MiB), f"{n}MiB", f"{n} MiB"])) if n * MiB <= hi else str(hi)
    return str(draw(st.integers(lo, hi)))


@st.composite
def specs(draw):
    name = draw(st.sampled_from(allocator_names()))
    every = fields(options_class(name))
    chosen = draw(st.lists(st.sampled_from(every), unique_by=lambda f: f.name)) if every else []
    return name, {f.name: _text(f, draw) for f in chosen}


@settings(max_examples=200, deadline=None)
@given(specs(), st.sampled_from([",", "+"]))
def test_a_spec_reads_back_as_written_and_as_o_reads_it(spec, sep):
    name, raw = spec
    text = name + (":" + sep.join(f"{k}={v}" for k, v in raw.items()) if raw else "")
    if sep == "+" and "config" in raw:
        text = text.replace("+", ",")  # PyTorch's string keeps its commas; + is the old pair separator
    parsed = parse_allocator_spec(text)
    assert parsed.name == name and list(parsed.options) == list(raw)
    assert parse_allocator_spec(str(parsed)) == parsed  # what str() writes reads back
    assert check_allocator(name, parsed.options) == parsed.options  # checking is idempotent
    item = f"{name}:{format_options(parsed.options, sep=',')}" if raw else None
    assert resolve_option_items([item] if item else [], [name]) == {name: parsed.options}
    obj = options_class(name)(**parsed.options)
    assert {k: getattr(obj, k) for k in raw} == parsed.options


@settings(max_examples=100, deadline=None)
@given(specs(), st.data())
def test_a_key_given_twice_is_refused(spec, data):
    name, raw = spec
    if not raw:
        return
    key = data.draw(st.sampled_from(sorted(raw)))
    text = f"{name}:" + ",".join(f"{k}={v}" for k, v in raw.items()) + f",{key}={raw[key]}"
    if key == "config":
        text = f"{name}:{key}={raw[key]},{key}={raw[key]}"
    with pytest.raises(ConfigError, match="given twice"):
        parse_allocator_spec(text)


# -- values the check takes never fail later ---------------------------------------------------------
def _extremes(name):
    """(key, value) at the edge of every numeric option's range, and well beyond it."""
    for f in fields(options_class(name)):
        meta = f.metadata
        if meta["kind"] not in ("int", "float", "size"):
            continue
        values = [meta["max"]] if meta["max"] is not None else []
        values += ["1e308"] if meta["kind"] == "float" else [str(10**18), str(10**30)]
        for v in values:
            yield f.name, v if isinstance(v, str) else (float(v) if meta["kind"] == "float" else int(v))


CASES = [(name, key, value) for name in allocator_names() for key, value in _extremes(name)]


@pytest.mark.parametrize("name, key, value", CASES, ids=[f"{n}-{k}-{v}" for n, k, v in CASES])
def test_an_extreme_value_is_refused_up_front_or_works(name, key, value):
    """Issue 37, item 1: ``reuse_max_ratio=1e308`` passed the check and raised OverflowError
    mid-replay. Every numeric option at its bound, and far past it, is either refused by the
    check (one line naming key and value) or serves allocations of every size class."""
    try:
        a = make_allocator(name, capacity="1GiB", **{key: value})
    except ConfigError as e:
        assert key in str(e) and str(value) in str(e) and "\n" not in str(e)
        return
    try:
        live = []
        for size in (512, 3 * MiB, 40 * MiB, 1000, 7 * MiB, 64 * MiB, 40 * MiB):
            live.append(a.allocate(size))
            if len(live) % 3 == 0:
                a.free(live.pop(0))
                a.free(live.pop(0))
        for p in live:
            a.free(p)
        live = [a.allocate(s) for s in (100 * MiB, 2 * MiB, 30 * MiB)]  # reuse what was freed
        a._check()
    finally:
        a.close()
