"""A compiled, streaming reader of the pickle opcodes of a PyTorch memory snapshot.

Rationale
    ``pickle.load`` of a 500k-entry snapshot with 5 frames per entry builds about 4 million
    dicts and lists, takes 5 s and 820 MB (``benchmarks/loader_bench.py``), and replay needs
    five integers per entry. It also trusts the file: a 34-byte pickle can ask for a 2 GiB
    ``bytearray`` and a 33 KB one can reference one dict ten million times.

Approach
    :func:`scan` is a pickle virtual machine over plain data, written as one Numba function
    over arrays. It never builds a Python object. Each value on its stack is three integers
    (kind, value, aux). Containers get a *role* when they are created, from what lies below
    them on the stack (the dict and key they are the value of, or the list they go into):
    the snapshot dict, ``device_traces``, a device's entry list, an entry, ``segments``, a
    segment, its ``blocks``, a block, ``allocator_settings``, or *dropped* (frames and
    everything else replay does not need). Entries, segments and blocks are written into
    integer tables as their ``SETITEMS`` run; dropped containers keep nothing.

    Roles are a guess made before the container is filled, so every guess is checked when the
    container is attached to its parent. Anything the scanner does not expect (a role that does
    not match, a non-integer size, an unknown global, an entry without an action...) sets the
    *fallback* flag and the scan goes on validating: the loader then reads the file with the
    restricted ``pickle`` unpickler, which gives the exact answer or the exact error, knowing
    that the file is within every limit. So the fast path is never wrong, only sometimes not
    taken.

Implementation
    Input comes in chunks; an opcode cut by a chunk's end is resumed when the next chunk comes
    (status ``NEED``). Tables that fill up are grown by the caller (status ``GROW``). Strings
    are compared against a table of known names (keys, actions, states, globals) and their
    bytes are kept only inside ``allocator_settings``; long strings that are not kept are
    skipped without buffering them (``regs[R_SKIP]``).

Limitations
    Only plain data: ``set``, ``frozenset``, ``bytes``, ``bytearray``, ``complex`` and
    ``_codecs.encode`` (how protocol 0-2 pickle bytes) are the callables admitted, with
    arguments that cannot allocate more than the file holds. Persistent ids, extension codes,
    ``BUILD``, ``INST``, ``OBJ``, ``NEWOBJ`` and out-of-band buffers are refused outright.
"""

from __future__ import annotations

import numpy as np
from vmstoolkit._jit import njit

# ---- value kinds on the stack and in the memo
K_NONE, K_BOOL, K_INT, K_INTX, K_FLOAT, K_STR, K_BYTES, K_TUPLE, K_CONT, K_DROPC, K_GLOBAL, K_OPAQUE = range(12)
"""K_INTX: an integer that does not fit int64 (or text the scanner does not parse);
K_CONT: a kept container (aux = role | type << 4, val = its row); K_DROPC: a dropped one."""

# ---- roles of containers
R_DROP, R_ROOT, R_DT, R_DEV, R_ENT, R_SEGS, R_SEG, R_BLKS, R_BLK, R_SET = range(10)
T_LIST, T_DICT, T_SET = 0, 1, 2

# ---- registers (regs[...])
(R_POS, R_SP, R_MP, R_NOBJ, R_NMEMO, R_NENT, R_NSEG, R_NBLK, R_NLIST, R_NSREC, R_NSTR, R_NARENA, R_FALLBACK,
 R_ERR, R_ERRV1, R_ERRV2, R_SKIP, R_GROW, R_GROWN, R_ROOTSEEN, R_MAXOBJ, R_BASE, R_NSCONT, R_DTROW, R_SEGL, R_SETC,
 R_RESULT_KIND, R_RESULT_AUX, R_NATTACHED, R_FRAME_END, R_SKIPFMT, R_SKIPFROM, N_REGS) = range(33)
"""R_FRAME_END: absolute offset the last FRAME says the file reaches (the reader checks it after
STOP, as ``pickle`` reads every frame whole); R_SKIPFMT/R_SKIPFROM: how the text of a string
being skipped must decode (``FMT_UTF8``, ``FMT_ASCII``, -1: bytes) and where it starts in the buffer."""

# ---- statuses
ST_NEED, ST_DONE, ST_GROW, ST_ERR = 1, 2, 3, 4

# ---- what to grow (regs[R_GROW]); regs[R_GROWN] = the size needed
G_STACK, G_MARKS, G_MEMO, G_ENT, G_SEG, G_BLK, G_LIST, G_SREC, G_STR, G_ARENA = range(10)

# ---- errors (regs[R_ERR]); values in R_ERRV1/R_ERRV2
(E_OPCODE, E_TRUNCATED, E_UNDERFLOW, E_NOMARK, E_MEMO_MISSING, E_MEMO_RANGE, E_OBJECTS, E_REFUSED_OP, E_ALLOC_CTOR,
 E_LINE, E_SHARED_ENTRY, E_NEG_LEN, E_STACK_DEPTH, E_PROTO, E_UTF8, E_ASCII) = range(1, 17)
HIGHEST_PROTOCOL = 5
"""``pickle.HIGHEST_PROTOCOL`` of every supported Python; a higher PROTO byte is refused, as pickle refuses it."""

# ---- fallback reasons (regs[R_FALLBACK]), for tests and diagnostics
(F_ROLE, F_FIELD, F_GLOBAL, F_REDUCE, F_SHARED, F_SETTINGS, F_ROOT, F_STRING) = range(1, 9)

# ---- columns of the tables
E_ACTION, E_ADDR, E_SIZE, E_STREAM, E_TIME, E_OWNER, E_FLAGS, E_NCOLS = range(8)
S_DEVICE, S_ADDRESS, S_STREAM, S_TOTAL, S_BLOCKS, S_ORDER, S_FLAGS, S_NCOLS = range(8)
B_ADDRESS, B_SIZE, B_REQ, B_STATE, B_OWNER, B_FLAGS, B_NCOLS = range(7)
L_ROLE, L_COUNT, L_ORDER, L_NCOLS = range(4)
SR_CONT, SR_KKIND, SR_KVAL, SR_KAUX, SR_VKIND, SR_VVAL, SR_VAUX, SR_NCOLS = range(8)
ST_OFF, ST_LEN, ST_FMT, ST_NCOLS = range(4)
FMT_UTF8, FMT_ASCII, FMT_RAW_UNICODE, FMT_REPR, FMT_FLOAT = range(5)

WAIT_TEXT = 1 << 20
"""Strings up to this long are waited for whole, so their text is checked in the buffer; longer
ones are skipped in chunks and checked by the reader as they pass (``R_SKIPFMT``)."""
MAX_LINE = 1 << 16
"""Longest text line (protocol 0 numbers, globals, strings) read; real snapshots are protocol 2+."""
KEEP_SHORT = 64
"""Strings up to this long are compared with the known names; longer ones never match."""
KEEP_SETTINGS = 1 << 16
"""Bytes of a string inside ``allocator_settings`` kept for the settings dict."""

# Known strings: the scanner matches strings against these and works with their index.
KNOWN = (
    "action", "addr", "size", "stream", "time_us", "frames",  # 0-5: entry keys
    "device_traces", "segments", "allocator_settings",  # 6-8: snapshot keys
    "device", "address", "total_size", "blocks", "state", "requested_size",  # 9-14: segment/block keys
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",  # 15-20
    "segment_unmap", "snapshot", "oom",  # 21-23: actions
    "active_allocated", "active_pending_free", "inactive",  # 24-26: block states
    "builtins", "__builtin__", "_codecs",  # 27-29: modules
    "set", "frozenset", "bytes", "bytearray", "complex", "encode",  # 30-35: callables
    "latin1", "latin-1", "utf-8", "utf8", "ascii",  # 36-40: encodings
)
KI = {s: i for i, s in enumerate(KNOWN)}
ACTION_NAMES = KNOWN[15:24]
STATE_NAMES = KNOWN[24:27]
# flags of entries, segments and blocks: which keys were set
FL_ACTION, FL_ADDR, FL_SIZE, FL_STREAM, FL_TIME = 1, 2, 4, 8, 16
FL_BLOCK_ADDRESS = 1
# globals (K_GLOBAL's value)
GL_SET, GL_FROZENSET, GL_BYTES, GL_BYTEARRAY, GL_COMPLEX, GL_ENCODE = range(1, 7)


def known_tables() -> tuple[np.ndarray, np.ndarray]:
    """The known strings as one byte array and their offsets (``off[i]:off[i+1]``)."""
    blob = b"".join(s.encode() for s in KNOWN)
    off = np.zeros(len(KNOWN) + 1, dtype=np.int64)
    off[1:] = np.cumsum([len(s) for s in KNOWN])
    return np.frombuffer(blob, dtype=np.uint8).copy(), off


@njit(cache=True)
def _match(buf, start, length, kblob, koff):
    if length > KEEP_SHORT:
        return -1
    for k in range(koff.size - 1):
        ks = koff[k]
        if koff[k + 1] - ks != length:
            continue
        same = True
        for j in range(length):
            if buf[start + j] != kblob[ks + j]:
                same = False
                break
        if same:
            return k
    return -1


@njit(cache=True)
def _le(buf, p, nbytes):
    v = np.int64(0)
    for j in range(nbytes - 1, -1, -1):
        v = (v << 8) | np.int64(buf[p + j])
    return v


@njit(cache=True)
def _le_signed(buf, p, nbytes):
    """Little-endian two's complement, ``nbytes`` <= 8."""
    v = np.uint64(0)
    for j in range(nbytes - 1, -1, -1):
        v = (v << np.uint64(8)) | np.uint64(buf[p + j])
    if nbytes < 8 and nbytes > 0 and buf[p + nbytes - 1] >= 128:
        v = v - (np.uint64(1) << np.uint64(8 * nbytes))
    return np.int64(v)


@njit(cache=True)
def _find_nl(buf, p, n):
    end = min(n, p + MAX_LINE)
    for j in range(p, end):
        if buf[j] == 10:
            return j
    return -1


@njit(cache=True)
def _parse_decimal(buf, a, b):
    """int64 value of the ASCII decimal ``buf[a:b]`` (optional sign), ok flag."""
    if a >= b:
        return np.int64(0), False
    neg = False
    if buf[a] == 45 or buf[a] == 43:
        neg = buf[a] == 45
        a += 1
    if a >= b or b - a > 18:
        return np.int64(0), False
    v = np.int64(0)
    for j in range(a, b):
        c = buf[j]
        if c < 48 or c > 57:
            return np.int64(0), False
        v = v * 10 + np.int64(c - 48)
    return (-v if neg else v), True


@njit(cache=True)
def _bad_text(buf, a, ln, fmt):
    """Offset of the first byte of ``buf[a:a+ln]`` that ``pickle`` would not decode (UTF-8 with
    ``surrogatepass``, or ASCII), or -1. Truncated sequences at the end count as bad."""
    end = a + ln
    j = a
    if fmt == FMT_ASCII:
        while j < end:
            if buf[j] >= 128:
                return j
            j += 1
        return -1
    while j < end:
        c = buf[j]
        if c < 0x80:
            j += 1
            continue
        if 0xC2 <= c <= 0xDF:
            need, lo, hi = 1, 0x80, 0xBF
        elif c == 0xE0:
            need, lo, hi = 2, 0xA0, 0xBF
        elif 0xE1 <= c <= 0xEF:  # 0xED A0-BF: a surrogate, which 'surrogatepass' admits
            need, lo, hi = 2, 0x80, 0xBF
        elif c == 0xF0:
            need, lo, hi = 3, 0x90, 0xBF
        elif 0xF1 <= c <= 0xF3:
            need, lo, hi = 3, 0x80, 0xBF
        elif c == 0xF4:
            need, lo, hi = 3, 0x80, 0x8F
        else:
            return j
        if j + need >= end:  # the sequence runs past the string
            return j
        c1 = buf[j + 1]
        if c1 < lo or c1 > hi:
            return j
        for q in range(2, need + 1):
            if buf[j + q] < 0x80 or buf[j + q] > 0xBF:
                return j
        j += need + 1
    return -1


@njit(cache=True)
def _plain_decimal(buf, a, b):
    """Whether ``buf[a:b]`` is ``0`` or ``-?[1-9][0-9]*``: text that every reading of a
    protocol 0 integer (C ``strtol`` base 0, ``int(s, 0)``) takes to the same value."""
    if a < b and buf[a] == 45:
        a += 1
        if a < b and buf[a] == 48:
            return False  # -0: pickle's INT reads it as False
    if a >= b:
        return False
    if buf[a] == 48:
        return b - a == 1
    for j in range(a, b):
        if buf[j] < 48 or buf[j] > 57:
            return False
    return True


@njit(cache=True, inline="always")
def _room(regs, sp, mp, skind, marks, ents, segs, blks, lists, strs):
    """The table (``G_*``) without room for one more opcode, and the size it needs; -1 if none."""
    if sp + 2 > skind.size:
        return G_STACK, sp + 2
    if mp + 1 > marks.size:
        return G_MARKS, mp + 1
    if regs[R_NENT] + 1 > ents.shape[0]:
        return G_ENT, regs[R_NENT] + 1
    if regs[R_NSEG] + 1 > segs.shape[0]:
        return G_SEG, regs[R_NSEG] + 1
    if regs[R_NBLK] + 1 > blks.shape[0]:
        return G_BLK, regs[R_NBLK] + 1
    if regs[R_NLIST] + 1 > lists.shape[0]:
        return G_LIST, regs[R_NLIST] + 1
    if regs[R_NSTR] + 1 > strs.shape[0]:
        return G_STR, regs[R_NSTR] + 1
    return -1, 0


@njit(cache=True, inline="always")
def _err(regs, code, v1, v2):
    regs[R_ERR] = code
    regs[R_ERRV1] = v1
    regs[R_ERRV2] = v2
    return ST_ERR


@njit(cache=True, inline="always")
def _memo_index(buf, p, n, op):
    """Index and end of a memo opcode's argument (BINPUT/BINGET: 1 byte, LONG_*: 4, PUT/GET:
    a text line); end -1: not all in the buffer; -2: a line too long; index -1: not a number."""
    if op == 0x71 or op == 0x68:
        return (np.int64(buf[p + 1]), p + 2) if p + 2 <= n else (np.int64(0), -1)
    if op == 0x72 or op == 0x6A:
        return (_le(buf, p + 1, 4), p + 5) if p + 5 <= n else (np.int64(0), -1)
    e = _find_nl(buf, p + 1, n)
    if e < 0:
        return np.int64(0), (-2 if n - p - 1 >= MAX_LINE else -1)
    idx, ok = _parse_decimal(buf, p + 1, e)
    return (idx if ok and idx >= 0 else np.int64(-1)), e + 1


@njit(cache=True)
def _fits(role, ctype):
    if role == R_DT or role == R_DEV or role == R_SEGS or role == R_BLKS:
        return ctype == T_LIST
    if role == R_ENT or role == R_SEG or role == R_BLK or role == R_ROOT:
        return ctype == T_DICT
    return True


@njit(cache=True)
def _container_role(skind, sval, saux, sp, marks, mp, ctype):
    """Role of a container about to be pushed, from what lies below it on the stack.

    Two readings are possible: an item of the MARK batch that is open (into the list below
    the mark, or the value of the key on top in the dict below the mark), or an item added
    without a mark (APPEND into the list on top, SETITEM into the dict below the key on top).
    The one whose role fits the container's type wins, the MARK batch when both do; the
    guess is checked when the container is attached (:func:`_fill`)."""
    if sp == 0:
        return R_ROOT if ctype == T_DICT else R_DROP
    t = sp - 1
    top_mark = marks[mp - 1] if mp > 0 else -1
    cand_b = -1
    if top_mark < 0 or t >= top_mark:
        if (skind[t] == K_CONT or skind[t] == K_DROPC) and (saux[t] >> 4) == T_LIST:
            cand_b = _elem_role(saux[t] & 15) if skind[t] == K_CONT else R_DROP
        elif t >= 1 and (top_mark < 0 or t - 1 >= top_mark) and (skind[t - 1] == K_CONT or skind[t - 1] == K_DROPC) \
                and (saux[t - 1] >> 4) == T_DICT:
            cand_b = _child_role(saux[t - 1] & 15, skind[t], sval[t]) if skind[t - 1] == K_CONT else R_DROP
    cand_a = -1
    if top_mark >= 0:
        c = top_mark - 1
        k = sp - top_mark
        if c >= 0 and skind[c] == K_CONT:
            if (saux[c] >> 4) == T_LIST:
                cand_a = _elem_role(saux[c] & 15)
            elif (saux[c] >> 4) == T_DICT and k % 2 == 1:
                cand_a = _child_role(saux[c] & 15, skind[t], sval[t])
        elif c < 0 or skind[c] != K_CONT:
            cand_a = R_DROP
    if cand_a < 0 and cand_b < 0:
        return R_DROP
    if cand_a < 0:
        return cand_b
    if cand_b < 0:
        return cand_a
    if _fits(cand_b, ctype) and not _fits(cand_a, ctype):
        return cand_b
    return cand_a


@njit(cache=True)
def _hashable(skind, base, sp, step):
    """Whether the keys (``step`` 2) or items (1) ``base:sp`` are surely hashable: scalars and
    strings. Containers, tuples and bytes objects (a bytearray is not) send the file to pickle."""
    for j in range(base, sp, step):
        if skind[j] > K_STR:
            return False
    return True


@njit(cache=True)
def _is_settings(skind, saux, i):
    return i >= 0 and skind[i] == K_CONT and (saux[i] & 15) == R_SET


@njit(cache=True)
def _keep_text(skind, saux, sp, marks, mp):
    """Whether a string about to be pushed may belong to ``allocator_settings`` (its text is kept)."""
    if sp == 0:
        return False
    if _is_settings(skind, saux, sp - 1) or _is_settings(skind, saux, sp - 2):
        return True
    return mp > 0 and _is_settings(skind, saux, marks[mp - 1] - 1)


@njit(cache=True)
def _elem_role(role):
    if role == R_DT:
        return R_DEV
    if role == R_DEV:
        return R_ENT
    if role == R_SEGS:
        return R_SEG
    if role == R_BLKS:
        return R_BLK
    if role == R_SET:
        return R_SET
    return R_DROP


@njit(cache=True)
def _child_role(role, kkind, kval):
    if role == R_SET:
        return R_SET
    if kkind != K_STR:
        return R_DROP
    if role == R_ROOT:
        if kval == 6:
            return R_DT
        if kval == 7:
            return R_SEGS
        if kval == 8:
            return R_SET
        return R_DROP
    if role == R_SEG and kval == 12:
        return R_BLKS
    return R_DROP


@njit(cache=True)
def scan(buf, n, final, regs, skind, sval, saux, marks, mkind, mval, maux,
         ents, segs, blks, lists, srec, strs, arena, kblob, koff):
    """Run the pickle machine over ``buf[regs[R_POS]:n]``; see the module docstring.

    Returns a status (``ST_*``); ``regs`` carries the machine between calls. Cost: O(bytes),
    a few nanoseconds per opcode; memory: the tables of kept entries, segments and blocks.

    Section map (one ``if``/``elif`` chain over the opcode byte, in this order; each section
    starts with a ``# ----`` rule of its name). One function, so that Numba keeps the stack
    pointers in registers; the helpers it calls are the per-group checks named here.

    ========================  ==========================================================
    framing                   PROTO (refuses > :data:`HIGHEST_PROTOCOL`), FRAME (records
                              ``R_FRAME_END``), STOP (the result's kind and role)
    stack                     MARK, POP, POP_MARK, DUP; every pop respects the fence (the
                              top mark), as pickle's does
    scalars                   NONE, booleans, BININT*, LONG1/4 (huge ones skipped), BINFLOAT,
                              protocol 0 INT/LONG/FLOAT text (:func:`_plain_decimal`, else
                              fallback)
    strings and bytes         every string opcode; text checked with :func:`_bad_text` (or by
                              the reader while skipped), known names by :func:`_match`,
                              settings text copied to the arena
    memo                      MEMOIZE/PUT/BINPUT/LONG_BINPUT, GET/BINGET/LONG_BINGET
                              (:func:`_memo_index`); a shared entry is refused
    containers                EMPTY_*/DICT/LIST: the role guess (:func:`_container_role`),
                              a row in its table, :func:`_fill` for items given at once
    appends                   APPEND(S)/SETITEM(S)/ADDITEMS: type and hashability checks
                              (:func:`_hashable`), then :func:`_fill`
    tuples                    EMPTY_TUPLE, TUPLE, TUPLE1-3, FROZENSET (packed kinds in aux)
    globals and calls         GLOBAL, STACK_GLOBAL (:func:`_global_code`), REDUCE of the
                              admitted callables
    refused                   persistent ids, BUILD/INST/OBJ/NEWOBJ*, EXT*, buffers
    push                      the one value an opcode made, counted against ``max_objects``
    ========================  ==========================================================
    """
    p = regs[R_POS]
    sp = regs[R_SP]
    mp = regs[R_MP]
    nobj = regs[R_NOBJ]
    maxobj = regs[R_MAXOBJ]
    status = ST_NEED
    while True:
        if p >= n:
            if final:
                status = _err(regs, E_TRUNCATED, regs[R_BASE] + p, 0)
            break
        # room for this opcode: at most one new push, one new row per table
        what = -1
        size = 0
        if (sp + 2 > skind.size or mp + 1 > marks.size or regs[R_NENT] >= ents.shape[0] or regs[R_NSEG] >= segs.shape[0]
                or regs[R_NBLK] >= blks.shape[0] or regs[R_NLIST] >= lists.shape[0] or regs[R_NSTR] >= strs.shape[0]):
            what, size = _room(regs, sp, mp, skind, marks, ents, segs, blks, lists, strs)
        if what >= 0:
            regs[R_GROW] = what
            regs[R_GROWN] = size
            status = ST_GROW
            break
        op = buf[p]
        fence = marks[mp - 1] if mp > 0 else 0
        pushed_kind = -1
        pushed_val = np.int64(0)
        pushed_aux = np.int64(-1)

        # ---------------------------------------------------------------- framing
        if op == 0x80:  # PROTO
            if p + 2 > n:
                break
            if buf[p + 1] > HIGHEST_PROTOCOL:
                status = _err(regs, E_PROTO, regs[R_BASE] + p, np.int64(buf[p + 1]))
                break
            p += 2
            continue
        if op == 0x95:  # FRAME: pickle reads the frame whole, so the file must hold it
            if p + 9 > n:
                break
            flen = _le(buf, p + 1, 8)
            if flen < 0:
                status = _err(regs, E_NEG_LEN, regs[R_BASE] + p, 0)
                break
            regs[R_FRAME_END] = max(regs[R_FRAME_END], regs[R_BASE] + p + 9 + flen)
            p += 9
            continue
        if op == 0x2E:  # STOP
            if sp - fence < 1 or mp > 0:
                status = _err(regs, E_UNDERFLOW, regs[R_BASE] + p, 0)
                break
            regs[R_RESULT_KIND] = skind[sp - 1]
            regs[R_RESULT_AUX] = saux[sp - 1]
            p += 1
            status = ST_DONE
            break
        # ---------------------------------------------------------------- stack
        if op == 0x28:  # MARK
            marks[mp] = sp
            mp += 1
            p += 1
            continue
        if op == 0x30:  # POP
            if mp > 0 and marks[mp - 1] == sp:
                mp -= 1
            elif sp > fence:
                sp -= 1
            else:
                status = _err(regs, E_UNDERFLOW, regs[R_BASE] + p, 0)
                break
            p += 1
            continue
        if op == 0x31:  # POP_MARK
            if mp == 0:
                status = _err(regs, E_NOMARK, regs[R_BASE] + p, 0)
                break
            sp = marks[mp - 1]
            mp -= 1
            p += 1
            continue
        if op == 0x32:  # DUP
            if sp - fence < 1:
                status = _err(regs, E_UNDERFLOW, regs[R_BASE] + p, 0)
                break
            if skind[sp - 1] == K_CONT:
                regs[R_FALLBACK] = regs[R_FALLBACK] or F_SHARED
            pushed_kind = skind[sp - 1]
            pushed_val = sval[sp - 1]
            pushed_aux = saux[sp - 1]
            p += 1
        # ---------------------------------------------------------------- scalars
        elif op == 0x4E:  # NONE
            pushed_kind = K_NONE
            p += 1
        elif op == 0x88 or op == 0x89:  # NEWTRUE / NEWFALSE
            pushed_kind = K_BOOL
            pushed_val = 1 if op == 0x88 else 0
            p += 1
        elif op == 0x4B:  # BININT1
            if p + 2 > n:
                break
            pushed_kind = K_INT
            pushed_val = np.int64(buf[p + 1])
            p += 2
        elif op == 0x4D:  # BININT2
            if p + 3 > n:
                break
            pushed_kind = K_INT
            pushed_val = _le(buf, p + 1, 2)
            p += 3
        elif op == 0x4A:  # BININT
            if p + 5 > n:
                break
            pushed_kind = K_INT
            pushed_val = _le_signed(buf, p + 1, 4)
            p += 5
        elif op == 0x8A or op == 0x8B:  # LONG1 / LONG4
            hdr = 1 if op == 0x8A else 4
            if p + 1 + hdr > n:
                break
            ln = _le(buf, p + 1, hdr) if hdr == 1 else _le_signed(buf, p + 1, 4)
            if ln < 0:
                status = _err(regs, E_NEG_LEN, regs[R_BASE] + p, 0)
                break
            if ln > 8:
                if p + 1 + hdr + ln > n:  # skip a huge integer without buffering it
                    pushed_kind = K_INTX
                    regs[R_SKIP] = p + 1 + hdr + ln - n
                    p = n
                else:
                    pushed_kind = K_INTX
                    p += 1 + hdr + ln
            else:
                if p + 1 + hdr + ln > n:
                    break
                pushed_kind = K_INT
                pushed_val = _le_signed(buf, p + 1 + hdr, ln) if ln > 0 else 0
                p += 1 + hdr + ln
        elif op == 0x47:  # BINFLOAT (big-endian)
            if p + 9 > n:
                break
            v = np.int64(0)
            for j in range(8):
                v = (v << 8) | np.int64(buf[p + 1 + j])
            pushed_kind = K_FLOAT
            pushed_val = v
            p += 9
        elif op == 0x49 or op == 0x4C or op == 0x46:  # INT / LONG / FLOAT (text)
            e = _find_nl(buf, p + 1, n)
            if e < 0:
                if n - p - 1 >= MAX_LINE:
                    status = _err(regs, E_LINE, regs[R_BASE] + p, 0)
                break
            if op == 0x46:  # protocol 0 float text: pickle's float() decides
                pushed_kind = K_FLOAT
                pushed_val = 0
                regs[R_FALLBACK] = regs[R_FALLBACK] or F_STRING
            else:
                b = e
                if op == 0x4C and b > p + 1 and buf[b - 1] == 76:  # trailing 'L'
                    b -= 1
                if op == 0x49 and e - p - 1 == 2 and buf[p + 1] == 48 and (buf[p + 2] == 48 or buf[p + 2] == 49):
                    pushed_kind = K_BOOL
                    pushed_val = np.int64(buf[p + 2] - 48)
                else:
                    v, ok = _parse_decimal(buf, p + 1, b)
                    pushed_kind = K_INT if ok else K_INTX
                    pushed_val = v
                    if not ok or not _plain_decimal(buf, p + 1, b):
                        # base-0 rules (leading zeros, signs, '_', spaces, 0x...): pickle decides
                        regs[R_FALLBACK] = regs[R_FALLBACK] or F_STRING
            p = e + 1
        # ---------------------------------------------------------------- strings and bytes
        elif (op == 0x58 or op == 0x8C or op == 0x8D or op == 0x54 or op == 0x55 or op == 0x42 or op == 0x43
              or op == 0x8E or op == 0x96 or op == 0x53 or op == 0x56):
            is_bytes = op == 0x42 or op == 0x43 or op == 0x8E or op == 0x96
            if op == 0x53 or op == 0x56:  # STRING 'repr' / UNICODE raw-unicode-escape, text lines
                e = _find_nl(buf, p + 1, n)
                if e < 0:
                    if n - p - 1 >= MAX_LINE:
                        status = _err(regs, E_LINE, regs[R_BASE] + p, 0)
                    break
                a = p + 1
                ln = e - a
                fmt = FMT_REPR if op == 0x53 else FMT_RAW_UNICODE
                nxt = e + 1
                regs[R_FALLBACK] = regs[R_FALLBACK] or F_STRING  # quoting and escapes: pickle decodes them
            else:
                hdr = 4
                if op == 0x8C or op == 0x55 or op == 0x43:
                    hdr = 1
                elif op == 0x8D or op == 0x8E or op == 0x96:
                    hdr = 8
                if p + 1 + hdr > n:
                    break
                ln = _le(buf, p + 1, hdr) if hdr != 4 else _le_signed(buf, p + 1, 4)
                if ln < 0:
                    status = _err(regs, E_NEG_LEN, regs[R_BASE] + p, 0)
                    break
                a = p + 1 + hdr
                fmt = FMT_ASCII if (op == 0x54 or op == 0x55) else FMT_UTF8
                nxt = a + ln
            keep = (not is_bytes) and ln <= KEEP_SETTINGS and _keep_text(skind, saux, sp, marks, mp)
            checked = (not is_bytes) and (fmt == FMT_UTF8 or fmt == FMT_ASCII)
            want = keep or (ln <= KEEP_SHORT and not is_bytes) or (checked and ln <= WAIT_TEXT)
            if nxt > n:
                if want:
                    break  # wait for the whole string
                # skip it without buffering; the reader checks its text as it passes
                pushed_kind = K_BYTES if is_bytes else K_STR
                pushed_val = -1
                regs[R_SKIP] = nxt - n
                regs[R_SKIPFMT] = fmt if checked else -1
                regs[R_SKIPFROM] = a
                p = n
            else:
                pushed_kind = K_BYTES if is_bytes else K_STR
                pushed_val = -1
                if checked:
                    bad = _bad_text(buf, a, ln, fmt)
                    if bad >= 0:
                        status = _err(regs, E_UTF8 if fmt == FMT_UTF8 else E_ASCII, regs[R_BASE] + bad,
                                      regs[R_BASE] + p)
                        break
                if not is_bytes:
                    ma, ml = a, ln
                    if fmt == FMT_REPR and ln >= 2 and (buf[a] == 39 or buf[a] == 34) and buf[a + ln - 1] == buf[a]:
                        ma, ml = a + 1, ln - 2
                    plain = True
                    if fmt == FMT_REPR or fmt == FMT_RAW_UNICODE:
                        for j in range(ma, ma + ml):
                            if buf[j] == 92:
                                plain = False
                                break
                    if plain:
                        pushed_val = _match(buf, ma, ml, kblob, koff)
                    if keep:
                        if regs[R_NARENA] + ln > arena.size:
                            regs[R_GROW] = G_ARENA
                            regs[R_GROWN] = regs[R_NARENA] + ln
                            status = ST_GROW
                            break
                        k = regs[R_NSTR]
                        strs[k, ST_OFF] = regs[R_NARENA]
                        strs[k, ST_LEN] = ln
                        strs[k, ST_FMT] = fmt
                        arena[regs[R_NARENA]:regs[R_NARENA] + ln] = buf[a:a + ln]
                        regs[R_NARENA] += ln
                        regs[R_NSTR] += 1
                        pushed_aux = k
                else:
                    pushed_aux = ln
                p = nxt
        # ---------------------------------------------------------------- memo
        elif op == 0x94 or op == 0x71 or op == 0x72 or op == 0x70:  # MEMOIZE / BINPUT / LONG_BINPUT / PUT
            if op == 0x94:
                idx = regs[R_NMEMO]
                nxt = p + 1
            else:
                idx, nxt = _memo_index(buf, p, n, op)
                if nxt == -2:
                    status = _err(regs, E_LINE, regs[R_BASE] + p, 0)
                if nxt < 0:
                    break
                if idx < 0:
                    status = _err(regs, E_MEMO_RANGE, regs[R_BASE] + p, -1)
                    break
            if idx > nobj + 16:
                status = _err(regs, E_MEMO_RANGE, regs[R_BASE] + p, idx)
                break
            if idx >= mkind.size:
                regs[R_GROW] = G_MEMO
                regs[R_GROWN] = idx + 1
                status = ST_GROW
                break
            if sp - fence < 1:
                status = _err(regs, E_UNDERFLOW, regs[R_BASE] + p, 0)
                break
            mkind[idx] = skind[sp - 1]
            mval[idx] = sval[sp - 1]
            maux[idx] = saux[sp - 1]
            if idx >= regs[R_NMEMO]:
                regs[R_NMEMO] = idx + 1
            p = nxt
            continue
        elif op == 0x68 or op == 0x6A or op == 0x67:  # BINGET / LONG_BINGET / GET
            idx, nxt = _memo_index(buf, p, n, op)
            if nxt == -2:
                status = _err(regs, E_LINE, regs[R_BASE] + p, 0)
            if nxt < 0:
                break
            if idx < 0 or idx >= regs[R_NMEMO] or mkind[idx] < 0:
                status = _err(regs, E_MEMO_MISSING, regs[R_BASE] + p, idx)
                break
            pushed_kind = mkind[idx]
            pushed_val = mval[idx]
            pushed_aux = maux[idx]
            if pushed_kind == K_CONT:
                r = pushed_aux & 15
                if r == R_ENT:
                    status = _err(regs, E_SHARED_ENTRY, regs[R_BASE] + p, pushed_val)
                    break
                regs[R_FALLBACK] = regs[R_FALLBACK] or F_SHARED
            p = nxt
        # ---------------------------------------------------------------- containers
        elif op == 0x5D or op == 0x7D or op == 0x8F or op == 0x64 or op == 0x6C:
            # EMPTY_LIST / EMPTY_DICT / EMPTY_SET / DICT (from mark) / LIST (from mark)
            ctype = T_LIST
            if op == 0x7D or op == 0x64:
                ctype = T_DICT
            elif op == 0x8F:
                ctype = T_SET
            base = sp
            if op == 0x64 or op == 0x6C:
                if mp == 0:
                    status = _err(regs, E_NOMARK, regs[R_BASE] + p, 0)
                    break
                base = marks[mp - 1]
                mp -= 1
                if op == 0x64 and (sp - base) % 2 == 1:
                    status = _err(regs, E_UNDERFLOW, regs[R_BASE] + p, 0)
                    break
            role = _container_role(skind, sval, saux, base, marks, mp, ctype)
            if ctype == T_SET or (role == R_ROOT and ctype != T_DICT):
                role = R_DROP
            if role == R_ROOT:
                if regs[R_ROOTSEEN] != 0:
                    role = R_DROP
                else:
                    regs[R_ROOTSEEN] = 1
            row = np.int64(-1)
            if role == R_ENT or role == R_SEG or role == R_BLK or role == R_ROOT:
                if ctype != T_DICT:
                    regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
                    role = R_DROP
            elif role == R_DT or role == R_DEV or role == R_SEGS or role == R_BLKS:
                if ctype != T_LIST:
                    regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
                    role = R_DROP
            if role == R_ENT:
                row = regs[R_NENT]
                ents[row, :] = 0
                ents[row, E_ACTION] = -1
                ents[row, E_OWNER] = -1
                regs[R_NENT] += 1
            elif role == R_SEG:
                row = regs[R_NSEG]
                segs[row, :] = 0
                segs[row, S_BLOCKS] = -1
                segs[row, S_ORDER] = -1
                regs[R_NSEG] += 1
            elif role == R_BLK:
                row = regs[R_NBLK]
                blks[row, :] = 0
                blks[row, B_STATE] = -1
                blks[row, B_OWNER] = -1
                regs[R_NBLK] += 1
            elif role == R_DT or role == R_DEV or role == R_SEGS or role == R_BLKS:
                row = regs[R_NLIST]
                lists[row, L_ROLE] = role
                lists[row, L_COUNT] = 0
                lists[row, L_ORDER] = -1
                regs[R_NLIST] += 1
            elif role == R_SET:
                row = regs[R_NSCONT]
                regs[R_NSCONT] += 1
            elif role == R_ROOT:
                row = 0
            if role == R_DROP:
                pushed_kind = K_DROPC
                pushed_aux = ctype << 4
            else:
                pushed_kind = K_CONT
                pushed_val = row
                pushed_aux = role | (ctype << 4)
            nitems = sp - base
            p += 1
            if nitems > 0:  # DICT / LIST with items: fill it now
                # the items are above base; the new container goes at base
                if ctype == T_DICT and not _hashable(skind, base, sp, 2):
                    regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
                if role != R_DROP:
                    if role != R_SET:
                        regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
                    elif regs[R_NSREC] + nitems > srec.shape[0]:
                        regs[R_FALLBACK] = regs[R_FALLBACK] or F_SETTINGS
                    else:
                        _fill(regs, skind, sval, saux, base, sp, role, row, ctype, ents, segs, blks, lists, srec)
                sp = base
            nobj += 1
            if nobj > maxobj:
                status = _err(regs, E_OBJECTS, nobj, 0)
                break
            skind[sp] = pushed_kind
            sval[sp] = pushed_val
            saux[sp] = pushed_aux
            sp += 1
            continue
        elif op == 0x61 or op == 0x65 or op == 0x73 or op == 0x75 or op == 0x90:
            # APPEND / APPENDS / SETITEM / SETITEMS / ADDITEMS
            if op == 0x61 or op == 0x73:
                k = 1 if op == 0x61 else 2
                if sp - fence < k + 1:
                    status = _err(regs, E_UNDERFLOW, regs[R_BASE] + p, 0)
                    break
                base = sp - k
                c = base - 1
            else:
                if mp == 0:
                    status = _err(regs, E_NOMARK, regs[R_BASE] + p, 0)
                    break
                base = marks[mp - 1]
                c = base - 1
                below = marks[mp - 2] if mp > 1 else 0  # the container must lie above the mark before
                if c < below or (op == 0x75 and (sp - base) % 2 == 1):
                    status = _err(regs, E_UNDERFLOW, regs[R_BASE] + p, 0)
                    break
            want_type = T_DICT if (op == 0x73 or op == 0x75) else (T_SET if op == 0x90 else T_LIST)
            if want_type != T_LIST and not _hashable(skind, base, sp, 2 if want_type == T_DICT else 1):
                regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
            if skind[c] == K_CONT:
                ctype = saux[c] >> 4
                role = saux[c] & 15
                if ctype != want_type:
                    regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
                elif role == R_SET and regs[R_NSREC] + (sp - base) > srec.shape[0]:
                    regs[R_GROW] = G_SREC
                    regs[R_GROWN] = regs[R_NSREC] + (sp - base)
                    status = ST_GROW
                    break
                else:
                    _fill(regs, skind, sval, saux, base, sp, role, sval[c], ctype, ents, segs, blks, lists, srec)
            elif skind[c] == K_DROPC:
                if (saux[c] >> 4) != want_type:
                    regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
                # a dropped container must not swallow a kept one
                for j in range(base, sp):
                    if skind[j] == K_CONT:
                        regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
            else:
                regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
            sp = base
            if op != 0x61 and op != 0x73:
                mp -= 1
            p += 1
            continue
        elif op == 0x29 or op == 0x74 or op == 0x85 or op == 0x86 or op == 0x87 or op == 0x91:
            # EMPTY_TUPLE / TUPLE (mark) / TUPLE1-3 / FROZENSET (mark)
            if op == 0x29:
                base = sp
            elif op == 0x74 or op == 0x91:
                if mp == 0:
                    status = _err(regs, E_NOMARK, regs[R_BASE] + p, 0)
                    break
                base = marks[mp - 1]
                mp -= 1
            else:
                k = op - 0x84
                if sp - fence < k:
                    status = _err(regs, E_UNDERFLOW, regs[R_BASE] + p, 0)
                    break
                base = sp - k
            ln = sp - base
            for j in range(base, sp):
                if skind[j] == K_CONT and (saux[j] & 15) != R_SET:
                    regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
            if op == 0x91:
                if not _hashable(skind, base, sp, 1):
                    regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
                pushed_kind = K_OPAQUE
            else:
                pushed_kind = K_TUPLE
                k0 = skind[base] if ln > 0 else 0
                k1 = skind[base + 1] if ln > 1 else 0
                known1 = sval[base + 1] if ln > 1 and k1 == K_STR else -1
                pushed_val = sval[base] if ln > 0 else 0
                pushed_aux = min(ln, 255) | (np.int64(k0) << 8) | (np.int64(k1) << 16) | ((known1 + 1) << 24)
            sp = base
            p += 1
        # ---------------------------------------------------------------- globals and calls
        elif op == 0x63:  # GLOBAL 'module\nname\n'
            e1 = _find_nl(buf, p + 1, n)
            e2 = _find_nl(buf, e1 + 1, n) if e1 >= 0 else -1
            if e1 < 0 or e2 < 0:
                if n - p - 1 >= 2 * MAX_LINE:
                    status = _err(regs, E_LINE, regs[R_BASE] + p, 0)
                break
            mod = _match(buf, p + 1, e1 - p - 1, kblob, koff)
            name = _match(buf, e1 + 1, e2 - e1 - 1, kblob, koff)
            pushed_kind = K_GLOBAL
            pushed_val = _global_code(mod, name)
            if pushed_val == 0:
                regs[R_FALLBACK] = regs[R_FALLBACK] or F_GLOBAL
                pushed_kind = K_OPAQUE
            p = e2 + 1
        elif op == 0x93:  # STACK_GLOBAL
            if sp - fence < 2:
                status = _err(regs, E_UNDERFLOW, regs[R_BASE] + p, 0)
                break
            mod = sval[sp - 2] if skind[sp - 2] == K_STR else -1
            name = sval[sp - 1] if skind[sp - 1] == K_STR else -1
            sp -= 2
            pushed_kind = K_GLOBAL
            pushed_val = _global_code(mod, name)
            if pushed_val == 0:
                regs[R_FALLBACK] = regs[R_FALLBACK] or F_GLOBAL
                pushed_kind = K_OPAQUE
            p += 1
        elif op == 0x52:  # REDUCE
            if sp - fence < 2:
                status = _err(regs, E_UNDERFLOW, regs[R_BASE] + p, 0)
                break
            fk = skind[sp - 2]
            fv = sval[sp - 2]
            ak = skind[sp - 1]
            av = sval[sp - 1]
            aa = saux[sp - 1]
            sp -= 2
            pushed_kind = K_OPAQUE
            if fk != K_GLOBAL or ak != K_TUPLE:
                regs[R_FALLBACK] = regs[R_FALLBACK] or F_REDUCE
            else:
                ln = aa & 255
                k0 = (aa >> 8) & 255
                k1 = (aa >> 16) & 255
                known1 = (aa >> 24) - 1
                if (fv == GL_BYTES or fv == GL_BYTEARRAY) and ln >= 1 and (k0 == K_INT or k0 == K_INTX or k0 == K_BOOL):
                    status = _err(regs, E_ALLOC_CTOR, fv, av if k0 != K_INTX else -1)
                    break
                if fv == GL_SET or fv == GL_FROZENSET:
                    # the items' hashability is not tracked: only the empty set is answered here
                    if ln > 0:
                        regs[R_FALLBACK] = regs[R_FALLBACK] or F_REDUCE
                    pushed_kind = K_DROPC if fv == GL_SET else K_OPAQUE
                    pushed_aux = T_SET << 4
                elif fv == GL_ENCODE:
                    # whether the text encodes (latin-1 of chars above 255, ASCII, lone surrogates)
                    # is not tracked: pickle decides
                    regs[R_FALLBACK] = regs[R_FALLBACK] or F_REDUCE
                    pushed_kind = K_BYTES
                elif fv == GL_BYTES or fv == GL_BYTEARRAY:
                    ok = ln == 0 or (ln == 1 and k0 == K_BYTES)
                    if not ok:
                        regs[R_FALLBACK] = regs[R_FALLBACK] or F_REDUCE
                    pushed_kind = K_BYTES
                elif fv == GL_COMPLEX:
                    if ln > 2 or (ln >= 1 and not (k0 == K_FLOAT or k0 == K_INT)) or (ln == 2 and not (k1 == K_FLOAT or k1 == K_INT)):
                        regs[R_FALLBACK] = regs[R_FALLBACK] or F_REDUCE
            p += 1
        elif (op == 0x50 or op == 0x51 or op == 0x62 or op == 0x69 or op == 0x6F or op == 0x81 or op == 0x82
              or op == 0x83 or op == 0x84 or op == 0x92 or op == 0x97 or op == 0x98):
            # PERSID BINPERSID BUILD INST OBJ NEWOBJ EXT1 EXT2 EXT4 NEWOBJ_EX NEXT_BUFFER READONLY_BUFFER
            status = _err(regs, E_REFUSED_OP, regs[R_BASE] + p, op)
            break
        else:
            status = _err(regs, E_OPCODE, regs[R_BASE] + p, op)
            break
        # ---------------------------------------------------------------- push
        if pushed_kind >= 0:
            nobj += 1
            if nobj > maxobj:
                status = _err(regs, E_OBJECTS, nobj, 0)
                break
            skind[sp] = pushed_kind
            sval[sp] = pushed_val
            saux[sp] = pushed_aux
            sp += 1
        if regs[R_SKIP] > 0:
            break
    regs[R_POS] = p
    regs[R_SP] = sp
    regs[R_MP] = mp
    regs[R_NOBJ] = nobj
    return status


@njit(cache=True)
def _global_code(mod, name):
    if mod == 27 or mod == 28:  # builtins, __builtin__
        if name == 30:
            return GL_SET
        if name == 31:
            return GL_FROZENSET
        if name == 32:
            return GL_BYTES
        if name == 33:
            return GL_BYTEARRAY
        if name == 34:
            return GL_COMPLEX
    if mod == 29 and name == 35:
        return GL_ENCODE
    return 0


@njit(cache=True)
def _field(regs, kind, val):
    """An integer field of an entry, segment or block: its value, or a fallback."""
    if kind == K_INT:
        return val
    if kind == K_NONE:
        return 0  # as ``entry.get(key, 0) or 0`` always read it
    regs[R_FALLBACK] = regs[R_FALLBACK] or F_FIELD
    return 0


@njit(cache=True)
def _fill(regs, skind, sval, saux, base, sp, role, row, ctype, ents, segs, blks, lists, srec):
    """Attach the stack items ``base:sp`` to the kept container ``row`` of ``role``."""
    if ctype == T_DICT:
        for j in range(base, sp, 2):
            kk = skind[j]
            kv = sval[j]
            vk = skind[j + 1]
            vv = sval[j + 1]
            va = saux[j + 1]
            vrole = va & 15 if vk == K_CONT else R_DROP
            if role == R_SET:
                if vk == K_CONT and vrole != R_SET:
                    regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
                if kk == K_STR and kv < 0 and saux[j] < 0:
                    regs[R_FALLBACK] = regs[R_FALLBACK] or F_SETTINGS  # key text not kept
                r = regs[R_NSREC]
                srec[r, SR_CONT] = row
                srec[r, SR_KKIND] = kk
                srec[r, SR_KVAL] = kv
                srec[r, SR_KAUX] = saux[j]
                srec[r, SR_VKIND] = vk
                srec[r, SR_VVAL] = vv
                srec[r, SR_VAUX] = va
                regs[R_NSREC] += 1
                continue
            expected = R_DROP
            if kk == K_STR:
                expected = _child_role(role, kk, kv)
            if vk == K_CONT and vrole != expected:
                regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
                continue
            if kk != K_STR:
                continue
            if role == R_ROOT:
                if kv == 6 and vk == K_CONT:
                    regs[R_DTROW] = vv + 1
                elif kv == 7 and vk == K_CONT:
                    regs[R_SEGL] = vv + 1
                elif kv == 8 and vk == K_CONT:
                    regs[R_SETC] = vv + 1
                elif kv == 6 or kv == 7 or kv == 8:
                    regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE  # not a list/dict: let pickle say so
            elif role == R_ENT:
                if kv == 0:
                    if vk == K_STR and vv >= 15 and vv <= 23:
                        ents[row, E_ACTION] = vv - 15
                    elif vk == K_STR:
                        ents[row, E_ACTION] = 99  # another action
                    else:
                        regs[R_FALLBACK] = regs[R_FALLBACK] or F_FIELD
                    ents[row, E_FLAGS] |= FL_ACTION
                elif kv == 1:
                    ents[row, E_ADDR] = _field(regs, vk, vv)
                elif kv == 2:
                    ents[row, E_SIZE] = _field(regs, vk, vv)
                elif kv == 3:
                    ents[row, E_STREAM] = _field(regs, vk, vv)
                elif kv == 4:
                    ents[row, E_TIME] = _field(regs, vk, vv)
            elif role == R_SEG:
                if kv == 9:
                    segs[row, S_DEVICE] = _field(regs, vk, vv)
                elif kv == 10:
                    segs[row, S_ADDRESS] = _field(regs, vk, vv)
                elif kv == 3:
                    segs[row, S_STREAM] = _field(regs, vk, vv)
                elif kv == 11:
                    segs[row, S_TOTAL] = _field(regs, vk, vv)
                elif kv == 12:
                    if vk == K_CONT:
                        segs[row, S_BLOCKS] = vv
                        lists[vv, L_ORDER] = row
                    else:
                        regs[R_FALLBACK] = regs[R_FALLBACK] or F_FIELD
            elif role == R_BLK:
                if kv == 10 or kv == 1:
                    blks[row, B_ADDRESS] = _field(regs, vk, vv)
                    blks[row, B_FLAGS] |= FL_BLOCK_ADDRESS
                elif kv == 2:
                    blks[row, B_SIZE] = _field(regs, vk, vv)
                elif kv == 14:
                    blks[row, B_REQ] = _field(regs, vk, vv)
                elif kv == 13:
                    if vk == K_STR:
                        blks[row, B_STATE] = vv - 24 if 24 <= vv <= 26 else 99
                    else:
                        regs[R_FALLBACK] = regs[R_FALLBACK] or F_FIELD
    else:  # list
        for j in range(base, sp):
            vk = skind[j]
            vv = sval[j]
            va = saux[j]
            if role == R_SET:
                r = regs[R_NSREC]
                srec[r, SR_CONT] = row
                srec[r, SR_KKIND] = -1
                srec[r, SR_KVAL] = 0
                srec[r, SR_KAUX] = -1
                srec[r, SR_VKIND] = vk
                srec[r, SR_VVAL] = vv
                srec[r, SR_VAUX] = va
                regs[R_NSREC] += 1
                if vk == K_CONT and (va & 15) != R_SET:
                    regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
                continue
            expected = _elem_role(role)
            if vk != K_CONT or (va & 15) != expected:
                regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
                continue
            if role == R_DT or role == R_SEGS:
                lists_row = row
                if role == R_DT:
                    lists[vv, L_ORDER] = lists[lists_row, L_COUNT]
                else:
                    segs[vv, S_ORDER] = lists[lists_row, L_COUNT]
                lists[lists_row, L_COUNT] += 1
            elif role == R_DEV:
                if vv != regs[R_NATTACHED]:  # entries must come in the order they were made
                    regs[R_FALLBACK] = regs[R_FALLBACK] or F_ROLE
                regs[R_NATTACHED] += 1
                ents[vv, E_OWNER] = row
                lists[row, L_COUNT] += 1
            elif role == R_BLKS:
                blks[vv, B_OWNER] = row
                lists[row, L_COUNT] += 1
