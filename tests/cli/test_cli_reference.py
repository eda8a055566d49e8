"""docs/cli.md is Typer's reference of every command (``typer vmstoolkit.cli utils docs``, run by
scripts/gen_cli_reference.py in a subprocess), and help names no Python type."""

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


def test_cli_reference_covers_every_command_without_python_types():
    from typer.main import get_command

    from vmstoolkit.cli import app

    text = DOC.read_text(encoding="utf-8")
    top = get_command(app)
    names = [f"vmstoolkit {n}" for n in top.commands if n != "experiment"]
    names += [f"vmstoolkit experiment {n}" for n in top.commands["experiment"].commands]
    assert {"vmstoolkit replay", "vmstoolkit experiment fragmentation", "vmstoolkit compare", "vmstoolkit view",
            "vmstoolkit record"} <= set(names)
    for name in names:
        assert f"## `{name}`" in text, f"docs/cli.md has no section for `{name}`: {FIX}"
        assert f"$ {name} [OPTIONS]" in text
    for typed in ("<list[", "<int>", "<str>", "<bool>", "<Path>", "<float>"):
        assert typed not in text, f"a Python type {typed} in the help"
    assert "\x1b[" not in text, "escape codes in docs/cli.md"
