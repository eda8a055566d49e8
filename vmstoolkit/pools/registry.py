"""Allocators by name: the one table the CLI, replay and integrations look names up in."""

from __future__ import annotations

from typing import Callable, NamedTuple

from vmstoolkit.errors import ConfigError
from vmstoolkit.pools.base import Allocator
from vmstoolkit.pools.drivers import VMMDriver, make_driver
from vmstoolkit.pools.options import check_options, format_options, parse_option_item

_FACTORIES: dict[str, Callable[..., Allocator]] = {}
_DESCRIPTIONS: dict[str, str] = {}


def register_allocator(name: str, description: str):
    """Class or factory decorator: make ``name`` available to :func:`make_allocator`.

    The factory is called as ``factory(driver, **options)``.
    """

    def deco(factory):
        if name in _FACTORIES:
            raise ConfigError(f"allocator {name!r} registered twice")
        _FACTORIES[name] = factory
        _DESCRIPTIONS[name] = description
        return factory

    return deco


def compiled_hook(name: str) -> str | None:
    """``"module:Class"`` of the compiled PyTorch hook that serves allocator ``name``, or None
    (served through Python callbacks); see :attr:`~vmstoolkit.pools.base.Allocator.compiled_hook`."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown allocator {name!r}; choose one of: {', '.join(_FACTORIES)}")
    return getattr(factory, "compiled_hook", None)


def allocator_names() -> list[str]:
    return list(_FACTORIES)


def describe_allocators() -> dict[str, str]:
    return dict(_DESCRIPTIONS)


def check_allocator(name: str, options: dict, *, capacity: int | None = None, granularity: int | None = None) -> dict:
    """``options`` of allocator ``name`` converted and checked, without building anything
    (:func:`vmstoolkit.pools.options.check_options`); an unknown name or a bad option raises
    :class:`~vmstoolkit.errors.ConfigError` naming it."""
    if name not in _FACTORIES:
        raise ConfigError(f"unknown allocator {name!r}; choose one of: {', '.join(_FACTORIES)}")
    if capacity is None:
        return check_options(name, options)
    return check_options(name, options, capacity=capacity, granularity=granularity)


def make_allocator(name: str, driver: VMMDriver | None = None, *, capacity: int | str | None = None, **options) -> Allocator:
    """A new allocator ``name`` over ``driver`` (default: a fresh simulated driver of ``capacity``).

    ``options`` are converted and checked first (:mod:`vmstoolkit.pools.options`: ``"2"`` for a
    ratio, ``"64MiB"`` for a size), against the driver's capacity and page size too; a bad one
    raises :class:`~vmstoolkit.errors.ConfigError` naming it. An error inside the factory itself
    (a ``TypeError`` included) surfaces as it is: it is a bug, not a bad option.

    >>> a = make_allocator("native"); p = a.allocate(1000); a.free(p)
    """
    options = check_allocator(name, options)
    if driver is None:
        driver = make_driver("sim", capacity=capacity)
    options = check_allocator(name, options, capacity=driver.capacity, granularity=driver.granularity)
    return _FACTORIES[name](driver, **options)


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
    else raises :class:`~vmstoolkit.errors.ConfigError` naming it. Cost: O(length of ``text``).

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
