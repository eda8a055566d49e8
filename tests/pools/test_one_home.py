"""One home per option set and one name table (issue 35, items 1 and 5).

The options of an allocator are converted, checked and defaulted by its options class only
(``pools/options.py``); the registry is the only table of allocator names. These tests read the
package's source (AST), so a second home fails them the day it is written.
"""

import ast
import inspect
from pathlib import Path

import pytest

import vmstoolkit
from vmstoolkit.pools import registry
from vmstoolkit.pools.options import AllocatorOptions

ROOT = Path(vmstoolkit.__file__).parent
NAMES = set(registry.allocator_names())
# Calls that check or convert an option value; only the options module and the registry make them
# for allocator options (the driver and the CLI's flags parse their own sizes).
CHECKS = {"parse_size", "check_allocator", "check_options", "options_for", "resolve_option_items", "replace"}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _allocator_modules():
    """The source files of every registered factory (and of the classes it builds on)."""
    files = set()
    for name in NAMES:
        factory = registry.registration(name).factory
        for obj in inspect.getmro(factory) if inspect.isclass(factory) else (factory,):
            mod = inspect.getmodule(obj)
            if mod is not None and mod.__name__.startswith("vmstoolkit.pools"):
                files.add(Path(mod.__file__))
    return sorted(files - {Path(inspect.getfile(registry)), Path(inspect.getfile(AllocatorOptions)),
                           ROOT / "pools" / "base.py"})


@pytest.mark.parametrize("path", _allocator_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_allocators_neither_check_nor_convert_their_options(path):
    """No allocator module raises a ConfigError or converts a value: it receives the checked
    dataclass. (Before: ``StitchPolicy.__post_init__``, ``vmm/allocator._policy`` and
    ``PagedAllocator.__init__`` re-checked what ``options.py`` had checked.)"""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None and "ConfigError" in ast.unparse(node.exc):
            found.append(f"line {node.lineno}: {ast.unparse(node.exc)[:80]}")
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in CHECKS:
                found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
        if isinstance(node, ast.Attribute) and node.attr == "__dataclass_fields__":
            found.append(f"line {node.lineno}: reads __dataclass_fields__")
    assert not found, f"{path.name} checks options outside their dataclass: {found}"


@pytest.mark.parametrize("name", sorted(NAMES))
def test_factories_take_the_checked_options_object(name):
    """Every factory is called as ``factory(driver, options)``: no ``**options`` of its own."""
    entry = registry.registration(name)
    assert issubclass(entry.options, AllocatorOptions)
    factory = entry.factory.__init__ if inspect.isclass(entry.factory) else entry.factory
    params = [p for p in inspect.signature(factory).parameters.values() if p.name != "self"]
    assert len(params) >= 2 and params[1].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, params



@pytest.mark.parametrize("name", sorted(NAMES))
def test_the_registry_hands_factories_the_checked_object(name, monkeypatch):
    entry = registry.registration(name)
    got = []

    def spy(driver, options):
        got.append(options)
        return entry.factory(driver, options)

    monkeypatch.setitem(registry._REGISTRY, name, entry._replace(factory=spy))
    registry.make_allocator(name).close()
    assert type(got[0]) is entry.options


def _is_name(node) -> bool:
    return isinstance(node, ast.Constant) and node.value in NAMES


def _names_in(node) -> int:
    return sum(map(_is_name, node.elts)) if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else 0


def _tables(tree, where: str) -> list[str]:
    """Name tables and name checks in ``tree``."""
    found = []
    for node in ast.walk(tree):
        at = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Dict) and sum(_is_name(k) for k in node.keys if k is not None) >= 2:
            found.append(f"{at} dict keyed by allocator names")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_in(s) >= 2 for s in sides):
                found.append(f"{at} {ast.unparse(node)[:70]}")
            elif any(map(_is_name, sides)):
                other = " ".join(ast.unparse(s) for s in sides if not _is_name(s))
                if "alloc" in other or "name" in other:
                    found.append(f"{at} {ast.unparse(node)[:70]}")
        if isinstance(node, ast.Assign) and _names_in(node.value) >= 2 and not any(
                "DEFAULT" in ast.unparse(t) for t in node.targets):
            found.append(f"{at} {ast.unparse(node)[:70]}")
    return found


def test_the_registry_is_the_only_name_table():
    """No dict keyed by allocator names and no name check (``name in ("pytorch-caching", ...)``,
    ``allocator == "paged"``) outside the registry. What an allocator does differently is an
    attribute of its class, asked of the registry (``compiled_hook``, ``recorded_settings_option``).
    Default choices (``DEFAULT_ALLOCATORS``, the allocators a command runs) are lists, not tables."""
    skip = Path(inspect.getfile(registry))
    found = [f for path, tree in _modules() if path != skip for f in _tables(tree, str(path.relative_to(ROOT)))]
    assert not found, f"allocator names tabled outside the registry: {found}"


def test_the_scan_sees_the_tables_that_were_there():
    """The shapes of ``options.OPTIONS``, ``trace/settings.PYTORCH_SIMULATIONS`` and a name check."""
    code = ('OPTIONS = {"native": NoOptions, "vms": VmsOptions}\n'
            'PYTORCH_SIMULATIONS = ("pytorch-caching", "pytorch-expandable")\n'
            'def f(allocator):\n    return allocator == "paged" or allocator in ("gmlake", "vms")\n'
            'DEFAULT_ALLOCATORS = ("gmlake", "vms")\n')
    assert len(_tables(ast.parse(code), "x")) == 4
