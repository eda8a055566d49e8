"""Issue 37 attack item 7: a file is checked before it is hashed, so a huge non-pickle fails at
byte 0 instead of after a read of every byte."""

import pytest
from typer.testing import CliRunner

from vmstoolkit.analysis import rows
from vmstoolkit.cli import app

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.mark.parametrize("command", [["replay"], ["compare", "-a", "vms", "-a", "paged"]])
def test_a_sparse_file_is_refused_before_it_is_hashed(tmp_path, monkeypatch, command):
    p = tmp_path / "s.pickle"
    with open(p, "wb") as f:
        f.truncate(20 << 30)  # 20 GB of zeros, sparse: costs no disk
    hashed = []
    monkeypatch.setattr(rows, "file_sha256", lambda path: hashed.append(path) or "0" * 64)
    res = runner.invoke(app, [*command, str(p)])
    assert res.exit_code != 0 and "s.pickle is truncated or not a pickle (byte 0: unknown opcode 0x00)" in res.output
    assert hashed == []
