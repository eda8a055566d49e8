"""Write docs/cli.md, the CLI reference, with Typer's own generator (``typer ... utils docs``).

    python scripts/gen_cli_reference.py            # rewrite docs/cli.md
    python scripts/gen_cli_reference.py --stdout   # print it instead (what the test compares)

The same as ``typer vmstoolkit.cli utils docs --name vmstoolkit --title ... --output docs/cli.md``:
every command and group of the app, from the code's own help texts, as Markdown (it does not
depend on the terminal's width or on Rich), with the conventions every command follows
(:data:`CONVENTIONS`) before the first command.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "cli.md"
TITLE = "vmstoolkit command-line reference"

CONVENTIONS = """## Conventions of every command

* **Output**: `-f/--format table` (the default) is for people. `--format json` prints JSON Lines: one
  JSON object per row, with the same keys as the CSV's columns, and nothing else on stdout (`info`
  prints one row). `--format csv` prints the same rows as CSV. `compare` prints two kinds of rows,
  marked by their `kind` column: its runs (`run`), then the allocation sites (`site`). Progress bars
  (on a terminal only) and `wrote FILE` lines go to stderr. A `.json` file that an experiment writes
  (`fragmentation.json`) is one JSON document: its rows under `rows`, with how they were made.
* **One name, one meaning**: `-a/--allocator NAME` (repeatable; TAB completes names; `vmstoolkit
  allocators NAME` lists one's options and defaults), `-o/--option [ALLOC:]KEY=VALUE`, `--capacity
  SIZE` (tables say the capacity understood, in both units where a decimal size such as `80GB` is not
  a whole number of MiB), `--backend sim|cuda` (the simulated driver or the GPU; `replay --device` is
  its older name), `--gpu N` (a device number; `info --device N` is its older name, and `info --json`
  that of `--format json`), `--lenient`, `--max-bytes SIZE`, `--max-objects N` (how snapshots are read),
  `--oom-exit-code N`, `--jobs N`, `--cluster local:N|ADDRESS`.
* **Snapshots**: a folder given as `TRACE` stands for the snapshots directly in it (`replay`, `sweep`).
* **Output files** (`--out`, `--figure`) are written whole or not at all: under a temporary name,
  renamed once complete. Missing folders on the way are made.
* **Exit status**: 0 done; 1 an error (one line, `error: ...`), also a run of budgets of which none fits
  (`run`, `experiment offload`: the rows are printed first, then `error: no budget fits: ...`); 2 bad arguments; 3 a replay ran out of
  memory (`--oom-exit-code`); 130 interrupted (Ctrl-C: one line, `error: interrupted`).

"""


def render() -> str:
    cmd = [sys.executable, "-m", "typer", "vmstoolkit.cli", "utils", "docs", "--name", "vmstoolkit", "--title", TITLE]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False,
                          env={"PATH": "", "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "TERM": "dumb"})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    text = proc.stdout
    first = text.index("\n## `")  # the first command's section
    return text[:first + 1] + CONVENTIONS + text[first + 1:]


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
