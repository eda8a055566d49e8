"""Every public function and method in ``vmstoolkit/pools/`` has a docstring (issue 35 item 8:
the protocol and the pools' public methods state their cost, as sortedcontainers does)."""

import ast
from pathlib import Path

import vmstoolkit.pools

POOLS = Path(vmstoolkit.pools.__file__).parent


def _public_functions_without_docstrings(tree: ast.Module, where: str) -> list[str]:
    missing = []

    def walk(node, prefix):
        for n in ast.iter_child_nodes(node):
            if isinstance(n, ast.ClassDef) and not n.name.startswith("_"):
                walk(n, f"{prefix}{n.name}.")
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_"):
                if ast.get_docstring(n) is None:
                    missing.append(f"{where}:{n.lineno} {prefix}{n.name}")

    walk(tree, "")
    return missing


def test_every_public_function_in_pools_has_a_docstring():
    missing = []
    for path in sorted(POOLS.rglob("*.py")):
        missing += _public_functions_without_docstrings(ast.parse(path.read_text()), str(path.relative_to(POOLS)))
    assert not missing, f"{len(missing)} public functions in pools/ without a docstring:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_docstring():
    tree = ast.parse("class A:\n    def f(self):\n        '''doc'''\n    def g(self):\n        pass\n"
                     "    def _h(self):\n        pass\ndef k():\n    pass\n")
    assert _public_functions_without_docstrings(tree, "x.py") == ["x.py:4 A.g", "x.py:8 k"]


def test_the_protocol_states_its_costs():
    from vmstoolkit.pools.base import Allocator

    for name in ("allocate", "free", "record_stream", "stats", "stats_of", "empty_cache", "close", "size_of",
                 "live_allocations", "reset_peak_stats", "reset_accumulated_stats", "export_counters",
                 "report_compiled", "note_oom", "stream_home", "block_streams", "path_counts", "compiled_replay"):
        doc = getattr(Allocator, name).__doc__
        assert "complexity" in doc or "Cost" in doc, name
