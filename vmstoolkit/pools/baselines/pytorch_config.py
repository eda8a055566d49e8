"""``PYTORCH_CUDA_ALLOC_CONF``-style configuration of the simulated PyTorch allocators.

The string is read the way PyTorch reads it (``c10/core/AllocatorConfig.cpp``): tokens split on
``,`` ``:`` ``[`` ``]``, spaces ignored, ``key:value`` pairs separated by commas::

    max_split_size_mb:128,roundup_power2_divisions:4,garbage_collection_threshold:0.8
    roundup_power2_divisions:[256:1,512:2,>:8],expandable_segments:True

Options that decide reserved memory are simulated (``max_split_size_mb``,
``max_non_split_rounding_mb``, ``roundup_power2_divisions``, ``garbage_collection_threshold``,
``per_process_memory_fraction``, ``expandable_segments``); options that only change threading,
pinned host memory or locking are accepted and recorded in :attr:`PyTorchAllocConfig.inert`.
Anything else, and any malformed value, raises :class:`~vmstoolkit.errors.ConfigError` naming
the key and the value.

>>> c = parse_alloc_conf("max_split_size_mb:128, roundup_power2_divisions:4")
>>> c.max_split_size, c.divisions_for(3 << 20)
(134217728, 4)
>>> parse_alloc_conf("max_split_size_mb:lots")
Traceback (most recent call last):
...
vmstoolkit.errors.ConfigError: max_split_size_mb: expected an integer number of MiB, got 'lots'
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vmstoolkit.errors import ConfigError
from vmstoolkit.units import MiB

UNLIMITED = (1 << 64) - 1
"""``std::numeric_limits<size_t>::max()``: PyTorch's "no max_split_size" value."""

K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer: also the smallest max_split_size_mb PyTorch accepts
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: one division count per power of two, 1 MiB .. 32 GiB
ROUNDUP_FIRST_LOG2 = 20  # the first interval starts at 1 MiB (2**20)

# Options PyTorch accepts that change nothing a trace replay can see (threads, locks, pinned
# host memory, IPC): kept so real configuration strings parse, reported as inert.
_INERT_BOOL = ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
               "pinned_use_hip_host_register", "pinned_use_background_threads", "graph_capture_record_stream_reuse")
_INERT_INT = ("pinned_num_register_threads", "pinned_reserve_segment_size_mb")


@dataclass
class PyTorchAllocConfig:
    """The allocator settings that decide what the simulated PyTorch allocators reserve.

    Defaults are PyTorch's defaults (nothing configured).
    """

    max_split_size: int = UNLIMITED
    """Blocks at least this large are never split, and serve only requests within
    ``max_non_split_rounding_size`` of their size (``max_split_size_mb``)."""
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    """How much larger than a request an oversize cached block may be (``max_non_split_rounding_mb``)."""
    roundup_power2_divisions: list[int] = field(default_factory=lambda: [0] * ROUNDUP_INTERVALS)
    """Per power-of-two interval (1 MiB, 2 MiB, ... 32 GiB and up): round sizes up to this many
    divisions of the interval (0 or 1: plain 512-byte rounding)."""
    garbage_collection_threshold: float = 0.0
    """Free old unsplit cached blocks once reserved exceeds this fraction of the allowed memory
    (only with ``per_process_memory_fraction``, as in PyTorch)."""
    per_process_memory_fraction: float | None = None
    """``torch.cuda.set_per_process_memory_fraction``: cap reserved memory at this fraction of the device."""
    expandable_segments: bool = False
    inert: dict[str, str] = field(default_factory=dict)
    """Accepted options that do not affect a simulation, with their values."""
    source: str = ""

    def divisions_for(self, size: int) -> int:
        """The roundup divisions that apply to ``size`` (the interval of its power of two). Runtime
        complexity: O(1)."""
        index = max(0, size.bit_length() - 1 - ROUNDUP_FIRST_LOG2)
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]

    def to_string(self) -> str:
        """A configuration string that parses back to this configuration. Runtime complexity: O(1)
        (a fixed number of options and roundup intervals, plus the inert ones)."""
        parts = []
        if self.max_split_size != UNLIMITED:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        if self.max_non_split_rounding_size != K_LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_size // MiB}")
        if any(self.roundup_power2_divisions):
            pairs = ",".join(f"{1 << i}:{d}" for i, d in enumerate(self.roundup_power2_divisions))
            parts.append(f"roundup_power2_divisions:[{pairs}]")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        if self.per_process_memory_fraction is not None:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        parts.extend(f"{k}:{v}" for k, v in self.inert.items())
        return ",".join(parts)


def _lex(text: str) -> list[str]:
    """PyTorch's lexer: ``, : [ ]`` are tokens of their own, spaces vanish."""
    tokens: list[str] = []
    buf = []
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif ch != " ":
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class _Tokens:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _lex(text)
        self.i = 0

    def more(self) -> bool:
        return self.i < len(self.toks)

    def take(self, what: str) -> str:
        if self.i >= len(self.toks):
            raise ConfigError(f"{what}: missing value at the end of {self.text!r}")
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def expect(self, ch: str, key: str) -> None:
        tok = self.take(key)
        if tok != ch:
            raise ConfigError(f"{key}: expected {ch!r}, got {tok!r} in {self.text!r}")

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None


def _int(key: str, tok: str, what: str = "an integer") -> int:
    try:
        return int(tok)
    except ValueError:
        raise ConfigError(f"{key}: expected {what}, got {tok!r}") from None


def _bool(key: str, tok: str) -> bool:
    if tok not in ("True", "False"):
        raise ConfigError(f"{key}: expected True or False, got {tok!r}")
    return tok == "True"


def _mb_at_least_large_buffer(key: str, tok: str) -> int:
    mb = _int(key, tok, "an integer number of MiB")
    if mb < K_LARGE_BUFFER // MiB:
        raise ConfigError(f"{key}: {mb} is too small, must be >= {K_LARGE_BUFFER // MiB}")
    return min(mb * MiB, UNLIMITED // MiB * MiB)


def _parse_divisions(t: _Tokens, cfg: PyTorchAllocConfig) -> None:
    key = "roundup_power2_divisions"
    tok = t.take(key)
    if tok != "[":  # one count for every interval
        n = _int(key, tok)
        if not _is_pow2(n):
            raise ConfigError(f"{key}: divisions must be a power of 2, got {tok!r}")
        cfg.roundup_power2_divisions = [n] * ROUNDUP_INTERVALS
        return
    divs = cfg.roundup_power2_divisions
    first = True
    last_index = 0
    while True:
        interval = t.take(key)
        if interval == "]":
            return
        t.expect(":", key)
        value_tok = t.take(key)
        n = _int(key, value_tok)
        if n != 0 and not _is_pow2(n):
            raise ConfigError(f"{key}: divisions must be a power of 2 or 0, got {interval}:{value_tok}")
        if interval == ">":
            # As PyTorch does: fill from the last named interval (itself included) to the end.
            for j in range(last_index, ROUNDUP_INTERVALS):
                divs[j] = n
        else:
            mb = _int(key, interval, "an interval in MiB (a power of 2) or '>'")
            if not _is_pow2(mb):
                raise ConfigError(f"{key}: interval {interval!r} is not a power of 2 (MiB)")
            index = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:  # the first named interval also covers every smaller one
                for j in range(index):
                    divs[j] = n
                first = False
            divs[index] = n
            last_index = index
        sep = t.peek()
        if sep == ",":
            t.take(key)
        elif sep != "]":
            raise ConfigError(f"{key}: expected ',' or ']' after {interval}:{value_tok}, got {sep!r}")


def parse_alloc_conf(text: str | None) -> PyTorchAllocConfig:
    """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string (``None`` or ``""``: PyTorch's defaults).

    Raises :class:`~vmstoolkit.errors.ConfigError` naming the unknown key or the bad value.
    Runtime complexity: O(len(text)).
    """
    cfg = PyTorchAllocConfig(source=text or "")
    if not text:
        return cfg
    if not isinstance(text, str):
        raise ConfigError(f"allocator configuration must be a string like 'max_split_size_mb:128', got {text!r}")
    t = _Tokens(text)
    seen: set[str] = set()
    while t.more():
        key = t.take("configuration")
        if key in ",:[]":
            raise ConfigError(f"expected an option name, got {key!r} in {text!r}")
        if key in seen:
            raise ConfigError(f"{key}: given twice in {text!r}")
        seen.add(key)
        t.expect(":", key)
        if key == "roundup_power2_divisions":
            _parse_divisions(t, cfg)
        else:
            value = t.take(key)
            if key == "max_split_size_mb":
                cfg.max_split_size = _mb_at_least_large_buffer(key, value)
            elif key == "max_non_split_rounding_mb":
                cfg.max_non_split_rounding_size = _mb_at_least_large_buffer(key, value)
            elif key == "garbage_collection_threshold":
                try:
                    x = float(value)
                except ValueError:
                    raise ConfigError(f"{key}: expected a number in (0, 1), got {value!r}") from None
                if not 0.0 < x < 1.0:
                    raise ConfigError(f"{key}: must be in (0.0, 1.0), got {value!r}")
                cfg.garbage_collection_threshold = x
            elif key == "per_process_memory_fraction":
                try:
                    x = float(value)
                except ValueError:
                    raise ConfigError(f"{key}: expected a number in (0, 1], got {value!r}") from None
                if not 0.0 < x <= 1.0:
                    raise ConfigError(f"{key}: must be in (0.0, 1.0], got {value!r}")
                cfg.per_process_memory_fraction = x
            elif key == "expandable_segments":
                cfg.expandable_segments = _bool(key, value)
            elif key == "backend":
                if value == "cudaMallocAsync":
                    raise ConfigError("backend: cudaMallocAsync is not simulated (only 'native')")
                if value != "native":
                    raise ConfigError(f"backend: unknown allocator backend {value!r} (options are native and cudaMallocAsync)")
            elif key in _INERT_BOOL:
                _bool(key, value)
                cfg.inert[key] = value
            elif key in _INERT_INT:
                n = _int(key, value)
                if key == "pinned_num_register_threads" and not _is_pow2(n):
                    raise ConfigError(f"{key}: must be a power of 2, got {value!r}")
                cfg.inert[key] = value
            else:
                raise ConfigError(f"unrecognized allocator option {key!r} in {text!r}")
        nxt = t.peek()
        if nxt is not None:
            if nxt != ",":
                raise ConfigError(f"{key}: expected ',' before {nxt!r} in {text!r}")
            t.take(key)
            if not t.more():
                raise ConfigError(f"trailing ',' in {text!r}")
    return cfg


def as_config(config: str | PyTorchAllocConfig | None) -> PyTorchAllocConfig:
    """A :class:`PyTorchAllocConfig` from a string, a config, or ``None`` (defaults). Runtime
    complexity: O(1) for a config, :func:`parse_alloc_conf`'s for a string."""
    if isinstance(config, PyTorchAllocConfig):
        return config
    return parse_alloc_conf(config)
