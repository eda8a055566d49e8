"""Sizes: one parser shared by the API, the CLI and the allocator options."""

import pytest

from vmstoolkit.units import GiB, KiB, parse_size


def test_sizes_are_read_exactly():
    assert parse_size("1.5GiB") == 3 * GiB // 2
    assert parse_size("0.1KiB") == round(0.1 * KiB)  # rounded to a byte
    assert parse_size(" 64 MiB ") == 64 << 20 and parse_size("1.5GB") == 1_500_000_000
    assert parse_size("123456789123456789.5", whole=False) == 123456789123456790  # no float rounding
    assert parse_size(4096, whole=True) == 4096


@pytest.mark.parametrize("value, match", [
    ("1.5", "not a whole number of bytes: '1.5'"), ("0.1KiB", "not a whole number of bytes"),
])
def test_whole_refuses_fractions_of_a_byte(value, match):
    with pytest.raises(ValueError, match=match):
        parse_size(value, whole=True)


@pytest.mark.parametrize("value, match", [
    ("lots", "not a size: 'lots'"), ("12 parsecs", "unknown size unit 'parsecs'"), (-1, "must not be negative"),
    (True, "not a size"), (1.5, "not a size"),
])
def test_what_is_not_a_size_is_named(value, match):
    with pytest.raises(ValueError, match=match):
        parse_size(value)


@pytest.mark.parametrize("value", ["99999999999999999999999GiB", "9223372036854775808", 2**63, "8388608TiB"])
def test_a_size_beyond_64_bit_bytes_is_refused_naming_it(value):
    """Issue 37, item 9: ``--capacity 99999999999999999999999GiB`` was taken as a device of
    that size. No device, array or driver call holds more than 2**63 - 1 bytes."""
    with pytest.raises(ValueError, match="larger than") as e:
        parse_size(value)
    assert str(value) in str(e.value) and "\n" not in str(e.value)


def test_the_largest_size_is_taken():
    assert parse_size(str(2**63 - 1)) == 2**63 - 1
