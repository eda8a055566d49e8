"""The package's import graph, as facts: modules and their line counts, import cycles, and
imports that reach from a lower layer up to a higher one.

    python scripts/import_graph.py            # a report; exit 1 if there is a cycle or an upward import
    python scripts/import_graph.py --json     # the same as JSON

Every ``import`` counts, at module level or inside a function (a lazy import is still a
dependency). ``from pkg import name`` counts as importing ``pkg.name`` when that is a module.
A package's ``__init__`` is the package itself. ``tests/test_layering.py`` runs :func:`report`.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vmstoolkit"

# Lower layers first; a module may import only from its own layer or below. Within ``pools`` the
# driver seam sits below the allocators (``pools.drivers`` never imports an allocator).
LAYERS: list[tuple[str, ...]] = [
    ("vmstoolkit.units", "vmstoolkit.errors", "vmstoolkit._thread_states", "vmstoolkit._version", "vmstoolkit.data",
     "vmstoolkit._jit", "vmstoolkit._cuda_handles"),
    ("vmstoolkit.pools.drivers",),
    ("vmstoolkit.pools", "vmstoolkit.kernels"),
    ("vmstoolkit.trace", "vmstoolkit.exec"),
    ("vmstoolkit.analysis", "vmstoolkit.integrations", "vmstoolkit.recording", "vmstoolkit._record_boot"),
    ("vmstoolkit.cli", "vmstoolkit.__main__", "vmstoolkit"),
]


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for p in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _resolve(mod: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: {modules it imports}}``, inside the package only."""
    out: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(m, node, is_pkg)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a non-module name: its module
                    t = t.rpartition(".")[0]
                if t and t != m and t.startswith(PACKAGE):
                    out[m].add(t)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, found = set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def layer(mod: str) -> int:
    best, level = -1, None
    for i, names in enumerate(LAYERS):
        for n in names:
            if (mod == n or mod.startswith(n + ".")) and len(n) > best:
                best, level = len(n), i
    if level is None:
        raise SystemExit(f"module {mod} is in no layer: add it to LAYERS in {__file__}")
    return level


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a module to one in a higher layer."""
    return sorted((m, t) for m, ts in graph.items() for t in ts if layer(t) > layer(m))


def report(root: Path = ROOT) -> dict:
    mods = modules(root)
    g = edges(mods)
    return {
        "modules": len(mods),
        "imports": sum(len(v) for v in g.values()),
        "cycles": cycles(g),
        "upward_imports": upward(g),
        "lines": {m: len(p.read_text().splitlines()) for m, p in mods.items()},
    }


def main() -> int:
    r = report()
    if "--json" in sys.argv[1:]:
        print(json.dumps(r, indent=1))
    else:
        print(f"{r['modules']} modules, {r['imports']} imports between them (module level and lazy)")
        print(f"import cycles: {len(r['cycles'])}")
        for c in r["cycles"]:
            print("  " + " <-> ".join(c))
        print(f"imports from a lower layer up to a higher one: {len(r['upward_imports'])}")
        for a, b in r["upward_imports"]:
            print(f"  {a} -> {b}")
        print("\nlines per package:")
        per: dict[str, int] = {}
        for m, n in r["lines"].items():
            key = ".".join(m.split(".")[:3]) if m.startswith("vmstoolkit.pools.") else ".".join(m.split(".")[:2])
            per[key] = per.get(key, 0) + n
        for k in sorted(per):
            print(f"  {k:40s} {per[k]:6d}")
    return 1 if r["cycles"] or r["upward_imports"] else 0


if __name__ == "__main__":
    sys.exit(main())
