"""``view``'s layout figure says which segments it leaves out, and ``--segments`` shows them
(issue 37: the layout was capped at 48 of 191 segments without saying so)."""

import pickle

import pytest
from typer.testing import CliRunner

from vmstoolkit.analysis.view import view_data
from vmstoolkit.cli import app
from vmstoolkit.units import MiB

SEGMENTS = 12


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """SEGMENTS live 20-31 MiB blocks at the peak: pytorch-caching gives each its own segment."""
    ev = [{"action": "alloc", "addr": (1 << 32) + i * (1 << 30), "size": (20 + i) * MiB, "stream": 0, "time_us": i}
          for i in range(SEGMENTS)]
    p = tmp_path_factory.mktemp("view") / "many.pickle"
    p.write_bytes(pickle.dumps({"device_traces": [ev], "segments": []}))
    return p


def test_the_view_counts_the_segments_it_does_not_draw(snapshot):
    _, (v,), _ = view_data(snapshot, ["pytorch-caching"], {}, None, max_segments=5)
    assert v.segments == SEGMENTS and len(v.layout) == 5 and v.hidden == SEGMENTS - 5
    assert [r["size"] for r in v.layout] == sorted((r["size"] for r in v.layout), reverse=True)
    assert v.hidden_bytes + sum(r["size"] for r in v.layout) == v.peak_reserved
    _, (every,), _ = view_data(snapshot, ["pytorch-caching"], {}, None, max_segments=None)
    assert len(every.layout) == SEGMENTS and every.hidden == 0 and every.hidden_bytes == 0


def test_the_page_says_what_is_hidden_and_how_to_see_it(snapshot, tmp_path):
    pytest.importorskip("plotly", reason="the [view] extra (plotly) is not installed")
    runner = CliRunner()
    out = tmp_path / "r.html"
    r = runner.invoke(app, ["view", str(snapshot), "-a", "pytorch-caching", "--segments", "5", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert f"the 5 largest of {SEGMENTS} segments drawn; 7 smaller ones" in out.read_text()
    assert "--segments all draws every one" in out.read_text()
    r = runner.invoke(app, ["view", str(snapshot), "-a", "pytorch-caching", "--segments", "all", "--out", str(out)])
    assert r.exit_code == 0 and "segments drawn" not in out.read_text()
    r = runner.invoke(app, ["view", str(snapshot), "--segments", "0", "--out", str(out)])
    assert r.exit_code == 2 and "--segments" in r.output
