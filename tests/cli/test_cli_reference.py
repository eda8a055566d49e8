"""docs/cli.md is the --help of every command, as scripts/gen_cli_reference.py writes it.

The generator runs in a subprocess: it must set TYPER_USE_RICH=0 (and a fixed width) before
Typer is imported, and this test process has imported Typer already.
"""

import difflib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_cli_reference.py"
DOC = ROOT / "docs" / "cli.md"
FIX = "run `python scripts/gen_cli_reference.py`"


def generate() -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "PY_COLORS", "CLICOLOR_FORCE")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--stdout"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, f"{SCRIPT.name} failed:\n{proc.stderr}"
    return proc.stdout


def test_cli_reference_is_up_to_date():
    assert DOC.exists(), f"docs/cli.md is missing: {FIX}"
    expected = generate()
    actual = DOC.read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True),
                                            "docs/cli.md", "generated", n=1))
        raise AssertionError(f"docs/cli.md is out of date: {FIX}\n{diff[:4000]}")


def test_cli_reference_covers_every_command_in_plain_text():
    text = DOC.read_text(encoding="utf-8")
    for name in ("vmstoolkit", "vmstoolkit replay", "vmstoolkit allocators", "vmstoolkit info",
                 "vmstoolkit experiment fragmentation", "vmstoolkit experiment offload"):
        assert f"## `{name}`" in text, f"docs/cli.md has no section for `{name}`: {FIX}"
        assert f"Usage: {name} [OPTIONS]" in text
    assert "\x1b[" not in text, "escape codes in docs/cli.md"
    assert "╭" not in text, "Rich panels in docs/cli.md: the generator must use plain help"
