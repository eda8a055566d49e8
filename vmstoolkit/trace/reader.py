"""Drive :func:`vmstoolkit.trace.scan.scan` over a file: feed chunks, grow tables, turn its
errors into one-line :class:`~vmstoolkit.errors.TraceFormatError`, and hand back the tables."""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vmstoolkit.errors import TraceFormatError
from vmstoolkit.trace import scan as S
from vmstoolkit.trace.source import CHUNK, BoundedReader, Limits

MAX_STACK = 1 << 22
"""Deepest pickle stack (values and marks) admitted: real snapshots nest about ten deep and
batch 1000 items; a deeper stack is a hostile file."""

_OPNAMES = {0x50: "PERSID", 0x51: "BINPERSID", 0x62: "BUILD", 0x69: "INST", 0x6F: "OBJ", 0x81: "NEWOBJ",
            0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x92: "NEWOBJ_EX", 0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER"}
_CTOR = {S.GL_BYTES: "bytes", S.GL_BYTEARRAY: "bytearray"}
_KNOWN = S.known_tables()


@dataclass
class ScanTables:
    """What the scanner kept: integer tables (see the column names in :mod:`.scan`), the
    settings records with their strings, and ``fallback`` (0 when the tables are exact)."""

    regs: np.ndarray
    ents: np.ndarray
    segs: np.ndarray
    blks: np.ndarray
    lists: np.ndarray
    srec: np.ndarray
    strs: np.ndarray
    arena: np.ndarray
    fallback: int


def _grown(a: np.ndarray, need: int, fill: int = 0) -> np.ndarray:
    """``a`` with room for ``need`` rows (at least twice as many), the new rows set to ``fill``.

    Grown in place (``realloc``, which moves a large block by remapping its pages, not by
    copying): a copy would hold the old and the new table at once, and the memo and entry
    tables of a 2M-entry snapshot with frames are 400 MB (the copy took peak RSS from about
    600 MB to 800). Only the tables the scanner owns are grown, never a view of them."""
    n = max(need, 2 * a.shape[0], 16)
    old = a.shape[0]
    if a.base is None and a.flags.c_contiguous and a.flags.owndata:
        a.resize((n,) + a.shape[1:], refcheck=False)
        if fill:
            a[old:] = fill
        return a
    b = np.full((n,) + a.shape[1:], fill, dtype=a.dtype)
    b[:old] = a
    return b


def scan_file(path: str | Path, limits: Limits) -> ScanTables:
    """Scan the snapshot at ``path`` once, in chunks. Raises on every limit and malformation;
    memory: one chunk plus the kept tables."""
    path = Path(path)
    regs = np.zeros(S.N_REGS, dtype=np.int64)
    regs[S.R_MAXOBJ] = limits.objects()
    st = dict(
        skind=np.zeros(1024, np.int8), sval=np.zeros(1024, np.int64), saux=np.zeros(1024, np.int64),
        marks=np.zeros(256, np.int64),
        mkind=np.full(4096, -1, np.int8), mval=np.zeros(4096, np.int64), maux=np.zeros(4096, np.int64),
        ents=np.zeros((4096, S.E_NCOLS), np.int64), segs=np.zeros((64, S.S_NCOLS), np.int64),
        blks=np.zeros((256, S.B_NCOLS), np.int64), lists=np.zeros((64, S.L_NCOLS), np.int64),
        srec=np.zeros((64, S.SR_NCOLS), np.int64), strs=np.zeros((64, S.ST_NCOLS), np.int64),
        arena=np.zeros(4096, np.uint8),
    )
    with BoundedReader(path, limits) as src:
        pending = b""
        final = False
        while True:
            if not final and len(pending) - int(regs[S.R_POS]) < CHUNK // 2:
                pending, final = _refill(src, pending, regs)
            if not pending and final:
                raise TraceFormatError(f"snapshot {path} is empty" if regs[S.R_BASE] == 0 else
                                       f"snapshot {path} is truncated or not a pickle (it ends at byte "
                                       f"{int(regs[S.R_BASE])} before the pickle's STOP)")
            buf = np.frombuffer(pending, dtype=np.uint8)
            status = S.scan(buf, len(buf), final, regs, st["skind"], st["sval"], st["saux"], st["marks"],
                            st["mkind"], st["mval"], st["maux"], st["ents"], st["segs"], st["blks"], st["lists"],
                            st["srec"], st["strs"], st["arena"], *_KNOWN)
            if status == S.ST_DONE:
                break
            if status == S.ST_ERR:
                raise TraceFormatError(_message(path, regs, limits))
            if status == S.ST_GROW:
                _grow(st, regs, path)
                continue
            # ST_NEED
            if regs[S.R_SKIP] > 0:
                want = int(regs[S.R_SKIP])
                regs[S.R_SKIP] = 0
                check = _text_check(path, regs, pending)
                regs[S.R_BASE] += int(regs[S.R_POS]) + want
                regs[S.R_POS] = 0
                pending = b""
                if src.skip(want, check) < want:
                    raise TraceFormatError(f"snapshot {path} is truncated or not a pickle (it ends inside a "
                                           f"string of {want} more bytes)")
                if check is not None:
                    check(b"", True)
                continue
            if final:
                raise TraceFormatError(f"snapshot {path} is truncated or not a pickle (it ends at byte "
                                       f"{int(regs[S.R_BASE]) + len(pending)} before the pickle's STOP)")
            if len(pending) - int(regs[S.R_POS]) >= CHUNK // 2:  # one opcode longer than the window
                pending, final = _refill(src, pending, regs)
        frame_end = int(regs[S.R_FRAME_END])
        have = int(regs[S.R_BASE]) + len(pending)
        if frame_end > have and src.skip(frame_end - have) < frame_end - have:
            raise TraceFormatError(f"snapshot {path} is truncated or not a pickle (a FRAME runs to byte {frame_end}, "
                                   "past the end of the file)")
    fallback = int(regs[S.R_FALLBACK])
    kind, aux = int(regs[S.R_RESULT_KIND]), int(regs[S.R_RESULT_AUX])
    if not _may_be_dict(kind, aux) and fallback != S.F_GLOBAL:  # a global: the unpickler names it
        # pickle would build the whole value only for from_dict to refuse it
        raise TraceFormatError(f"{path} is not a PyTorch memory snapshot: expected a dict with 'device_traces' "
                               f"(from torch.cuda.memory._snapshot()), got {_root_name(kind, aux)}")
    if kind != S.K_CONT or (aux & 15) != S.R_ROOT:
        fallback = fallback or S.F_ROOT
    return ScanTables(regs=regs, ents=st["ents"][: regs[S.R_NENT]], segs=st["segs"][: regs[S.R_NSEG]],
                      blks=st["blks"][: regs[S.R_NBLK]], lists=st["lists"][: regs[S.R_NLIST]],
                      srec=st["srec"][: regs[S.R_NSREC]], strs=st["strs"][: regs[S.R_NSTR]],
                      arena=st["arena"][: regs[S.R_NARENA]], fallback=fallback)


_KIND_NAMES = {S.K_NONE: "None", S.K_BOOL: "a bool", S.K_INT: "an int", S.K_INTX: "an int", S.K_FLOAT: "a float",
               S.K_STR: "a str", S.K_BYTES: "bytes", S.K_TUPLE: "a tuple", S.K_GLOBAL: "a function"}
_TYPE_NAMES = {S.T_LIST: "a list", S.T_SET: "a set"}


def _root_name(kind: int, aux: int) -> str:
    if kind in (S.K_CONT, S.K_DROPC):
        return _TYPE_NAMES.get(aux >> 4, "a container")
    return _KIND_NAMES.get(kind, "another value")


def _may_be_dict(kind: int, aux: int) -> bool:
    """Whether the pickle's result may be a dict: only a dict container can be (calls admitted
    make sets, bytes and complex numbers; any other call is refused by the unpickler too)."""
    return kind in (S.K_CONT, S.K_DROPC) and (aux >> 4) == S.T_DICT


def _text_check(path: Path, regs: np.ndarray, pending: bytes):
    """For a string skipped in chunks, a function fed its bytes that raises as pickle's decode
    would; ``None`` for bytes objects. Fed first with the part already in ``pending``."""
    fmt = int(regs[S.R_SKIPFMT])
    if fmt < 0:
        return None
    start = int(regs[S.R_BASE]) + int(regs[S.R_SKIPFROM])
    dec = codecs.getincrementaldecoder("utf-8" if fmt == S.FMT_UTF8 else "ascii")("surrogatepass"
                                                                                  if fmt == S.FMT_UTF8 else "strict")

    def check(data: bytes, final: bool = False) -> None:
        try:
            dec.decode(data, final)
        except UnicodeDecodeError:
            what = "UTF-8" if fmt == S.FMT_UTF8 else "ASCII"
            raise TraceFormatError(f"snapshot {path} is truncated or not a pickle (the string at byte {start} "
                                   f"is not valid {what})") from None

    check(pending[int(regs[S.R_SKIPFROM]):])
    return check


def _refill(src: BoundedReader, pending: bytes, regs: np.ndarray) -> tuple[bytes, bool]:
    """The unread rest of ``pending`` and one more chunk; whether the input has ended."""
    chunk = src.read(CHUNK)
    pos = int(regs[S.R_POS])
    regs[S.R_BASE] += pos
    regs[S.R_POS] = 0
    return pending[pos:] + chunk, not chunk


def _grow(st: dict, regs: np.ndarray, path: Path) -> None:
    what, need = int(regs[S.R_GROW]), int(regs[S.R_GROWN])
    if what == S.G_STACK:
        if need > MAX_STACK:
            raise TraceFormatError(f"snapshot {path} nests or batches more than {MAX_STACK} values on the "
                                   "pickle stack: not a snapshot")
        for k in ("skind", "sval", "saux"):
            st[k] = _grown(st[k], need)
    elif what == S.G_MARKS:
        if need > MAX_STACK:
            raise TraceFormatError(f"snapshot {path} nests more than {MAX_STACK} marks: not a snapshot")
        st["marks"] = _grown(st["marks"], need)
    elif what == S.G_MEMO:
        st["mkind"] = _grown(st["mkind"], need, -1)
        st["mval"] = _grown(st["mval"], need)
        st["maux"] = _grown(st["maux"], need)
    else:
        key = {S.G_ENT: "ents", S.G_SEG: "segs", S.G_BLK: "blks", S.G_LIST: "lists", S.G_SREC: "srec",
               S.G_STR: "strs", S.G_ARENA: "arena"}[what]
        st[key] = _grown(st[key], need)


def _message(path: Path, regs: np.ndarray, limits: Limits) -> str:
    code, v1, v2 = int(regs[S.R_ERR]), int(regs[S.R_ERRV1]), int(regs[S.R_ERRV2])
    bad = f"snapshot {path} is truncated or not a pickle"
    if code == S.E_OPCODE:
        return f"{bad} (byte {v1}: unknown opcode {v2:#04x})"
    if code == S.E_TRUNCATED:
        return f"{bad} (it ends at byte {v1} before the pickle's STOP)"
    if code in (S.E_UNDERFLOW, S.E_NOMARK):
        return f"{bad} (byte {v1}: {'no MARK' if code == S.E_NOMARK else 'stack underflow'})"
    if code == S.E_MEMO_MISSING:
        return f"{bad} (byte {v1}: refers to memo entry {v2}, never stored)"
    if code == S.E_MEMO_RANGE:
        return f"{bad} (byte {v1}: memo index {v2} is out of range)"
    if code == S.E_PROTO:
        return f"{bad} (byte {v1}: pickle protocol {v2}; pickle reads protocols 0 to {S.HIGHEST_PROTOCOL})"
    if code in (S.E_UTF8, S.E_ASCII):
        what = "UTF-8" if code == S.E_UTF8 else "ASCII"
        return f"{bad} (byte {v1}: the string at byte {v2} is not valid {what})"
    if code == S.E_NEG_LEN:
        return f"{bad} (byte {v1}: negative length)"
    if code == S.E_LINE:
        return f"{bad} (byte {v1}: a text line longer than {S.MAX_LINE} bytes)"
    if code == S.E_OBJECTS:
        return (f"snapshot {path} builds more than {limits.objects()} objects (max_objects); raise the limit "
                "(max_objects=, --max-objects) if the snapshot is real")
    if code == S.E_REFUSED_OP:
        return (f"snapshot {path} uses pickle opcode {_OPNAMES.get(v2, hex(v2))} at byte {v1}, which builds "
                "objects that are not plain data")
    if code == S.E_ALLOC_CTOR:
        arg = "a huge integer" if v2 == -1 else str(v2)
        return (f"snapshot {path} asks for {_CTOR.get(v1, 'bytes')}({arg}), which would allocate memory the "
                "file does not hold: not a snapshot")
    if code == S.E_SHARED_ENTRY:
        return (f"snapshot {path} refers to trace entry {v2} again at byte {v1} (one object listed twice): "
                "snapshots never share entries")
    return f"{bad} (scanner error {code} at byte {v1})"
