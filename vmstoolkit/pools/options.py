"""Every allocator's options, as documented dataclasses checked in one place.

Each allocator that takes options has a frozen dataclass here whose fields are its keyword
options, each with its type, range and meaning. Constructing one converts and checks every
field (``"2"`` -> ``2.0``, ``"64MiB"`` -> bytes, ``"false"`` -> ``False``) and raises
:class:`~vmstoolkit.errors.ConfigError` naming the key and the value on anything else, so a bad
option is refused before any replay starts and without building an allocator.
:func:`~vmstoolkit.pools.make_allocator` runs the same check, so the CLI, Python callers, the
integrations and the experiments share it.

One syntax for the CLI, Python callers and the experiments: ``ALLOC:KEY=VALUE,KEY=VALUE``
names an allocator and its options (:func:`~vmstoolkit.pools.registry.parse_allocator_spec`, e.g. an experiment's mode
``paged:aliases=true,slack_pages=64``); on the command line (:func:`resolve_option_items`)::

    -o KEY=VALUE[,KEY=VALUE...]          every chosen allocator that takes KEY
    -o ALLOC:KEY=VALUE[,KEY=VALUE...]    allocator ALLOC only

``+`` between pairs (``paged:aliases=True+slack_pages=64``) is read as ``,``: an alias kept so
that the commands recorded with older results still run (:func:`split_pairs`).

>>> check_options("vms", {"reuse_max_ratio": "2", "stitched_prefix": "false"})
{'reuse_max_ratio': 2.0, 'stitched_prefix': False}
>>> check_options("vms", {"coalesce": "maybe"})
Traceback (most recent call last):
...
vmstoolkit.errors.ConfigError: bad options for allocator 'vms': coalesce must be true or false, got 'maybe'
>>> resolve_option_items(["reuse_max_ratio=2", "pytorch-caching:config=max_split_size_mb:128"],
...                      ["pytorch-caching", "vms"])
{'pytorch-caching': {'config': 'max_split_size_mb:128'}, 'vms': {'reuse_max_ratio': 2.0}}
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Iterable, Mapping

from vmstoolkit.errors import ConfigError
from vmstoolkit.units import GiB, KiB, MiB, TiB, parse_size

SMALL_SIZE = 1 * MiB  # PyTorch's kSmallSize: requests up to this size are small (pools/small.py)
PAGE = 2 * MiB  # cuMemGetAllocationGranularity on every GPU we target, and the simulated driver's

PAGED_MAX_HOST_BYTES = 4 * GiB
"""The most host memory ``paged``'s heap arrays may take. They grow with the virtual range
(per 2 MiB page and per large unit: about 40 bytes a page by default), which defaults to twice
the device capacity: an H200 (141 GiB) needs about 12 MB. A range needing gigabytes of arrays is
a mistyped ``--capacity`` or ``va_bytes`` (``1024TiB``: 24 GiB of arrays), refused at once
instead of exhausting the host."""

PAGED_MIN_BLOCKS = 16
"""Fewest block records ``paged`` takes per heap. Every block, free or live, holds one record;
with fewer than a handful, the first allocations exhaust them, and running out of records reads
like a full virtual range (issue 15, item 2). 16 still lets tests exhaust records on purpose."""
PAGED_MAX_BLOCKS = 1 << 27
"""Most block records per heap: 37 bytes of host arrays each, 5 GiB for two heaps at 2**27."""


# -- values ------------------------------------------------------------------------------------
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:
        return v.strip().lower() in _TRUE
    raise ConfigError(f"must be true or false, got {v!r}")


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ConfigError(f"must be an integer, got {v!r}")
    if isinstance(v, str):
        try:
            return int(v.strip(), 10)
        except ValueError:
            raise ConfigError(f"must be an integer, got {v!r}") from None
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ConfigError(f"must be a number, got {v!r}")
    try:
        x = float(v)
    except (ValueError, OverflowError):
        raise ConfigError(f"must be a number, got {v!r}") from None
    if not math.isfinite(x):
        raise ConfigError(f"must be a finite number, got {v!r}")
    return x


def _size(v: Any) -> int:
    """Bytes from an int or ``"64MiB"`` (:func:`vmstoolkit.units.parse_size`); a size must come to a
    whole number of bytes (``1.5`` is not)."""
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ConfigError(f"must be a size in bytes (e.g. 4096, 64MiB), got {v!r}")
    if isinstance(v, int) and v < 0:
        raise ConfigError(f"must be a size of at least 0, got {v!r}")
    try:
        return parse_size(v, whole=True)
    except ValueError as e:
        raise ConfigError(f"must be a size in bytes (e.g. 4096, 64MiB): {e}") from None


_CONVERT = {"bool": _bool, "int": _int, "float": _float, "size": _size, "str": str, "choice": str}


def option(default: Any, kind: str, help: str, *, min: float | None = None, max: float | None = None,
           choices: tuple[str, ...] = (), power_of_two: bool = False, optional: bool = False):
    """A documented option field: ``kind`` is bool, int, float, size, str or choice; ``min``/``max``
    bound numbers and sizes; ``optional``: ``None`` (the allocator's own default) is allowed."""
    return field(default=default, metadata=dict(kind=kind, help=help, min=min, max=max, choices=choices,
                                                power_of_two=power_of_two, optional=optional))


def _check_field(f, value: Any) -> Any:
    meta = f.metadata
    if value is None and meta["optional"]:
        return None
    if isinstance(value, str) and meta["optional"] and value.strip().lower() in ("none", "default", ""):
        return None
    v = _CONVERT[meta["kind"]](value)
    if meta["choices"] and v not in meta["choices"]:
        raise ConfigError(f"must be one of {', '.join(meta['choices'])}, got {value!r}")
    lo, hi = meta["min"], meta["max"]
    if lo is not None and v < lo:
        raise ConfigError(f"must be at least {_show(lo, meta['kind'])}, got {value!r}")
    if hi is not None and v > hi:
        raise ConfigError(f"must be at most {_show(hi, meta['kind'])}, got {value!r}")
    if meta["power_of_two"] and v & (v - 1):
        raise ConfigError(f"must be a power of two, got {value!r}")
    return v


def _show(x: float, kind: str) -> str:
    if kind == "size":
        for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
            if x >= factor and x % factor == 0:
                return f"{x // factor}{unit}"
    return f"{x:g}" if isinstance(x, float) else str(x)


# -- the options of each allocator -----------------------------------------------------------------
@dataclass(frozen=True)
class AllocatorOptions:
    """Base of every allocator's options: construction converts and checks each field."""

    noun: ClassVar[str] = "option"  # how an unknown key is named in errors ("stitch policy option")

    def __post_init__(self) -> None:
        for f in fields(self):
            try:
                object.__setattr__(self, f.name, _check_field(f, getattr(self, f.name)))
            except ValueError as e:
                raise ConfigError(f"{f.name} {e}") from None
        self._check_together()

    def _check_together(self) -> None:
        """Checks that involve several fields; subclasses add theirs."""

    def check_for_driver(self, capacity: int, granularity: int) -> None:
        """Checks that need the device (capacity and page size); subclasses add theirs."""

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def describe(cls) -> dict[str, str]:
        """``{key: "kind, default X: help"}`` for help texts."""
        out = {}
        for f in fields(cls):
            default = f.default if f.default is not MISSING else None
            out[f.name] = f"{f.metadata['kind']}, default {default}: {f.metadata['help']}"
        return out


@dataclass(frozen=True)
class NoOptions(AllocatorOptions):
    """An allocator without options (``native``)."""


@dataclass(frozen=True)
class StitchOptions(AllocatorOptions):
    """The stitching allocators' policy (:class:`~vmstoolkit.pools.vmm.allocator.StitchPolicy`).
    Defaults here are ``gmlake``'s (GMLake's published ones); ``vms`` has its own (:class:`VmsOptions`)."""

    noun: ClassVar[str] = "stitch policy option"

    stitch_min_bytes: int = option(512 * MiB, "size", "requests smaller than this never trigger a new stitch "
                                   "(unless memory is full)", min=0)
    reuse_max_ratio: float = option(10.0, "float", "a cached stitched block serves a request only if at most "
                                    "this many times larger (only with stitched_prefix=false: a prefix of it is taken first)", min=1.0)
    selection: str = option("largest-first", "choice", "which free blocks to stitch",
                            choices=("largest-first", "best-fit"))
    max_cached_stitched: int = option(1024, "int", "stitched ranges kept for reuse (least recently used idle "
                                      "ones unmapped past it)", min=0, max=1 << 30)
    stitched_prefix: bool = option(False, "bool", "serve a request from the start of a larger cached "
                                   "stitched range")
    coalesce: bool = option(False, "bool", "merge a freed primitive block with its free neighbours")
    small_size: int = option(SMALL_SIZE, "size", "requests up to this size are packed in the small pool's "
                             "one-chunk segments, so it may not exceed a chunk (2 MiB)", min=0, max=PAGE)

    def check_for_driver(self, capacity: int, granularity: int) -> None:
        if self.small_size > granularity:
            raise ConfigError(f"small_size must be at most the driver's granularity ({granularity} bytes), "
                              f"got {self.small_size}")


@dataclass(frozen=True)
class GMLakeOptions(StitchOptions):
    """``gmlake``: GMLake's published defaults."""


@dataclass(frozen=True)
class VmsOptions(StitchOptions):
    """``vms``: our policy (the figures behind each default are in ``VMS_POLICY``'s docstring)."""

    stitch_min_bytes: int = option(0, "size", "requests smaller than this never trigger a new stitch", min=0)
    reuse_max_ratio: float = option(1.0, "float", "a cached stitched block serves a request only if at most "
                                    "this many times larger (only with stitched_prefix=false: a prefix of it is taken first)", min=1.0)
    selection: str = option("best-fit", "choice", "which free blocks to stitch",
                            choices=("largest-first", "best-fit"))
    max_cached_stitched: int = option(256, "int", "stitched ranges kept for reuse", min=0, max=1 << 30)
    stitched_prefix: bool = option(True, "bool", "serve a request from the start of a larger cached stitched range")
    coalesce: bool = option(True, "bool", "merge a freed primitive block with its free neighbours")


@dataclass(frozen=True)
class PyTorchCachingOptions(AllocatorOptions):
    """``pytorch-caching``: PyTorch's allocator settings as a ``PYTORCH_CUDA_ALLOC_CONF`` string."""

    expandable: ClassVar[bool] = False
    name: ClassVar[str] = "pytorch-caching"

    config: str | None = option(None, "str", "a PYTORCH_CUDA_ALLOC_CONF string, e.g. max_split_size_mb:128",
                                optional=True)

    def _check_together(self) -> None:
        from vmstoolkit.pools.baselines.pytorch_config import parse_alloc_conf

        if self.config is None:
            return
        try:
            conf = parse_alloc_conf(self.config)
        except ConfigError as e:
            raise ConfigError(f"config: {e}") from None
        if "expandable_segments" in self.config and conf.expandable_segments != self.expandable:
            other = "pytorch-expandable" if conf.expandable_segments else "pytorch-caching"
            raise ConfigError(f"config: expandable_segments:{conf.expandable_segments} does not fit allocator "
                              f"{self.name!r}; use {other}")


@dataclass(frozen=True)
class PyTorchExpandableOptions(PyTorchCachingOptions):
    """``pytorch-expandable``: as ``pytorch-caching``; ``expandable_segments:True`` is implied."""

    expandable: ClassVar[bool] = True
    name: ClassVar[str] = "pytorch-expandable"


@dataclass(frozen=True)
class PagedOptions(AllocatorOptions):
    """``paged`` (:class:`~vmstoolkit.pools.paged.PagedAllocator`)."""

    va_bytes: int | None = option(None, "size", "the large heap's virtual range (default: twice the capacity, "
                                  "in whole pages)", min=1, optional=True)
    small_va_bytes: int = option(4 * GiB, "size", "the small heap's virtual range (requests up to 1 MiB)", min=1)
    slack_pages: int = option(0, "int", "pages of physical memory allowed beyond the live-page peak before "
                              "free pages are reclaimed", min=0, max=1 << 31)
    reclaim: str = option("top-down", "choice", "which free pages give their chunks back first",
                          choices=("top-down", "clock"))
    reclaim_batch: int = option(16, "int", "fewest pages reclaimed per device synchronize", min=1, max=1 << 31)
    placement: str = option("mapped", "choice", "where large blocks go: the best fit, or free pages that "
                            "still have chunks", choices=("best-fit", "mapped"))
    aliases: bool = option(False, "bool", "map free pages' chunks once more where needed instead of unmapping")
    large_unit: int | None = option(None, "size", "allocation unit of the large heap (a power of two from "
                                    "512 B to the page; default: the page)", min=512, max=PAGE,
                                    power_of_two=True, optional=True)
    max_blocks: int = option(1 << 18, "int", "block records per heap (every free or live block holds one)",
                             min=PAGED_MIN_BLOCKS, max=PAGED_MAX_BLOCKS)

    def check_for_driver(self, capacity: int, granularity: int) -> None:
        if self.large_unit is not None and self.large_unit > granularity:
            raise ConfigError(f"large_unit must be at most the page ({granularity} bytes), got {self.large_unit}")
        va = self.va_bytes or 2 * -(-capacity // granularity) * granularity
        need = paged_host_bytes(va, self.small_va_bytes, granularity, self.large_unit or granularity, self.max_blocks)
        if need > PAGED_MAX_HOST_BYTES:
            raise ConfigError(
                f"paged: a virtual range of {_show(va, 'size')} bytes ({va // granularity} pages"
                + ("" if self.va_bytes else f", twice the capacity {_show(capacity, 'size')}")
                + f") needs {need / GiB:.1f} GiB of host arrays, more than the {PAGED_MAX_HOST_BYTES // GiB} GiB "
                  f"allowed; lower the capacity or set va_bytes")


def paged_host_bytes(va_bytes: int, small_va_bytes: int, page: int, large_unit: int, max_blocks: int) -> int:
    """Host memory of ``paged``'s arrays (``pools/paged/heap.py``, ``allocator.py``), in bytes:
    per chunk 24 (chunk_live, nmaps, chunk_stack, out_pages, out_chunks), per page 8 (page_chunk,
    page_used), per unit 4 (block_at), per block record 37, for both heaps."""
    chunks = va_bytes // page + small_va_bytes // page
    units = va_bytes // large_unit + small_va_bytes // 512
    return 24 * chunks + 8 * chunks + 4 * units + 2 * 37 * max_blocks


OPTIONS: dict[str, type[AllocatorOptions]] = {
    "native": NoOptions,
    "gmlake": GMLakeOptions,
    "vms": VmsOptions,
    "pytorch-caching": PyTorchCachingOptions,
    "pytorch-expandable": PyTorchExpandableOptions,
    "paged": PagedOptions,
}
"""Allocator name -> its options class. An allocator registered elsewhere without an entry here
gets its options unchecked (its factory's own checks apply); :func:`register_options` adds one."""


def register_options(name: str, cls: type[AllocatorOptions]) -> None:
    OPTIONS[name] = cls


# -- checking ------------------------------------------------------------------------------------
def takers(key: str, names: Iterable[str] | None = None) -> list[str]:
    """The allocators (of ``names``, default every known one) that take option ``key``."""
    return [n for n in (OPTIONS if names is None else names) if n in OPTIONS and key in OPTIONS[n].keys()]


def _unknown(name: str, cls: type[AllocatorOptions], key: str) -> ConfigError:
    others = [n for n in takers(key) if n != name]
    where = f"; it is an option of {', '.join(others)}" if others else ""
    known = ", ".join(cls.keys()) or "none"
    return ConfigError(f"bad options for allocator {name!r}: unknown {cls.noun} {key!r}{where} "
                       f"({name} takes: {known})")


def options_for(name: str, options: Mapping[str, Any]) -> AllocatorOptions | None:
    """The checked options object of allocator ``name`` (``None`` when ``name`` has no options class)."""
    cls = OPTIONS.get(name)
    if cls is None:
        return None
    for key in options:
        if key not in cls.keys():
            raise _unknown(name, cls, key)
    try:
        return cls(**options)
    except ConfigError as e:
        raise ConfigError(f"bad options for allocator {name!r}: {e}") from None


def check_options(name: str, options: Mapping[str, Any], *, capacity: int | None = None,
                  granularity: int = PAGE) -> dict:
    """``options`` of allocator ``name`` converted and checked, as keywords for its factory
    (only the keys given: the allocator keeps its own defaults for the others). With ``capacity``,
    also the checks that need the device (``paged``'s host arrays, page-sized units).
    Raises :class:`~vmstoolkit.errors.ConfigError` naming the key and the value. Cost: O(keys)."""
    obj = options_for(name, options)
    if obj is None:
        return dict(options)
    if capacity is not None:
        try:
            obj.check_for_driver(capacity, granularity)
        except ConfigError as e:
            raise ConfigError(f"bad options for allocator {name!r}: {e}") from None
    return {k: getattr(obj, k) for k in options}


# -- the one syntax: [ALLOC:]KEY=VALUE[,KEY=VALUE...] ------------------------------------------------
_SEPARATOR = re.compile(r"([,+])")
_ITEM_USAGE = "KEY=VALUE[,KEY=VALUE...] or ALLOCATOR:KEY=VALUE[,KEY=VALUE...]"


def split_pairs(text: str, where: str = "options") -> list[tuple[str, str]]:
    """``"aliases=true,slack_pages=64"`` -> ``[("aliases", "true"), ("slack_pages", "64")]``.

    Pairs are separated by ``,``. ``+`` separates them too: an alias kept for the commands of
    old results (``paged:aliases=True+slack_pages=64``); new commands use ``,``. A piece without
    ``=`` belongs to the value before it, so values keep their own commas and pluses (PyTorch's
    ``config=max_split_size_mb:128,garbage_collection_threshold:0.6``, a float's ``1e+3``).
    Raises :class:`~vmstoolkit.errors.ConfigError` naming ``where`` and the piece otherwise.

    >>> split_pairs("config=max_split_size_mb:128,garbage_collection_threshold:0.6+x=1e+3")
    [('config', 'max_split_size_mb:128,garbage_collection_threshold:0.6'), ('x', '1e+3')]
    """
    parts = _SEPARATOR.split(text)
    pieces = [parts[0]]
    for sep, piece in zip(parts[1::2], parts[2::2]):
        if "=" in piece:
            pieces.append(piece)
        else:
            pieces[-1] += sep + piece
    pairs = []
    for piece in pieces:
        key, eq, value = piece.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"{where}: expected KEY=VALUE, got {piece!r}")
        pairs.append((key.strip(), value.strip()))
    return pairs


def parse_option_item(item: str) -> tuple[str | None, list[tuple[str, str]]]:
    """One ``-o`` item: ``"vms:reuse_max_ratio=2,coalesce=false"`` -> ``("vms", [("reuse_max_ratio",
    "2"), ("coalesce", "false")])``; no prefix -> ``None``.

    The prefix is what stands before the last ``:`` of the first key (values may hold ``:``,
    as PyTorch's ``config=max_split_size_mb:128`` does)."""
    head, eq, rest = item.partition("=")
    alloc, colon, key = head.rpartition(":")
    if not eq or not key.strip() or (colon and not alloc.strip()):
        raise ConfigError(f"--option takes {_ITEM_USAGE}, got {item!r}")
    return (alloc.strip() or None), split_pairs(key + eq + rest, f"option {item!r}")


def split_option_item(item: str) -> tuple[str | None, str, str]:
    """``"vms:reuse_max_ratio=2"`` -> ``("vms", "reuse_max_ratio", "2")``: an item of one pair
    (:func:`parse_option_item` takes several)."""
    alloc, pairs = parse_option_item(item)
    if len(pairs) != 1:
        raise ConfigError(f"expected one KEY=VALUE, got {len(pairs)} in {item!r}")
    return (alloc, *pairs[0])


def resolve_option_items(items: Iterable[str] | None, allocators: list[str], *,
                         capacity: int | None = None, granularity: int = PAGE) -> dict[str, dict]:
    """Per allocator of ``allocators``, its checked options from ``-o`` items (each one or more
    pairs separated by ``,``: :func:`parse_option_item`).

    ``KEY=VALUE`` goes to every chosen allocator that takes ``KEY`` (an error when none does,
    naming those that take it); ``ALLOC:KEY=VALUE`` to ``ALLOC`` only (an error when it is not
    among ``allocators``). A later item overrides an earlier one for the same allocator and key.
    """
    raw: dict[str, dict] = {a: {} for a in allocators}
    for item in items or []:
        alloc, pairs = parse_option_item(item)
        if alloc is not None and alloc not in raw:
            raise ConfigError(f"option {item!r} is for allocator {alloc!r}, which is not among the chosen "
                              f"allocators ({', '.join(allocators)})")
        for key, value in pairs:
            chosen = [alloc] if alloc is not None else [a for a in allocators if a not in OPTIONS or key in OPTIONS[a].keys()]
            if not chosen:
                others = takers(key)
                raise ConfigError(f"unknown option {key!r} for {', '.join(allocators)}"
                                  + (f"; it is an option of {', '.join(others)}" if others else "; no allocator takes it"))
            for a in chosen:
                raw[a][key] = value
    return {a: check_options(a, opts, capacity=capacity, granularity=granularity) for a, opts in raw.items()}


def guess_value(text: str) -> Any:
    """A typed value for an option whose allocator is unknown: true/false, int, float, else text."""
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            continue
    return t


def parse_options(items: Iterable[str] | None) -> dict:
    """``["reuse_max_ratio=2", "aliases=true"]`` -> ``{"reuse_max_ratio": 2, "aliases": True}``, for
    one allocator chosen elsewhere (values are typed by :func:`guess_value`; the allocator's own
    check converts the rest). Prefixed items are refused: there is only one allocator."""
    out: dict = {}
    for item in items or []:
        alloc, key, value = split_option_item(item)
        if alloc is not None:
            raise ConfigError(f"option {item!r} names an allocator; here options apply to one allocator: "
                              f"give {key}={value}")
        out[key] = guess_value(value)
    return out


def format_options(options: Mapping[str, Any], sep: str = " ") -> str:
    """``{"reuse_max_ratio": 2.0, "coalesce": False}`` -> ``"reuse_max_ratio=2.0 coalesce=false"``
    (re-usable as ``-o`` items; ``sep=","``: as one item; empty for an allocator's defaults)."""
    def show(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    return sep.join(f"{k}={show(v)}" for k, v in options.items())


__all__ = [
    "AllocatorOptions", "NoOptions", "StitchOptions", "GMLakeOptions", "VmsOptions", "PyTorchCachingOptions",
    "PyTorchExpandableOptions", "PagedOptions", "OPTIONS", "register_options", "options_for", "check_options",
    "takers", "split_pairs", "parse_option_item", "split_option_item", "resolve_option_items", "parse_options",
    "guess_value", "format_options", "paged_host_bytes",
]
