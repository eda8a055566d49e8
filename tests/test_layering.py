"""The package's import graph has no cycle and no import from a lower layer up to a higher one
(``scripts/import_graph.py``, run as a command: its report is the fact the docs quote)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "import_graph.py"


def report() -> dict:
    r = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, cwd=ROOT)
    assert r.stdout, r.stderr
    return json.loads(r.stdout)


def test_no_import_cycle_and_no_upward_import():
    r = report()
    assert r["modules"] > 100
    assert r["cycles"] == []
    assert r["upward_imports"] == []


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path):
    """The report can fail: a two-module cycle and a driver importing the CLI are both caught."""
    pkg = tmp_path / "vmstoolkit"
    (pkg / "pools" / "drivers").mkdir(parents=True)
    (pkg / "cli").mkdir()
    for d in (pkg, pkg / "pools", pkg / "pools" / "drivers", pkg / "cli"):
        (d / "__init__.py").write_text("")
    (pkg / "units.py").write_text("from vmstoolkit import errors\n")
    (pkg / "errors.py").write_text("def f():\n    from vmstoolkit.units import x\n")
    (pkg / "pools" / "drivers" / "sim.py").write_text("from vmstoolkit.cli import main\n")
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import import_graph
    finally:
        sys.path.remove(str(SCRIPT.parent))
    r = import_graph.report(tmp_path)
    assert r["cycles"] == [["vmstoolkit.errors", "vmstoolkit.units"]]
    assert r["upward_imports"] == [["vmstoolkit.pools.drivers.sim", "vmstoolkit.cli"]] or \
        r["upward_imports"] == [("vmstoolkit.pools.drivers.sim", "vmstoolkit.cli")]
