"""``vmstoolkit record``: run a command and record its PyTorch CUDA memory history."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from vmstoolkit import _interrupt
from vmstoolkit.cli.common import check_output_file, fail

COMMAND_SETTINGS = {"context_settings": {"allow_extra_args": True, "ignore_unknown_options": True}}
NOT_STARTED = 86  # the recorded Python's exit status when it cannot record (no torch, no CUDA)


def record_command(
    command: Annotated[Optional[list[str]], typer.Argument(
        metavar="-- COMMAND", help="The command to run, after --, e.g. -- python train.py --steps 3.",
        show_default=False)] = None,
    out: Annotated[Path, typer.Option("--out", metavar="FILE", help="Snapshot to write (gzip for .gz).")] = Path("run.pickle.gz"),
    stacks: Annotated[str, typer.Option(metavar="python|all", help="Frames kept per event: python (fast to "
                                                                    "dump) or all (adds C++ frames, slow).")] = "python",
    max_entries: Annotated[int, typer.Option(metavar="N", min=1, help="Events kept (the last ones).")] = 1_000_000,
) -> None:
    """Run COMMAND and record the CUDA memory history of its first Python process, from start to
    exit; then print the replay command to run next. Exit status: the command's."""
    from vmstoolkit.recording import STACKS, boot_dir, next_step

    if not command:
        fail("give the command to record after --, e.g. vmstoolkit record -- python train.py", code=2)
    if stacks not in STACKS:
        fail(f"--stacks must be one of {', '.join(STACKS)}, got {stacks!r}", code=2)
    check_output_file(out)
    out = out.expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vmstoolkit-record-") as tmp:
        status = Path(tmp) / "status.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(boot_dir()), *filter(None, [env.get("PYTHONPATH")])])
        env.update(VMSTOOLKIT_RECORD_OUT=str(out), VMSTOOLKIT_RECORD_STATUS=str(status),
                   VMSTOOLKIT_RECORD_STACKS=stacks, VMSTOOLKIT_RECORD_MAX_ENTRIES=str(max_entries))
        try:
            code = subprocess.call(command, env=env)
        except OSError as e:
            fail(f"cannot run {command[0]!r}: {e.strerror}")
        except KeyboardInterrupt:  # the recorded program was interrupted: what it recorded is kept
            _interrupt.handled()
            code = 130
        if not status.exists():
            fail(f"nothing recorded: {command[0]!r} did not start Python, or ended before its exit handlers ran "
                 f"(exit status {code})")
        st = json.loads(status.read_text())
    if not st["ok"]:
        fail(f"nothing recorded: {st['message']}")
    typer.echo(next_step(out, st["allocs"]), err=True)
    if code:
        raise typer.Exit(code=code)
