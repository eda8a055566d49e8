"""One error family: every exception vmstoolkit defines is a VmsError, and bad input raises one."""

import importlib
import inspect
import pkgutil

import pytest

import vmstoolkit
from vmstoolkit.errors import ConfigError, InvalidSizeError, VmsError
from vmstoolkit.pools import make_driver, register_allocator
from vmstoolkit.units import parse_size

CONTROL_FLOW = {
    "vmstoolkit.trace.snapshot.Fallback",  # the loader's fast path hands over to the exact one; never escapes
    "vmstoolkit.exec.compiler._Fragmented",  # the compiler retries a placement; never escapes
}


def _modules():
    for m in pkgutil.walk_packages(vmstoolkit.__path__, "vmstoolkit."):
        if m.name.startswith("vmstoolkit._record_boot") or m.name == "vmstoolkit.__main__":
            continue  # run code when imported (the record command's boot file; the CLI)
        yield importlib.import_module(m.name)


def test_every_exception_vmstoolkit_defines_is_a_vms_error():
    outside = set()
    for mod in _modules():
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == mod.__name__:
                if not issubclass(obj, VmsError):
                    outside.add(f"{mod.__name__}.{name}")
    assert outside <= CONTROL_FLOW, f"not VmsError: {sorted(outside - CONTROL_FLOW)}"


@pytest.mark.parametrize("call, kind", [
    (lambda: parse_size("12 parsecs"), InvalidSizeError),
    (lambda: parse_size(-1), InvalidSizeError),
    (lambda: make_driver("sim").create(3), InvalidSizeError),
    (lambda: make_driver("sim").reserve(0), InvalidSizeError),
    (lambda: make_driver("sim").mem_alloc(0), InvalidSizeError),
    (lambda: make_driver("sim").fail_on("teleport", 1), ConfigError),
    (lambda: register_allocator("vms", "again")(lambda driver: None), ConfigError),
])
def test_bad_input_raises_a_member_of_the_family_that_is_still_a_value_error(call, kind):
    with pytest.raises(kind) as e:
        call()
    assert isinstance(e.value, VmsError) and isinstance(e.value, ValueError)


def test_no_product_module_raises_a_bare_builtin_error():
    """Bad input and failed operations raise family members (with ``ValueError`` or
    ``RuntimeError`` as a second base where callers catch those), never the bare builtins."""
    import ast
    from pathlib import Path

    bare = []
    root = Path(vmstoolkit.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name) \
                    and node.exc.func.id in ("ValueError", "RuntimeError"):
                bare.append(f"{path.relative_to(root)}:{node.lineno} {node.exc.func.id}")
    assert bare == [], bare
