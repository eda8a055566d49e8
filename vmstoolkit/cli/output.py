"""Output files written whole or not at all.

A command interrupted (Ctrl-C) or failing while it writes leaves no partial file behind: each
file is written under a temporary name in its own folder and renamed into place (``os.replace``,
atomic on one filesystem) once complete. Missing folders on the way are created, for every
output path a command takes (``view --out``, ``experiment offload --figure``, ``experiment
fragmentation --out``, ``record --out``), after :func:`~vmstoolkit.cli.common.check_output_file`
said that they can be.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from vmstoolkit import _interrupt


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (same suffix, so writers that go by it, such as
    matplotlib, still do); on success it becomes ``path``, on any exception it is removed."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".partial{''.join(path.suffixes[-1:])}",
                                dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _interrupt.check()  # a Ctrl-C that a library swallowed while the file was written
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """Yield an empty temporary folder inside ``out`` (made if missing); on success every file
    in it is moved into ``out`` (replacing files of the same name), on any exception nothing is,
    and ``out`` is removed again if this made it and it is still empty."""
    out = Path(out).expanduser()
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".partial-", dir=out))
    try:
        yield stage
        _interrupt.check()
        for p in sorted(stage.iterdir()):
            os.replace(p, out / p.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if empty: a failed first run leaves no empty folder


__all__ = ["atomic_file", "staged_dir"]
