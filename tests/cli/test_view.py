"""``vmstoolkit view`` (issue 21): one self-contained offline page that carries the data, and that
a real headless browser renders without console errors (skipped only where none is installed)."""

import json
import pickle
import re
import shutil

import pytest
from typer.testing import CliRunner

from vmstoolkit.cli import app
from vmstoolkit.units import MiB

pytest.importorskip("plotly", reason="the [view] extra (plotly) is not installed")
runner = CliRunner()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("view")
    ev, addr = [], 1 << 32
    for i in range(40):  # growing and shrinking blocks on two streams, with frames
        ev.append({"action": "alloc", "addr": addr + i * (1 << 30), "size": (3 + i % 7) * 7 * MiB, "stream": i % 2,
                   "time_us": 1_000_000 + 50_000 * i,
                   "frames": [{"filename": "/home/me/train.py", "line": 10 + i % 3, "name": "step"}]})
        if i % 3 == 2:
            for j in (i - 2, i - 1):
                ev.append({"action": "free_completed", "addr": addr + j * (1 << 30), "size": (3 + j % 7) * 7 * MiB,
                           "stream": j % 2, "time_us": 1_000_000 + 50_000 * i + 10})
    snap = d / "run.pickle"
    snap.write_bytes(pickle.dumps({"device_traces": [ev], "segments": []}))
    out = d / "report.html"
    r = runner.invoke(app, ["view", str(snap), "-a", "pytorch-caching", "-a", "vms", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


def test_page_needs_no_network_and_carries_the_data(report):
    page = report.read_text()
    assert not re.search(r"<script[^>]+src\s*=\s*[\"']?(https?:)?//", page)
    assert not re.search(r"<link[^>]+href\s*=\s*[\"']?(https?:)?//", page)
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly's JS is inlined
    for text in ("pytorch-caching reserved", "vms reserved", "train.py:11 (step)", "stream 1", "stitched",
                 "seconds since the first recorded event"):
        assert text in page, text
    # the x axis is seconds since the first event: the last event is 1.95 s after the first
    data = page[page.index('id="memory-over-time"'):]
    xs = [float(x) for x in re.search(r'"name":"allocated".*?"x":\[([^\]]*)\]', data).group(1).split(",")]
    assert xs[0] == 0.0 and xs[-1] == pytest.approx(1.95, abs=1e-3)


def test_page_renders_in_a_headless_browser(report):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver_bin = shutil.which("chromedriver")
    if not browser or not driver_bin:
        pytest.skip("no headless browser: apt-get install chromium chromium-driver (.ci/run does)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(driver_bin), options=opts)
    try:
        d.set_page_load_timeout(60)
        d.get(report.as_uri())
        plots = d.execute_script(
            "return Array.from(document.querySelectorAll('.js-plotly-plot')).map("
            "p => [p.id, (p.data || []).length, document.querySelectorAll('#' + p.id + ' .trace').length])")
        errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        d.quit()
    assert not errors, json.dumps(errors)[:2000]
    ids = [p[0] for p in plots]
    assert ids == ["memory-over-time", "layout-pytorch-caching", "layout-vms"]
    assert all(n > 0 and drawn > 0 for _, n, drawn in plots), plots  # every figure has data and drew it
