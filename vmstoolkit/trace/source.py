"""Reading a snapshot file's bytes, bounded: regular files only, gzip decided by its magic, and
never more decompressed bytes than the limit.

A FIFO or a device (``/dev/zero``) is refused before it is opened, so nothing blocks or reads
without end; a gzip bomb stops at the limit, having used one chunk of memory.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path

from vmstoolkit.errors import TraceFormatError
from vmstoolkit.units import GiB, format_size

DEFAULT_MAX_BYTES = 32 * GiB
"""Decompressed bytes read from one snapshot at most, by default. PyTorch's default
``max_entries`` (1M) with Python frames dumps a few hundred MB; 32 GiB is room for users who
raise it a hundredfold."""
DEFAULT_MAX_RATIO = 100
"""By default a gzip snapshot may also decompress to at most this many times its size (and
at least :data:`MIN_BOMB_BYTES`): real snapshots compress 3-20x (the bundled ones 14x, the
benchmark's 3.5x), a gzip bomb 1000x. An explicit ``max_bytes`` replaces both bounds."""
MIN_BOMB_BYTES = 32 << 20
"""Small enough that a 200 KB gzip of three million identical entries stops at about 2M entries
(250 MB of RAM, ``benchmarks/loader_bench.py``); a real snapshot this compressible is unknown."""
DEFAULT_MAX_OBJECTS = 1_000_000_000
"""Pickle values built (every push, memo references included) at most, by default: a
snapshot with frames builds about 50 per entry, so this admits 20M entries."""
CHUNK = 4 << 20
"""Bytes handed to the scanner at a time: large enough that per-call overhead vanishes, small
enough to stay in cache-friendly memory."""

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


@dataclass(frozen=True)
class Limits:
    """What one load may read and build; ``None``: the defaults above."""

    max_bytes: int | None = None
    max_objects: int | None = None

    def objects(self) -> int:
        return DEFAULT_MAX_OBJECTS if self.max_objects is None else int(self.max_objects)


def check_limits(limits: Limits) -> None:
    for name in ("max_bytes", "max_objects"):
        v = getattr(limits, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise TraceFormatError(f"{name} must be a positive integer, got {v!r}")


def regular_file(path: Path) -> int:
    """Size of ``path``, a regular file, or a one-line error saying what it is instead."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise TraceFormatError(f"cannot read snapshot {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        what = next((w for test, w in _KINDS if test(st.st_mode)), "not a regular file")
        raise TraceFormatError(f"snapshot {path} is {what}, not a regular file")
    return st.st_size


class BoundedReader(io.RawIOBase):
    """The decompressed bytes of a snapshot file, raising once more than the limit is read."""

    def __init__(self, path: str | Path, limits: Limits) -> None:
        self.path = Path(path)
        size = regular_file(self.path)
        try:
            self._raw = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise TraceFormatError(f"cannot read snapshot {self.path}: {e.strerror or e}") from None
        try:  # a regular file whose read fails (/proc/self/mem: EIO) is the same one-line error
            self.gzipped = self._raw.read(2) == b"\x1f\x8b"
            self._raw.seek(0)
        except OSError as e:
            self._raw.close()
            raise TraceFormatError(f"cannot read snapshot {self.path}: {e.strerror or e}") from None
        self._f = gzip.GzipFile(fileobj=self._raw, mode="rb") if self.gzipped else self._raw
        if limits.max_bytes is not None:
            self.limit = int(limits.max_bytes)
        elif self.gzipped:
            self.limit = min(DEFAULT_MAX_BYTES, max(MIN_BOMB_BYTES, DEFAULT_MAX_RATIO * size))
        else:
            self.limit = DEFAULT_MAX_BYTES
        self.explicit = limits.max_bytes is not None
        self.compressed_size = size
        self.done = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = CHUNK
        n = min(n, self.limit + 1 - self.done)
        try:
            data = self._f.read(n) if n > 0 else b""
        except (OSError, EOFError, zlib.error) as e:
            raise TraceFormatError(f"snapshot {self.path} is a truncated or corrupt gzip file ({e})") from None
        self.done += len(data)
        if self.done > self.limit:
            self._too_big()
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def skip(self, n: int, check=None) -> int:
        """Read and discard ``n`` bytes (a long string the scanner does not keep), handing each
        piece to ``check`` if given; bytes skipped."""
        left = n
        while left > 0:
            data = self.read(min(left, CHUNK))
            if not data:
                break
            if check is not None:
                check(data)
            left -= len(data)
        return n - left

    def _too_big(self) -> None:
        if self.explicit:
            why = f"max_bytes={self.limit}"
        elif self.gzipped and self.limit < DEFAULT_MAX_BYTES:
            why = (f"{DEFAULT_MAX_RATIO}x its compressed size of {format_size(self.compressed_size)}: "
                   "a gzip bomb, or a snapshot that needs a larger max_bytes")
        else:
            why = "the default max_bytes"
        raise TraceFormatError(f"snapshot {self.path} decompresses to more than {format_size(self.limit)} "
                               f"({why}); raise the limit (max_bytes=, --max-bytes) if the snapshot is real")

    def close(self) -> None:
        try:
            if self._f is not self._raw:
                self._f.close()
            self._raw.close()
        finally:
            super().close()
