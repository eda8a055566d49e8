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


def test_figure_in_a_missing_folder_makes_it(tmp_path):
    """Issue 37: view --out made missing folders where --figure refused them; both make them now."""
    target = tmp_path / "nowhere" / "fig.png"
    r = invoke(*OK_SHAPE, "--figure", str(target))
    assert r.exit_code == 0 and target.is_file() and f"wrote {target}" in r.output, r.output


def test_figure_under_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    one_line_error(invoke(*OK_SHAPE, "--figure", str(tmp_path / "f" / "fig.png")), str(tmp_path / "f"), "a file")


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
    from vmstoolkit.pools.drivers.cuda import cuda_init

    try:
        cuda_init(0)
    except NoGPUError:
        pass
    else:
        pytest.skip("this machine has a GPU")
    one_line_error(invoke(*OK_SHAPE, "--backend", "cuda"), "cuda backend", "GPU")


def test_budget_option_sizes_and_fractions_in_order():
    import json

    r = invoke(*OK_SHAPE, "--budget", "0.5", "--budget", "1MiB", "--format", "json")
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.output.splitlines()]
    assert [x["budget_spec"] for x in rows] == ["0.5", "0.5", "1MiB", "1MiB"]


@pytest.mark.parametrize("bad", ["nan", "0", "-2GiB", "4096", "lots"])
def test_bad_budget_is_one_line_naming_it(bad):
    one_line_error(invoke(*OK_SHAPE, "--budget", bad), repr(bad))


def test_table_explains_offloaded_and_reloaded_and_why_no_schedule():
    r = invoke(*OK_SHAPE, "--budget", "1.0", "--budget", "16KiB")
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "offloaded" in text and "GPU -> host" in text and "host -> GPU" in text
    assert "no schedule" in text and "needs" in text  # the reason, not only the verdict


def test_schedule_folder_gets_each_budgets_runs(tmp_path):
    r = invoke(*OK_SHAPE, "--budget", "0.5", "--budget", "0.25", "--format", "json", "--schedule", str(tmp_path / "s"))
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert len(names) == 4 and all(n.startswith("schedule_") and n.endswith(("B.json", "B.png")) for n in names)


def test_no_budget_that_fits_exits_non_zero_naming_it():
    r = invoke(*OK_SHAPE, "--budget", "16KiB")
    assert r.exit_code == 1, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("error: no budget fits: budget 16KiB:") and "needs" in last, last
