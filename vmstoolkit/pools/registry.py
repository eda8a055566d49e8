"""Allocators by name: the one table the CLI, replay, sweeps and integrations look names up in.

Each allocator registers once, with its options class (:mod:`vmstoolkit.pools.options`)::

    @register_allocator("vms", VmsOptions, "our VMM stitching policy: ...")
    def make_vms(driver, options: VmsOptions) -> VMMAllocator: ...

The factory is called as ``factory(driver, options)`` with the checked options object: it neither
checks nor defaults an option again. What the registry knows of a name (its factory, its options
class, its description, and the attributes its factory carries: ``compiled_hook``,
``recorded_settings_option``) is asked of it here, never by comparing names elsewhere.

>>> spec = parse_allocator_spec("vms:reuse_max_ratio=2"); spec.options
{'reuse_max_ratio': 2.0}
>>> resolve_option_items(["reuse_max_ratio=2", "pytorch-caching:config=max_split_size_mb:128"],
...                      ["pytorch-caching", "vms"])
{'pytorch-caching': {'config': 'max_split_size_mb:128'}, 'vms': {'reuse_max_ratio': 2.0}}
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, NamedTuple

from vmstoolkit.errors import ConfigError
from vmstoolkit.pools.base import Allocator
from vmstoolkit.pools.constants import PAGE
from vmstoolkit.pools.drivers import VMMDriver, make_driver
from vmstoolkit.pools.options import AllocatorOptions, NoOptions, format_options, parse_option_item


class Registration(NamedTuple):
    """One registered allocator: how to build it, its options class, one line on what it is."""

    factory: Callable[[VMMDriver, AllocatorOptions], Allocator]
    options: type[AllocatorOptions]
    description: str


_REGISTRY: dict[str, Registration] = {}


def register_allocator(name: str, options: type[AllocatorOptions] | str = NoOptions, description: str | None = None):
    """Class or factory decorator: make ``name`` available to :func:`make_allocator`, with its
    options class ``options`` (default :class:`~vmstoolkit.pools.options.NoOptions`) and a one-line
    ``description`` (default: the first line of the options class's docstring).

    The factory is called as ``factory(driver, options)``, ``options`` an instance of the options
    class, already checked (against the driver too: ``check_for_driver``). The older form
    ``register_allocator(name, description)`` still works, for an allocator without options.
    Runtime complexity: O(1).
    """
    if isinstance(options, str):  # register_allocator(name, description): the form before options classes
        options, description = NoOptions, options
    if not (isinstance(options, type) and issubclass(options, AllocatorOptions)):
        raise ConfigError(f"allocator {name!r}: its options must be an AllocatorOptions class, got {options!r}")
    text = description or (options.__doc__ or name).strip().splitlines()[0]

    def deco(factory):
        if name in _REGISTRY:
            raise ConfigError(f"allocator {name!r} registered twice")
        _REGISTRY[name] = Registration(factory, options, text)
        return factory

    return deco


def registration(name: str) -> Registration:
    """What is registered under ``name``; an unknown name raises
    :class:`~vmstoolkit.errors.ConfigError` listing the known ones. Runtime complexity: O(1)."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ConfigError(f"unknown allocator {name!r}; choose one of: {', '.join(_REGISTRY)}")
    return entry


def options_class(name: str) -> type[AllocatorOptions]:
    """The options class allocator ``name`` registered with. Runtime complexity: O(1)."""
    return registration(name).options


def compiled_hook(name: str) -> str | None:
    """``"module:Class"`` of the compiled PyTorch hook that serves allocator ``name``, or None
    (served through Python callbacks); see :attr:`~vmstoolkit.pools.base.Allocator.compiled_hook`.
    Runtime complexity: O(1)."""
    return getattr(registration(name).factory, "compiled_hook", None)


def recorded_settings_option(name: str) -> str | None:
    """The option of allocator ``name`` that takes the allocator settings a snapshot recorded
    (:mod:`vmstoolkit.trace.settings`), or None when it takes none; see
    :attr:`~vmstoolkit.pools.base.Allocator.recorded_settings_option`. Runtime complexity: O(1)."""
    return getattr(registration(name).factory, "recorded_settings_option", None)


def allocator_names() -> list[str]:
    """Every registered name, in registration order. Runtime complexity: O(allocators)."""
    return list(_REGISTRY)


def describe_allocators() -> dict[str, str]:
    """``{name: description}`` of every registered allocator. Runtime complexity: O(allocators)."""
    return {name: entry.description for name, entry in _REGISTRY.items()}


# -- checking options ------------------------------------------------------------------------------
def takers(key: str, names: Iterable[str] | None = None) -> list[str]:
    """The allocators (of ``names``, default every registered one) that take option ``key``.
    Runtime complexity: O(allocators x options)."""
    return [n for n in (_REGISTRY if names is None else names) if key in registration(n).options.keys()]


def options_for(name: str, options: Mapping[str, Any], *, capacity: int | None = None,
                granularity: int | None = None) -> AllocatorOptions:
    """The checked options object of allocator ``name`` (its defaults where ``options`` has no
    key); with ``capacity``, checked against the device too (``check_for_driver``). Raises
    :class:`~vmstoolkit.errors.ConfigError` naming the allocator, the key and the value.
    Runtime complexity: O(options)."""
    cls = options_class(name)
    for key in options:
        if key not in cls.keys():
            others = [n for n in takers(key) if n != name]
            where = f"; it is an option of {', '.join(others)}" if others else ""
            raise ConfigError(f"bad options for allocator {name!r}: unknown {cls.noun} {key!r}{where} "
                              f"({name} takes: {', '.join(cls.keys()) or 'none'})")
    try:
        obj = cls(**options)
        if capacity is not None:
            obj.check_for_driver(capacity, granularity or PAGE)
    except ConfigError as e:
        raise ConfigError(f"bad options for allocator {name!r}: {e}") from None
    return obj


def check_allocator(name: str, options: Mapping[str, Any], *, capacity: int | None = None,
                    granularity: int | None = None) -> dict:
    """``options`` of allocator ``name`` converted and checked (:func:`options_for`), as keywords
    (only the keys given: a row names what was chosen, the defaults stay with the class), without
    building anything. Runtime complexity: O(options)."""
    obj = options_for(name, options, capacity=capacity, granularity=granularity)
    return {k: getattr(obj, k) for k in options}


def resolve_option_items(items: Iterable[str] | None, allocators: list[str], *, capacity: int | None = None,
                         granularity: int | None = None) -> dict[str, dict]:
    """Per allocator of ``allocators``, its checked options from ``-o`` items (each one or more
    pairs separated by ``,``: :func:`~vmstoolkit.pools.options.parse_option_item`).

    ``KEY=VALUE`` goes to every chosen allocator that takes ``KEY`` (an error when none does,
    naming those that take it); ``ALLOC:KEY=VALUE`` to ``ALLOC`` only (an error when it is not
    among ``allocators``), where it wins over an unprefixed item whatever their order (set a key for
    all, and for one otherwise). A key given twice at the same level for one allocator is an
    error naming both values: nothing is silently overridden. With ``capacity``, checked against
    the device too.
    Runtime complexity: O(items + allocators x options).
    """
    raw: dict[str, dict] = {a: {} for a in allocators}
    prefixed: set[tuple[str, str]] = set()  # (allocator, key) set by an ALLOC:KEY item
    for a in allocators:
        registration(a)
    for item in items or []:
        alloc, pairs = parse_option_item(item)
        if alloc is not None and alloc not in raw:
            raise ConfigError(f"option {item!r} is for allocator {alloc!r}, which is not among the chosen "
                              f"allocators ({', '.join(allocators)})")
        for key, value in pairs:
            chosen = [alloc] if alloc is not None else takers(key, allocators)
            if not chosen:
                others = takers(key)
                raise ConfigError(f"unknown option {key!r} for {', '.join(allocators)}"
                                  + (f"; it is an option of {', '.join(others)}" if others else "; no allocator takes it"))
            for a in chosen:
                mine = alloc is not None
                if key in raw[a] and ((a, key) in prefixed) == mine:
                    raise ConfigError(f"option {key} is given twice for allocator {a!r} ({raw[a][key]!r}, then "
                                      f"{value!r}); give it once")
                if mine or (a, key) not in prefixed:
                    raw[a][key] = value
                if mine:
                    prefixed.add((a, key))
    return {a: check_allocator(a, opts, capacity=capacity, granularity=granularity) for a, opts in raw.items()}


def option_value(key: str, text: str, allocators: list[str]) -> Any:
    """``text`` as the value of option ``key``, converted and checked as ``-o KEY=TEXT`` is for
    every allocator of ``allocators`` that takes ``key`` (``sweep --grid`` reads its values so).
    Runtime complexity: O(allocators x options)."""
    checked = resolve_option_items([f"{key}={text}"], allocators)
    values = [opts[key] for opts in checked.values() if key in opts]
    return values[0]


def make_allocator(name: str, driver: VMMDriver | None = None, *, capacity: int | str | None = None,
                   **options) -> Allocator:
    """A new allocator ``name`` over ``driver`` (default: a fresh simulated driver of ``capacity``).

    ``options`` are converted and checked first (:mod:`vmstoolkit.pools.options`: ``"2"`` for a
    ratio, ``"64MiB"`` for a size), then against the driver's capacity and page size; a bad one
    raises :class:`~vmstoolkit.errors.ConfigError` naming it, before a driver is made. An error
    inside the factory itself (a ``TypeError`` included) surfaces as it is: it is a bug, not a bad
    option. Runtime complexity: O(options) plus the factory's.

    >>> a = make_allocator("native"); p = a.allocate(1000); a.free(p)
    """
    entry = registration(name)
    obj = options_for(name, options)
    if driver is None:
        driver = make_driver("sim", capacity=capacity)
    try:
        obj.check_for_driver(driver.capacity, driver.granularity)
    except ConfigError as e:
        raise ConfigError(f"bad options for allocator {name!r}: {e}") from None
    return entry.factory(driver, obj)


class AllocatorSpec(NamedTuple):
    """An allocator and its checked options, as :func:`parse_allocator_spec` reads them; ``str()``
    writes them back in the one syntax."""

    name: str
    options: dict

    def __str__(self) -> str:
        return self.name + (":" + format_options(self.options, sep=",") if self.options else "")


def parse_allocator_spec(text: str) -> AllocatorSpec:
    """``"paged:aliases=true,slack_pages=64"`` -> ``AllocatorSpec("paged", {"aliases": True,
    "slack_pages": 64})``; ``"vms"``: its defaults. The syntax of a prefixed ``-o`` item (and
    ``+`` between pairs, the old experiments' separator, as an alias:
    :func:`~vmstoolkit.pools.options.split_pairs`).

    The name must be a registered allocator and the options are converted and checked as
    :func:`~vmstoolkit.pools.make_allocator` checks them, without building anything; anything
    else raises :class:`~vmstoolkit.errors.ConfigError` naming it. Runtime complexity: O(length of ``text``).

    >>> parse_allocator_spec("paged:aliases=True+slack_pages=64") == parse_allocator_spec("paged:aliases=true,slack_pages=64")
    True
    >>> str(parse_allocator_spec("vms:reuse_max_ratio=2"))
    'vms:reuse_max_ratio=2.0'
    """
    t = text.strip()
    if "=" in t:
        name, pairs = parse_option_item(t)
    elif t and ":" not in t:
        name, pairs = t, []
    else:
        name, pairs = None, []
    if name is None:
        raise ConfigError(f"allocator spec {text!r}: expected NAME or NAME:KEY=VALUE[,KEY=VALUE...]")
    return AllocatorSpec(name, check_allocator(name, dict(pairs)))


__all__ = [
    "Registration", "register_allocator", "registration", "options_class", "compiled_hook", "recorded_settings_option",
    "allocator_names", "describe_allocators", "takers", "options_for", "check_allocator",
    "resolve_option_items", "option_value", "make_allocator", "AllocatorSpec", "parse_allocator_spec",
]
