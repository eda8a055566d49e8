"""The rows' source digest (``analysis.rows.file_sha256``) on files that cannot be read."""

import sys
from pathlib import Path

import pytest

from vmstoolkit.analysis.rows import file_sha256
from vmstoolkit.cli import main
from vmstoolkit.errors import TraceFormatError

UNREADABLE = Path("/proc/self/mem")  # a regular file of size 0 whose read fails with EIO


@pytest.mark.skipif(not UNREADABLE.exists(), reason="needs Linux's /proc")
def test_a_regular_file_whose_read_fails_is_the_loaders_one_line_error():
    with pytest.raises(TraceFormatError, match=r"cannot read snapshot /proc/self/mem: Input/output error$"):
        file_sha256(UNREADABLE)


@pytest.mark.skipif(not UNREADABLE.exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize("argv", [["replay", "-a", "native"], ["compare"]])
def test_replay_of_proc_self_mem_is_one_line_not_a_traceback(monkeypatch, capsys, argv):
    """Issue 37, attack item 2: an OSError escaped from the digest as a traceback."""
    monkeypatch.setattr(sys, "argv", ["vmstoolkit", *argv, str(UNREADABLE)] + ([str(UNREADABLE)] if argv == ["compare"] else []))
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and "/proc/self/mem" in err, err


def test_the_digest_is_of_the_bytes_as_stored(tmp_path):
    p = tmp_path / "x.bin"
    p.write_bytes(b"abc")
    assert file_sha256(p) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_a_control_character_in_a_file_name_cannot_split_a_table_row(monkeypatch, capsys, tmp_path):
    """Issue 37, attack item 9: a newline in a snapshot's file name split its row of the table
    (and the caption's digest line) in two. The trace's name shows it escaped; the rows' source
    keeps the path as it is."""
    import pickle

    from vmstoolkit.trace.loader import trace_name

    assert trace_name("/x/a\nb\tc\x1b[31m.pickle.gz") == "a\\nb\\tc\\x1b[31m"
    assert trace_name("/x/llama-é.pickle.gz") == "llama-é"
    p = tmp_path / "a\nb.pickle"
    events = [{"action": a, "addr": 1 << 32, "size": 1 << 20, "stream": 0, "time_us": t}
              for t, a in enumerate(("alloc", "free_completed"))]
    p.write_bytes(pickle.dumps({"device_traces": [events], "segments": []}))
    monkeypatch.setattr(sys, "argv", ["vmstoolkit", "replay", "-a", "native", str(p)])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if "native" in line]
    assert len(row) == 1 and "a\\nb (device 0)" in row[0], out
    assert "a\\nb: sha256" in out and not any(line.strip().startswith("b") for line in out.splitlines()), out
