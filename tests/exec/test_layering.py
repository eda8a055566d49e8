"""The runtime sits below the integrations and the CLI: nothing in ``vmstoolkit/exec`` imports
them (issue 19, layering leaks)."""

import ast
from pathlib import Path

import vmstoolkit.exec

HIGHER = ("vmstoolkit.integrations", "vmstoolkit.cli")


def imported_modules(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_exec_imports_nothing_from_a_higher_layer():
    root = Path(vmstoolkit.exec.__file__).parent
    leaks = [f"{p.relative_to(root)}: {m}" for p in sorted(root.rglob("*.py")) for m in imported_modules(p)
             if m.startswith(HIGHER)]
    assert leaks == []
