"""Write docs/cli.md, the CLI reference, with Typer's own generator (``typer ... utils docs``).

    python scripts/gen_cli_reference.py            # rewrite docs/cli.md
    python scripts/gen_cli_reference.py --stdout   # print it instead (what the test compares)

The same as ``typer vmstoolkit.cli utils docs --name vmstoolkit --title ... --output docs/cli.md``:
every command and group of the app, from the code's own help texts, as Markdown (it does not
depend on the terminal's width or on Rich).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "cli.md"
TITLE = "vmstoolkit command-line reference"


def render() -> str:
    cmd = [sys.executable, "-m", "typer", "vmstoolkit.cli", "utils", "docs", "--name", "vmstoolkit", "--title", TITLE]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False,
                          env={"PATH": "", "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "TERM": "dumb"})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if "--stdout" in args:
        sys.stdout.write(text)
    else:
        OUT.write_text(text, encoding="utf-8")
        print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
