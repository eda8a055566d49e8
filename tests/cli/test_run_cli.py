"""``vmstoolkit run generate|train`` on the tiny checkpoints: the JSON rows' keys, the tokens
transformers gives, the options of the issue, one-line refusals."""

import json

import pytest
from typer.testing import CliRunner

from tests.exec.model.helpers import fixture, folder
from vmstoolkit.cli import app

runner = CliRunner()
GEN_KEYS = {"prompt_ids", "tokens", "prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s",
            "offloaded_bytes", "reloaded_bytes", "moved_bytes", "budget", "budget_fraction", "host_plan_bytes",
            "working_set", "backend", "n_gpus", "new_tokens", "prompt_len", "makespan_s", "compile_s"}
TRAIN_KEYS = {"budget", "executor", "variant", "step_s", "lower_bound_s", "offloaded_bytes", "reloaded_bytes",
              "recomputed_flops", "plan_s", "max_abs_grad_err", "host_plan_bytes", "steps_s"}


def rows(res):
    assert res.exit_code == 0, res.output
    return [json.loads(line) for line in res.stdout.splitlines()]


def test_generate_json_rows_carry_prompt_ids_tokens_timings_and_bytes():
    fx = fixture("llama-sharded")
    ids = ",".join(map(str, fx["prompt_ids"]))
    res = runner.invoke(app, ["run", "generate", "--model", str(folder("llama-sharded")), "--budget", "16GiB",
                              "--budget", "0.25", "--prompt-ids", ids, "--new-tokens", str(len(fx["tokens"])),
                              "--backend", "sim", "--host-budget", "4GiB", "--format", "json", "--gpus", "1"])
    out = rows(res)
    assert len(out) == 2 and all(GEN_KEYS <= set(r) for r in out)
    for r in out:
        assert r["prompt_ids"] == fx["prompt_ids"].tolist() and r["tokens"] == fx["tokens"].tolist()
    assert out[0]["budget"] == 16 * 2**30 and out[0]["moved_bytes"] == 0 and out[1]["reloaded_bytes"] > 0
    assert "first row after" in res.stderr and "planning at 0.25" in res.stderr


def test_generate_with_a_drawn_prompt_table_and_csv():
    args = ["run", "generate", "--model", str(folder("qwen2")), "--prompt-len", "12", "--new-tokens", "3"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output and "greedy generation" in res.stdout
    res = runner.invoke(app, [*args, "--format", "csv"])
    assert res.exit_code == 0 and res.stdout.splitlines()[0].count(",") > 10


def test_train_json_rows_have_train_offloads_keys():
    res = runner.invoke(app, ["run", "train", "--model", str(folder("llama-tied")), "--budget", "24GiB",
                              "--budget", "0.3", "--variant", "lora", "--seq", "16", "--steps", "2", "--rank", "2",
                              "--format", "json", "--executor", "event-driven"])
    out = rows(res)
    assert len(out) == 2 and all(TRAIN_KEYS <= set(r) for r in out)
    assert all(r["max_abs_grad_err"] < 1e-3 for r in out)
    assert out[1]["reloaded_bytes"] > 0


@pytest.mark.parametrize("args,match", [
    (["generate", "--prompt-len", "3", "--prompt-ids", "1,2"], "give --prompt-len or --prompt-ids, not both"),
    (["generate", "--prompt-ids", "1,x"], "--prompt-ids takes comma-separated token ids"),
    (["generate", "--prompt-ids", "1,999"], "prompt id 999 is outside the vocabulary"),
    (["generate", "--budget", "lots"], "--budget"),
    (["generate", "--host-budget", "12 apples"], "--host-budget"),
    # --budget given: the default (the working set, 1.0) is searched by 40 compilations, 13 s of CPU
    # here; test_generate_with_a_drawn_prompt_table_and_csv runs generate on the default
    (["generate", "--prompt-len", "8", "--budget", "24GiB", "--host-budget", "1KiB"],
     r"needs .* of host memory .* 1.00 KiB available \(--host-budget\)"),
    (["train", "--seq", "8", "--host-budget", "1KiB", "--variant", "full"],
     r"needs .* of host memory \(.*optimizer state and inputs .*\), 1.00 KiB available \(--host-budget\)"),
])
def test_bad_input_is_one_line(args, match):
    import re

    res = runner.invoke(app, ["run", args[0], "--model", str(folder("llama-tied")), *args[1:]])
    assert res.exit_code in (1, 2), res.output
    err = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and re.search(match, err[0]), res.stderr


def test_a_folder_that_is_not_a_model_is_one_line(tmp_path):
    res = runner.invoke(app, ["run", "generate", "--model", str(tmp_path), "--prompt-len", "2"])
    assert res.exit_code == 1 and "has no config.json" in res.stderr and "Traceback" not in res.output


@pytest.mark.parametrize("command", ["generate", "train"])
def test_a_run_where_no_budget_fits_exits_non_zero_with_the_reason(command):
    # the rows still say why (a table a user reads), but a script must not see success when
    # nothing ran: exit status 1 and one error line naming the budget and the reason
    extra = ["--new-tokens", "2", "--prompt-len", "4"] if command == "generate" else ["--seq", "4", "--steps", "2"]
    res = runner.invoke(app, ["run", command, "--model", str(folder("llama-tied")), "--budget", "1B", *extra])
    assert res.exit_code == 1, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("error: no budget fits:") and "1B" in last and "needs" in last, last
    # one budget that fits among those that do not: success, as before
    res = runner.invoke(app, ["run", command, "--model", str(folder("llama-tied")), "--budget", "1B",
                              "--budget", "1.0", *extra])
    assert res.exit_code == 0, res.output
