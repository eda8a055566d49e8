"""An output folder that cannot be made is one line before any work, not a traceback after it
(issue 37's attack pass: `view --out /proc/x/r.html` and `experiment fragmentation --out /proc/x`,
where /proc passes the writable check but refuses a new folder)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from vmstoolkit.cli import app

runner = CliRunner()
TRACE = Path(__file__).resolve().parents[2] / "vmstoolkit" / "data" / "traces" / "llama-small.frames.pickle.gz"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("args", [
    ["view", str(TRACE), "--out", "/proc/vmstoolkit-no/r.html"],
    ["experiment", "fragmentation", "--out", "/proc/vmstoolkit-no/out"],
])
def test_a_folder_that_cannot_be_made_is_one_line(args):
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception, SystemExit)
    assert "cannot make the folder" in r.output and "/proc/vmstoolkit-no" in r.output


def test_the_check_leaves_no_folder_behind(tmp_path):
    from vmstoolkit.cli.common import check_output_dir

    target = tmp_path / "a" / "b" / "c"
    check_output_dir(target)
    assert not (tmp_path / "a").exists()
