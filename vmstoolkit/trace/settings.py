"""The allocator settings a snapshot recorded, as a ``PYTORCH_CUDA_ALLOC_CONF`` string for the
simulated PyTorch allocators (their ``config=`` option).

PyTorch records them in ``allocator_settings`` (``torch/csrc/cuda/Module.cpp``):
``max_split_size`` in bytes (-1 or ``SIZE_MAX``: unlimited), ``garbage_collection_threshold``,
``roundup_power2_divisions`` as ``{"1": n, "2": n, ... "32768": n}`` per MiB interval,
``expandable_segments``, and the last ``PYTORCH_CUDA_ALLOC_CONF`` string. The structured
fields win; the string adds only what they do not carry (``max_non_split_rounding_mb``).
``expandable_segments`` is left out: the allocator decides caching against expandable.
Which allocators take the settings, and as which option, is their class's
:attr:`~vmstoolkit.pools.base.Allocator.recorded_settings_option`.
"""

from __future__ import annotations

from vmstoolkit.errors import ConfigError
from vmstoolkit.pools.baselines.pytorch_config import K_LARGE_BUFFER, MiB, ROUNDUP_INTERVALS, parse_alloc_conf
from vmstoolkit.pools.registry import recorded_settings_option


def recorded_alloc_conf(settings: dict) -> str:
    """The configuration string of the recorded settings that change a simulation ("" if none)."""
    if not isinstance(settings, dict):
        return ""
    parts = []
    mss = settings.get("max_split_size")
    if type(mss) is int and 0 < mss < (1 << 63) - 1 and mss // MiB >= K_LARGE_BUFFER // MiB:
        parts.append(f"max_split_size_mb:{mss // MiB}")
    text = settings.get("PYTORCH_CUDA_ALLOC_CONF")
    if isinstance(text, str) and text.strip():
        try:
            cfg = parse_alloc_conf(text)
        except ConfigError:
            cfg = None
        if cfg is not None and cfg.max_non_split_rounding_size != K_LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{cfg.max_non_split_rounding_size // MiB}")
    gc = settings.get("garbage_collection_threshold")
    if type(gc) in (int, float) and 0.0 < gc < 1.0:
        parts.append(f"garbage_collection_threshold:{gc}")
    divs = settings.get("roundup_power2_divisions")
    if isinstance(divs, dict):
        pairs = []
        for i in range(ROUNDUP_INTERVALS):
            n = divs.get(str(1 << i), 0)
            pairs.append(n if type(n) is int and n >= 0 else 0)
        if any(pairs):
            parts.append("roundup_power2_divisions:[" + ",".join(f"{1 << i}:{n}" for i, n in enumerate(pairs)) + "]")
    return ",".join(parts)


def options_with_settings(allocator: str, options: dict | None, settings: dict) -> tuple[dict, str]:
    """``options`` with the recorded settings as the option the allocator takes them in (its
    class's ``recorded_settings_option``: ``config`` for the PyTorch simulations), unless
    ``options`` sets that option itself; and the string applied ("" when none)."""
    opts = dict(options or {})
    key = recorded_settings_option(allocator)
    if key is None or key in opts:
        return opts, ""
    conf = recorded_alloc_conf(settings)
    if conf:
        opts[key] = conf
    return opts, conf
