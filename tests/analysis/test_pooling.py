"""Pooling training calls' step times (made-up calls; the runs themselves need a GPU)."""

import json

import pytest

from vmstoolkit.analysis import pooling as pool_runs
from vmstoolkit.errors import VmsError


def _call(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(mode, steady, variant="lora"):
    return {"mode": mode, "variant": variant, "step_times": [9.0, 9.0] + list(steady)}  # first round: warm-up


def test_pools_steady_steps_of_every_process_over_calls(tmp_path):
    a = _call(tmp_path / "a.jsonl", [_row("default", [1.0, 1.0]), _row("paged", [1.2, 1.2]),
                                     _row("paged", [1.0, 1.0], variant="full"),
                                     {"mode": "paged", "variant": "lora", "error": "crashed"}])
    b = _call(tmp_path / "b.jsonl", [_row("default", [2.0, 2.0]), _row("paged", [1.8, 1.8])])
    calls = [pool_runs.load(p, "lora", ("default", "paged"), steps_per_round=2) for p in (a, b)]
    assert calls[0] == {"default": [[1.0, 1.0]], "paged": [[1.2, 1.2]]}  # warm-up, other variants, failures out
    res = pool_runs.pooled(calls, "default", "paged", resamples=200)
    assert res["per_call"] == pytest.approx([1.2, 0.9])
    assert res["ratio"] == pytest.approx(1.5 / 1.5)  # medians of [1, 1, 2, 2] and [1.2, 1.2, 1.8, 1.8]
    assert res["processes"] == {"default": 2, "paged": 2}
    # one process per mode per call: every resample is the whole data, so the interval is the point
    assert res["interval_95"] == pytest.approx([res["ratio"], res["ratio"]])


def test_resampling_processes_widens_the_interval_when_processes_disagree(tmp_path):
    rows = [_row("default", [1.0] * 4), _row("default", [1.0] * 4),
            _row("paged", [0.9] * 4), _row("paged", [1.1] * 4)]
    calls = [pool_runs.load(_call(tmp_path / "c.jsonl", rows), "lora", ("default", "paged"), 2)]
    res = pool_runs.pooled(calls, "default", "paged", resamples=500)
    lo, hi = res["interval_95"]
    assert lo == pytest.approx(0.9) and hi == pytest.approx(1.1)  # all-slow and all-fast resamples occur


def test_no_common_call_is_an_error_naming_the_modes(tmp_path):
    calls = [pool_runs.load(_call(tmp_path / "d.jsonl", [_row("default", [1.0])]), "lora", ("default", "paged"), 2)]
    with pytest.raises(VmsError, match="'default' and 'paged'"):
        pool_runs.pooled(calls, "default", "paged")


def test_a_model_keeps_only_its_rows_and_unnamed_rows_are_llamas(tmp_path):
    rows = [_row("default", [1.0]), {**_row("default", [3.0]), "model": "llama3-1b"},
            {**_row("paged", [3.3]), "model": "llama3-1b"}, _row("paged", [1.0])]
    path = _call(tmp_path / "m.jsonl", rows)
    big = pool_runs.load(path, "lora", ("default", "paged"), 2, model="llama3-1b")
    assert big == {"default": [[3.0]], "paged": [[3.3]]}
    assert pool_runs.load(path, "lora", ("default", "paged"), 2, model="llama") == {"default": [[1.0]], "paged": [[1.0]]}
    assert len(pool_runs.load(path, "lora", ("default", "paged"), 2)["default"]) == 2  # no model: every row
