"""Issue 21 figures: utilization bars end at 1.0; the timeline covers every workload on seconds."""

import numpy as np
import pytest


@pytest.fixture
def saved(monkeypatch):
    # matplotlib imported here, not at collection: the workers that do not run these tests
    # skip its import (0.3 s of CPU each)
    from matplotlib.figure import Figure

    out = []
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: out.append(self))
    return out


@pytest.fixture
def figures(saved):
    from vmstoolkit.analysis import figures

    return figures


def test_utilization_axis_ends_at_one(saved, figures, tmp_path):
    rows = [{"workload": "w", "a.utilization": 0.99}, {"workload": "v", "a.utilization": 0.5}]
    figures.utilization_figure(rows, ["a"], tmp_path / "u.png")
    (ax,) = saved[0].axes
    assert ax.get_ylim() == (0.0, 1.0)


def test_timeline_has_a_panel_per_workload_in_seconds(saved, figures, tmp_path):
    tl = {"allocated": np.array([1, 2, 1]) << 30, "reserved": np.array([2, 2, 2]) << 30,
          "time_us": np.array([5_000_000, 6_000_000, 7_500_000])}
    figures.timeline_figure({"w1": {"a": tl, "b": tl}, "w2": {"a": tl}, "s": {"a": tl}}, tmp_path / "t.png",
                            synthetic={"s"})
    axes = saved[0].axes
    assert [ax.get_title() for ax in axes] == ["w1", "w2", "s (SYNTHETIC workload)"]
    assert axes[0].get_xlabel().startswith("seconds") and axes[2].get_xlabel().startswith("event")
    x = axes[0].lines[0].get_xdata()
    assert list(x) == [0.0, 1.0, 2.5]  # seconds since the first event
