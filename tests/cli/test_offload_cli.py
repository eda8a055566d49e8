"""``vmstoolkit experiment offload``: bad options are one line naming the value, exit non-zero,
and are found before the experiment runs (issue 15 items 13 and 16)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from vmstoolkit.cli import app

runner = CliRunner()
SMALL = ["--blocks", "2", "--seq", "16", "--ffn", "128"]
OK_SHAPE = ["--hidden", "64", "--heads", "4"]


def invoke(*args):
    return runner.invoke(app, ["experiment", "offload", *SMALL, *args])


def one_line_error(r, *needles):
    assert r.exit_code != 0, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize("shape,needle", [
    (["--hidden", "256", "--heads", "3"], "hidden=256"),
    (["--hidden", "8", "--heads", "16"], "hidden=8"),
    (["--hidden", "100", "--heads", "3"], "heads=3"),
])
def test_impossible_shapes(shape, needle):
    one_line_error(invoke(*shape), needle)


def test_figure_in_a_missing_folder(tmp_path):
    target = tmp_path / "nowhere" / "fig.png"
    one_line_error(invoke(*OK_SHAPE, "--figure", str(target)), str(target.parent))


def test_figure_with_an_unknown_extension(tmp_path):
    one_line_error(invoke(*OK_SHAPE, "--figure", str(tmp_path / "fig.xyz")), ".xyz", "png")


def test_figure_pointing_at_a_folder_writes_nothing_beside_it(tmp_path):
    d = tmp_path / "figs"
    d.mkdir()
    one_line_error(invoke(*OK_SHAPE, "--figure", str(d)), str(d), "folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figs"] and not any(d.iterdir())


def test_figure_without_an_extension(tmp_path):
    one_line_error(invoke(*OK_SHAPE, "--figure", str(tmp_path / "fig")), "extension")


def test_figure_is_written_where_asked(tmp_path):
    r = invoke(*OK_SHAPE, "--figure", str(tmp_path / "fig.svg"))
    assert r.exit_code == 0, r.output
    assert [p.name for p in tmp_path.iterdir()] == ["fig.svg"]


def test_cuda_backend_without_gpu():
    from vmstoolkit.errors import NoGPUError
    from vmstoolkit.pools.cuda_driver import cuda_init

    try:
        cuda_init(0)
    except NoGPUError:
        pass
    else:
        pytest.skip("this machine has a GPU")
    one_line_error(invoke(*OK_SHAPE, "--backend", "cuda"), "cuda backend", "GPU")
