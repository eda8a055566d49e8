"""Every allocator's options, as documented dataclasses: the one place they are converted,
checked and defaulted.

Each allocator registers with its options class (``@register_allocator("vms", VmsOptions)``,
:mod:`vmstoolkit.pools.registry`): a frozen dataclass whose fields are its options, each with its
type, range, default and meaning. Constructing one converts and checks every field (``"2"`` ->
``2.0``, ``"64MiB"`` -> bytes, ``"false"`` -> ``False``) and raises
:class:`~vmstoolkit.errors.ConfigError` naming the key and the value on anything else, so a bad
option is refused before any replay starts and without building an allocator; the allocator
receives the checked object and neither checks nor defaults an option again. The checks that
need the device (its capacity and page size) are :meth:`AllocatorOptions.check_for_driver`.

One syntax for the CLI, Python callers and the experiments: ``ALLOC:KEY=VALUE,KEY=VALUE``
names an allocator and its options (:func:`~vmstoolkit.pools.registry.parse_allocator_spec`, e.g.
an experiment's mode ``paged:aliases=true,slack_pages=64``); on the command line
(:func:`~vmstoolkit.pools.registry.resolve_option_items`)::

    -o KEY=VALUE[,KEY=VALUE...]          every chosen allocator that takes KEY
    -o ALLOC:KEY=VALUE[,KEY=VALUE...]    allocator ALLOC only

``+`` between pairs (``paged:aliases=True+slack_pages=64``) is read as ``,``: an alias kept so
that the commands recorded with older results still run (:func:`split_pairs`). A key given twice
is an error: nothing is silently overridden.

>>> VmsOptions(reuse_max_ratio="2", stitched_prefix="false").reuse_max_ratio
2.0
>>> VmsOptions(coalesce="maybe")
Traceback (most recent call last):
...
vmstoolkit.errors.ConfigError: coalesce must be true or false, got 'maybe'
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Mapping

from vmstoolkit.errors import ConfigError
from vmstoolkit.pools.constants import PAGE, PAGED_MAX_BLOCKS, PAGED_MIN_BLOCKS, SMALL_SIZE
from vmstoolkit.units import GiB, KiB, MiB, TiB, parse_size

PAGED_MAX_HOST_BYTES = 4 * GiB
"""The most host memory ``paged``'s heap arrays may take. They grow with the virtual range
(per 2 MiB page and per large unit: about 40 bytes a page by default), which defaults to twice
the device capacity: an H200 (141 GiB) needs about 12 MB. A range needing gigabytes of arrays is
a mistyped ``--capacity`` or ``va_bytes`` (``1024TiB``: 24 GiB of arrays), refused at once
instead of exhausting the host."""

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
           choices: tuple[str, ...] = (), power_of_two: bool = False, optional: bool = False, retired: str = ""):
    """A documented option field: ``kind`` is bool, int, float, size, str or choice; ``min``/``max``
    bound numbers and sizes; ``optional``: ``None`` (the allocator's own default) is allowed;
    ``retired``: why the option now takes only its default (an older command that sets it is
    refused with that reason instead of "unknown option"). Runtime complexity: O(1)."""
    return field(default=default, metadata=dict(kind=kind, help=help, min=min, max=max, choices=choices,
                                                power_of_two=power_of_two, optional=optional, retired=retired))


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
    if meta["retired"] and v != f.default:
        raise ConfigError(f"is retired and takes only {_show(f.default, meta['kind'])}, got {value!r}: {meta['retired']}")
    return v


def _show(x: float, kind: str) -> str:
    if kind == "size":
        for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
            if x >= factor and x % factor == 0:
                return f"{x // factor}{unit}"
    if isinstance(x, float):
        return str(int(x)) if x.is_integer() and abs(x) < 1e16 else f"{x:g}"
    return str(x)


MAX_REUSE_RATIO = float(1 << 20)
"""The largest ``reuse_max_ratio``: at 2**20 any cached stitched range may serve any request on a
device of up to 2 TiB (2**20 chunks of 2 MiB), so a larger ratio changes nothing, and 1e308 made
the chunk bound infinite (an ``OverflowError`` mid-replay, issue 37, item 1)."""


# -- the options of each allocator -----------------------------------------------------------------
_WHOLE_HANDLES = ("the CUDA driver maps a physical allocation only whole (cuMemMap of 2 MiB of a 20 MiB handle is "
                  "CUDA_ERROR_NOT_SUPPORTED on the H200), so paged makes one handle per page "
                  "(docs/architecture.md, Note [whole handles])")

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
        """Checks that need the device (capacity and page size); subclasses add theirs.
        Raises :class:`~vmstoolkit.errors.ConfigError` naming the option. Runtime complexity: O(1)."""

    @classmethod
    def keys(cls) -> list[str]:
        """The option names, in field order. Runtime complexity: O(fields)."""
        return [f.name for f in fields(cls)]

    @classmethod
    def describe(cls) -> dict[str, str]:
        """``{key: "kind, default X: help"}`` for help texts. Runtime complexity: O(fields)."""
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
    """How the stitching allocators decide (:class:`~vmstoolkit.pools.vmm.allocator.VMMAllocator`).
    Defaults here are ``gmlake``'s (GMLake's published ones); ``vms`` has its own (:class:`VmsOptions`)."""

    noun: ClassVar[str] = "stitch policy option"

    stitch_min_bytes: int = option(512 * MiB, "size", "requests smaller than this never trigger a new stitch "
                                   "(unless memory is full)", min=0)
    reuse_max_ratio: float = option(10.0, "float", "a cached stitched block serves a request only if at most "
                                    "this many times larger (only with stitched_prefix=false: a prefix of it is taken first)", min=1.0, max=MAX_REUSE_RATIO)
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
        """``small_size`` fits one chunk of the driver (its granularity). Runtime complexity: O(1); no
        driver call."""
        if self.small_size > granularity:
            raise ConfigError(f"small_size must be at most the driver's granularity ({granularity} bytes), "
                              f"got {self.small_size}")


@dataclass(frozen=True)
class GMLakeOptions(StitchOptions):
    """``gmlake``: GMLake's published defaults."""


@dataclass(frozen=True)
class VmsOptions(StitchOptions):
    """``vms``: our policy, from the sweep of ``experiments/vms_policy.py`` (``docs/results.md#vms-policy``).
    Figures: utilization on the four H200 traces ckpt/full/lora/offload, and the driver time of
    steady state (each trace's six steps replayed eight times in a row; mean per replay over the
    third to eighth) modelled with the H200's measured call costs.

    - ``stitch_min_bytes=0``: stitch every large request. GMLake's 512 MiB threshold strands the
      free blocks of the many smaller activations and creates new blocks beside them: 0.66/0.72/
      0.79/0.64 (gmlake, one replay; 0.39-0.60 over eight), 0.91/0.98/0.99/0.90 with a 64 MiB
      threshold, 0.987/0.995/0.986/0.987 here.
    - ``coalesce=True``: a freed primitive block merges with its free neighbours of the same range
      (when no cached stitched range would be cut by it). Without merging, splits only ever make
      blocks smaller, so more and more requests need a new stitch: 324/424/58/198 ms per replay
      without, 137/128/5/136 ms with, utilization unchanged.
    - ``stitched_prefix=True``: a request smaller than a cached stitched range whose first chunks
      are free takes those chunks (already mapped and accessible): no waste and no driver call,
      where a new stitch would map and set access on every chunk again; the range's later parts may
      be in use by others meanwhile. Without prefixes: 436/324/52/276 ms.
    - ``max_cached_stitched=256``: cached ranges stop merges (a merge may not cut a range's part),
      so with 1024 of them fragmentation creeps up replay after replay: 180/118/5/254 ms on average
      and 294/109/0/425 ms by the eighth replay; 256 stays level (137/128/5/136, eighth
      136/132/0/160); 128 is level on three traces and climbs on full (255 ms by the eighth).
    - ``reuse_max_ratio=1.0``: with prefixes a larger range is never handed out whole, so the
      ratio no longer matters; without prefixes GMLake's 10x costs up to 5 points of utilization.
    - ``selection="best-fit"``: the smallest free block that covers what is still missing, else
      the largest. Largest-first has the same utilization and more driver time (163/151/6/153 ms).

    GMLake with its defaults spends less driver time in steady state (53/85/12/54 ms) only because
    it has stopped reusing: it holds 1.7-2.6x the memory by then (utilization 0.39-0.60).
    """

    stitch_min_bytes: int = option(0, "size", "requests smaller than this never trigger a new stitch", min=0)
    reuse_max_ratio: float = option(1.0, "float", "a cached stitched block serves a request only if at most "
                                    "this many times larger (only with stitched_prefix=false: a prefix of it is taken first)", min=1.0, max=MAX_REUSE_RATIO)
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
    grow_pages: int = option(1, "int", "retired (takes only 1): pages per cuMemCreate", min=1, max=1 << 16,
                             retired=_WHOLE_HANDLES)
    map_runs: bool = option(False, "bool", "retired (takes only false): one cuMemMap per run of a grow_pages "
                            "handle", retired=_WHOLE_HANDLES)
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
        """The page is a power of two of at least 512 B, the ranges hold whole pages, ``large_unit``
        fits a page, and the heaps' host arrays (:func:`paged_host_bytes`) fit
        :data:`PAGED_MAX_HOST_BYTES`. Runtime complexity: O(1)."""
        if granularity & (granularity - 1) or granularity < 512:
            raise ConfigError(f"paged: the granularity {granularity} is not a power of two of at least 512 B")
        for key in ("va_bytes", "small_va_bytes"):
            if (getattr(self, key) or 0) % granularity:
                raise ConfigError(f"{key} must be a multiple of the page ({granularity} bytes), got {getattr(self, key)}")
        if self.large_unit is not None and self.large_unit > granularity:
            raise ConfigError(f"large_unit must be at most the page ({granularity} bytes), got {self.large_unit}")
        va = self.va_bytes or 2 * -(-capacity // granularity) * granularity
        need = paged_host_bytes(va, self.small_va_bytes, granularity, self.large_unit or granularity, self.max_blocks)
        if need > PAGED_MAX_HOST_BYTES:
            raise ConfigError(
                f"paged: a virtual range of {_show(va, 'size')} bytes ({va // granularity} pages"
                + ("" if self.va_bytes else f", twice the capacity {_show(capacity, 'size')}")
                + f"), small_va_bytes {self.small_va_bytes} and max_blocks {self.max_blocks} need {need / GiB:.1f} GiB "
                  f"of host arrays, more than the {PAGED_MAX_HOST_BYTES // GiB} GiB allowed; lower the capacity or set "
                  f"va_bytes, small_va_bytes or max_blocks")


def paged_host_bytes(va_bytes: int, small_va_bytes: int, page: int, large_unit: int, max_blocks: int) -> int:
    """Host memory of ``paged``'s arrays (``pools/paged/heap.py``, ``allocator.py``), in bytes:
    per chunk 24 (chunk_live, nmaps, chunk_stack, out_pages, out_chunks), per page 8 (page_chunk,
    page_used), per unit 4 (block_at), per block record 37, for both heaps. Runtime complexity: O(1)."""
    chunks = va_bytes // page + small_va_bytes // page
    units = va_bytes // large_unit + small_va_bytes // 512
    return 24 * chunks + 8 * chunks + 4 * units + 2 * 37 * max_blocks


# -- the one syntax: [ALLOC:]KEY=VALUE[,KEY=VALUE...] ------------------------------------------------
_SEPARATOR = re.compile(r"([,+])")
_ITEM_USAGE = "KEY=VALUE[,KEY=VALUE...] or ALLOCATOR:KEY=VALUE[,KEY=VALUE...]"


def split_pairs(text: str, where: str = "options") -> list[tuple[str, str]]:
    """``"aliases=true,slack_pages=64"`` -> ``[("aliases", "true"), ("slack_pages", "64")]``.

    Pairs are separated by ``,``. ``+`` separates them too: an alias kept for the commands of
    old results (``paged:aliases=True+slack_pages=64``); new commands use ``,``. A piece without
    ``=`` belongs to the value before it, so values keep their own commas and pluses (PyTorch's
    ``config=max_split_size_mb:128,garbage_collection_threshold:0.6``, a float's ``1e+3``).
    Raises :class:`~vmstoolkit.errors.ConfigError` naming ``where`` and the piece otherwise, and
    for a key given twice. Runtime complexity: O(length of ``text``).

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
    pairs: dict[str, str] = {}
    for piece in pieces:
        key, eq, value = piece.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"{where}: expected KEY=VALUE, got {piece!r}")
        if key in pairs:
            raise ConfigError(f"{where}: {key} is given twice ({pairs[key]!r}, then {value.strip()!r})")
        pairs[key] = value.strip()
    return list(pairs.items())


def parse_option_item(item: str) -> tuple[str | None, list[tuple[str, str]]]:
    """One ``-o`` item: ``"vms:reuse_max_ratio=2,coalesce=false"`` -> ``("vms", [("reuse_max_ratio",
    "2"), ("coalesce", "false")])``; no prefix -> ``None``.

    The prefix is what stands before the last ``:`` of the first key (values may hold ``:``,
    as PyTorch's ``config=max_split_size_mb:128`` does). Runtime complexity: O(length of ``item``)."""
    head, eq, rest = item.partition("=")
    alloc, colon, key = head.rpartition(":")
    if not eq or not key.strip() or (colon and not alloc.strip()):
        raise ConfigError(f"--option takes {_ITEM_USAGE}, got {item!r}")
    return (alloc.strip() or None), split_pairs(key + eq + rest, f"option {item!r}")


def split_option_item(item: str) -> tuple[str | None, str, str]:
    """``"vms:reuse_max_ratio=2"`` -> ``("vms", "reuse_max_ratio", "2")``: an item of one pair
    (:func:`parse_option_item` takes several). Runtime complexity: O(length of ``item``)."""
    alloc, pairs = parse_option_item(item)
    if len(pairs) != 1:
        raise ConfigError(f"expected one KEY=VALUE, got {len(pairs)} in {item!r}")
    return (alloc, *pairs[0])


def format_options(options: Mapping[str, Any], sep: str = " ") -> str:
    """``{"reuse_max_ratio": 2.0, "coalesce": False}`` -> ``"reuse_max_ratio=2.0 coalesce=false"``
    (re-usable as ``-o`` items; ``sep=","``: as one item; empty for an allocator's defaults).
    Runtime complexity: O(options)."""
    def show(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    return sep.join(f"{k}={show(v)}" for k, v in options.items())


__all__ = [
    "AllocatorOptions", "NoOptions", "StitchOptions", "GMLakeOptions", "VmsOptions", "PyTorchCachingOptions",
    "PyTorchExpandableOptions", "PagedOptions", "MAX_REUSE_RATIO", "PAGED_MAX_HOST_BYTES", "split_pairs",
    "parse_option_item", "split_option_item", "format_options", "paged_host_bytes",
]
