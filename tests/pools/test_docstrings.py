"""Every public function and method in ``vmstoolkit/pools/`` has a docstring, and the docstring states
its cost (issue 35 item 8: the protocol and the pools' public methods state their cost, as
sortedcontainers does)."""

import ast
import re
from pathlib import Path

import vmstoolkit.pools

POOLS = Path(vmstoolkit.pools.__file__).parent
COST = re.compile(r"complexity|Cost|O\(")
"""How a docstring states a cost: ``Runtime complexity: O(log(n))`` (sortedcontainers) or ``Cost: O(1);
one driver call.`` (this codebase)."""


def _public_functions(tree: ast.Module, where: str) -> list[tuple[str, str | None]]:
    """``(where:line Class.name, docstring or None)`` of every public function and method (names not
    starting with ``_``, in public classes)."""

    def walk(node, prefix):
        for n in ast.iter_child_nodes(node):
            if isinstance(n, ast.ClassDef) and not n.name.startswith("_"):
                yield from walk(n, f"{prefix}{n.name}.")
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_"):
                yield f"{where}:{n.lineno} {prefix}{n.name}", ast.get_docstring(n)

    return list(walk(tree, ""))


def _public_functions_without_docstrings(tree: ast.Module, where: str) -> list[str]:
    return [name for name, doc in _public_functions(tree, where) if doc is None]


def _public_functions_without_costs(tree: ast.Module, where: str) -> list[str]:
    return [name for name, doc in _public_functions(tree, where) if not COST.search(doc or "")]


def _pools_modules():
    for path in sorted(POOLS.rglob("*.py")):
        yield ast.parse(path.read_text()), str(path.relative_to(POOLS))


def test_every_public_function_in_pools_has_a_docstring():
    missing = [name for tree, where in _pools_modules() for name in _public_functions_without_docstrings(tree, where)]
    assert not missing, f"{len(missing)} public functions in pools/ without a docstring:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_docstring():
    tree = ast.parse("class A:\n    def f(self):\n        '''doc'''\n    def g(self):\n        pass\n"
                     "    def _h(self):\n        pass\ndef k():\n    pass\n")
    assert _public_functions_without_docstrings(tree, "x.py") == ["x.py:4 A.g", "x.py:8 k"]


def test_every_public_function_in_pools_states_its_cost():
    missing = [name for tree, where in _pools_modules() for name in _public_functions_without_costs(tree, where)]
    assert not missing, (f"{len(missing)} public functions in pools/ whose docstring states no cost "
                         "('Cost: O(1); one driver call.' or 'Runtime complexity: O(log(n))'):\n" + "\n".join(missing))


def test_the_check_sees_a_missing_cost():
    tree = ast.parse("class A:\n"
                     "    def f(self):\n        '''Cost: O(1).'''\n"           # 2
                     "    def g(self):\n        '''doc'''\n"                   # 4: no cost
                     "    def h(self):\n        '''Runtime complexity: O(n).'''\n"
                     "    def _i(self):\n        '''doc'''\n"                  # private
                     "class _B:\n    def j(self):\n        '''doc'''\n"        # private class
                     "def k():\n    pass\n"                                   # 13: no docstring at all
                     "def m():\n    '''Walks the list: O(len(xs)).'''\n")
    assert _public_functions_without_costs(tree, "x.py") == ["x.py:4 A.g", "x.py:13 k"]


def test_the_protocol_states_its_costs():
    from vmstoolkit.pools.base import Allocator

    for name in ("allocate", "free", "record_stream", "stats", "stats_of", "empty_cache", "close", "size_of",
                 "live_allocations", "reset_peak_stats", "reset_accumulated_stats", "export_counters",
                 "report_compiled", "note_oom", "stream_home", "block_streams", "path_counts", "compiled_replay"):
        doc = getattr(Allocator, name).__doc__
        assert "complexity" in doc or "Cost" in doc, name
