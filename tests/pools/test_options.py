"""Allocator options: typed, range-checked in one place, before anything is built (issue 15 item 10,
issue 19 "Options", issue 21 "CLI conventions")."""

from dataclasses import fields

import pytest

from vmstoolkit.errors import ConfigError
from vmstoolkit.pools import make_allocator, registry
from vmstoolkit.pools.options import format_options, split_option_item
from vmstoolkit.pools.registry import (
    AllocatorSpec, allocator_names, options_class, parse_allocator_spec, resolve_option_items,
)
from vmstoolkit.pools.registry import check_allocator as check_options


@pytest.mark.parametrize("name, key, value", [
    ("vms", "coalesce", "maybe"),
    ("vms", "stitched_prefix", "2"),
    ("paged", "aliases", "maybe"),
    ("vms", "reuse_max_ratio", "nan"),
    ("vms", "reuse_max_ratio", "inf"),
    ("vms", "reuse_max_ratio", "abc"),
    ("vms", "reuse_max_ratio", "0.5"),
    ("gmlake", "max_cached_stitched", "1.5"),
    ("vms", "small_size", "1e30"),
    ("vms", "small_size", "abc"),
    ("vms", "small_size", "40MiB"),
    ("vms", "stitch_min_bytes", "-5"),
    ("vms", "stitch_min_bytes", "1.5"),
    ("vms", "stitch_min_bytes", "abc"),
    ("paged", "max_blocks", "-1"),
    ("paged", "max_blocks", "0"),
    ("paged", "max_blocks", "1"),
    ("paged", "max_blocks", "2"),
    ("paged", "slack_pages", "-1"),
    ("paged", "large_unit", "1000"),
    ("paged", "reclaim", "lru"),
])
def test_bad_values_name_key_and_value(name, key, value):
    with pytest.raises(ConfigError) as e:
        check_options(name, {key: value})
    msg = str(e.value)
    assert key in msg and repr(value) in msg and name in msg and "\n" not in msg


@pytest.mark.parametrize("name, key, value", [
    ("vms", "small_size", 1e30), ("vms", "reuse_max_ratio", float("nan")), ("vms", "coalesce", 1),
    ("vms", "max_cached_stitched", 1.5), ("paged", "max_blocks", 0), ("paged", "aliases", "maybe"),
])
def test_python_callers_get_the_same_checks(name, key, value):
    with pytest.raises(ConfigError, match=key):
        make_allocator(name, **{key: value})


def test_values_are_converted():
    assert check_options("vms", {"reuse_max_ratio": "2", "coalesce": "false", "stitch_min_bytes": "1.5GiB",
                                 "small_size": "512KiB", "selection": "largest-first"}) == {
        "reuse_max_ratio": 2.0, "coalesce": False, "stitch_min_bytes": 3 << 29, "small_size": 512 << 10,
        "selection": "largest-first"}
    assert check_options("paged", {"large_unit": "64KiB", "va_bytes": "none", "aliases": True}) == {
        "large_unit": 64 << 10, "va_bytes": None, "aliases": True}
    a = make_allocator("vms", stitched_prefix="false", reuse_max_ratio="3")
    assert a.policy.stitched_prefix is False and a.policy.reuse_max_ratio == 3.0


def test_unknown_key_names_the_allocators_that_take_it():
    with pytest.raises(ConfigError, match=r"unknown stitch policy option 'slack_pages'; it is an option of paged"):
        check_options("vms", {"slack_pages": "3"})
    with pytest.raises(ConfigError, match="no allocator takes it"):
        resolve_option_items(["nope=1"], ["vms"])
    with pytest.raises(ConfigError, match="'slack_pages' for vms, pytorch-caching; it is an option of paged"):
        resolve_option_items(["slack_pages=3"], ["vms", "pytorch-caching"])


def test_unprefixed_options_go_where_they_are_taken_prefixed_to_one():
    got = resolve_option_items(["reuse_max_ratio=2", "config=max_split_size_mb:128", "vms:coalesce=false",
                                "gmlake:reuse_max_ratio=4"], ["pytorch-caching", "gmlake", "vms", "native"])
    assert got == {"pytorch-caching": {"config": "max_split_size_mb:128"},
                   "gmlake": {"reuse_max_ratio": 4.0}, "vms": {"reuse_max_ratio": 2.0, "coalesce": False},
                   "native": {}}
    with pytest.raises(ConfigError, match="'paged', which is not among the chosen allocators"):
        resolve_option_items(["paged:slack_pages=1"], ["vms"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        split_option_item("junk")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        split_option_item(":x=1")


def test_pytorch_config_is_checked_up_front():
    with pytest.raises(ConfigError, match="pytorch-expandable"):
        check_options("pytorch-caching", {"config": "expandable_segments:True"})
    with pytest.raises(ConfigError, match="max_split_size_mb"):
        check_options("pytorch-expandable", {"config": "max_split_size_mb:lots"})


def test_capacity_that_paged_cannot_represent_is_refused_before_building():
    with pytest.raises(ConfigError, match=r"paged: .*capacity 1024TiB.*lower the capacity or set va_bytes"):
        check_options("paged", {}, capacity=1024 << 40)
    assert check_options("paged", {}, capacity=141 << 30) == {}


def test_formatting():
    assert format_options({"reuse_max_ratio": 2.0, "coalesce": False}) == "reuse_max_ratio=2.0 coalesce=false"


def test_one_item_carries_several_pairs_and_values_keep_their_commas():
    got = resolve_option_items(["vms:reuse_max_ratio=2,coalesce=false",
                                "config=max_split_size_mb:128,garbage_collection_threshold:0.6"],
                               ["pytorch-caching", "vms"])
    assert got == {"vms": {"reuse_max_ratio": 2.0, "coalesce": False},
                   "pytorch-caching": {"config": "max_split_size_mb:128,garbage_collection_threshold:0.6"}}
    with pytest.raises(ConfigError, match="expected one KEY=VALUE, got 2"):
        split_option_item("vms:a=1,b=2")


def test_an_allocator_spec_is_checked_and_typed_like_make_allocator_options():
    assert parse_allocator_spec("vms") == AllocatorSpec("vms", {})
    spec = parse_allocator_spec("paged:aliases=true,slack_pages=64,large_unit=64KiB")
    assert spec == ("paged", {"aliases": True, "slack_pages": 64, "large_unit": 64 << 10})
    assert str(spec) == "paged:aliases=true,slack_pages=64,large_unit=65536"
    assert parse_allocator_spec(str(spec)) == spec  # what str() writes reads back
    got = parse_allocator_spec("pytorch-caching:config=max_split_size_mb:128,garbage_collection_threshold:0.6")
    assert got.options == {"config": "max_split_size_mb:128,garbage_collection_threshold:0.6"}


def test_the_old_plus_separator_reads_as_a_comma():
    """The commands of old results wrote ``paged:aliases=True+slack_pages=64``."""
    assert parse_allocator_spec("paged:aliases=True+slack_pages=64") == parse_allocator_spec(
        "paged:aliases=true,slack_pages=64")
    assert parse_allocator_spec("vms:reuse_max_ratio=1e+1").options == {"reuse_max_ratio": 10.0}


@pytest.mark.parametrize("text, match", [
    ("", "expected NAME or NAME:KEY=VALUE"),
    ("paged:", "expected NAME or NAME:KEY=VALUE"),
    (":slack_pages=1", "ALLOCATOR:KEY=VALUE"),
    ("slack_pages=1", "expected NAME or NAME:KEY=VALUE"),
    ("paged:slack_pages", "expected NAME or NAME:KEY=VALUE"),
    ("paged:slack_pages=1,junk", None),
    ("paged:slack_pages=1,=2", "expected KEY=VALUE, got '=2'"),
    ("nope:a=1", "unknown allocator 'nope'"),
    ("nope", "unknown allocator 'nope'"),
    ("paged:reuse_max_ratio=2", "unknown option 'reuse_max_ratio'; it is an option of gmlake, vms"),
    ("paged:slack_pages=many", "slack_pages must be an integer, got 'many'"),
])
def test_a_bad_allocator_spec_is_one_config_error_naming_it(text, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_allocator_spec(text)
    assert "\n" not in str(e.value)


def test_a_type_error_inside_a_factory_surfaces_as_itself(monkeypatch):
    def broken(driver, options):
        raise TypeError("a real bug")

    monkeypatch.setitem(registry._REGISTRY, "native", registry._REGISTRY["native"]._replace(factory=broken))
    with pytest.raises(TypeError, match="a real bug"):
        make_allocator("native")


@pytest.mark.parametrize("name", allocator_names())
def test_every_option_is_documented(name):
    """Each registered allocator's options class documents every field, with its default there."""
    for f in fields(options_class(name)):
        assert f.metadata["help"] and f.metadata["kind"]


def test_a_key_is_set_once_per_level_and_the_prefixed_one_wins():
    """Issue 37, item 9: a repeated key was taken silently, the last one winning."""
    for items in (["reuse_max_ratio=2", "reuse_max_ratio=3"], ["vms:reuse_max_ratio=2", "vms:reuse_max_ratio=3"],
                  ["reuse_max_ratio=2,reuse_max_ratio=3"]):
        with pytest.raises(ConfigError, match=r"reuse_max_ratio is given twice .*'2', then '3'"):
            resolve_option_items(items, ["vms"])
    for items in (["reuse_max_ratio=2", "vms:reuse_max_ratio=3"], ["vms:reuse_max_ratio=3", "reuse_max_ratio=2"]):
        assert resolve_option_items(items, ["vms", "gmlake"]) == {"vms": {"reuse_max_ratio": 3.0},
                                                                 "gmlake": {"reuse_max_ratio": 2.0}}
    with pytest.raises(ConfigError, match="given twice"):
        parse_allocator_spec("vms:coalesce=true,coalesce=false")
