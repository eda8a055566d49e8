import json
import subprocess
import sys
from pathlib import Path

import typer
from typer.testing import CliRunner

from vmstoolkit.cli.offload import offload_command
from vmstoolkit.exec.experiment import run_offload_experiment
from vmstoolkit.exec.graph import LlamaConfig

TINY = LlamaConfig(n_blocks=3, seq=16, hidden=64, heads=4, kv_heads=4, ffn=128)
KEYS = {"budget", "executor", "makespan_s", "lower_bound_s", "offloaded_bytes", "fits_without_offload"}


def test_rows_have_the_required_fields():
    rows = run_offload_experiment("sim", 1, config=TINY, fractions=(1.0, 0.5, 0.01))
    ok = [r for r in rows if "error" not in r]
    assert len(ok) == 4 and {r["executor"] for r in ok} == {"event-driven", "fixed-order"}
    for r in ok:
        assert KEYS <= set(r)
        assert r["makespan_s"] >= r["lower_bound_s"] > 0
        assert r["fits_without_offload"] == (r["budget_fraction"] >= 1.0)
    bad = [r for r in rows if "error" in r]
    assert bad and all("no schedule fits" in r["error"] for r in bad)


def test_cli_json_and_table():
    app = typer.Typer()
    app.command()(offload_command)
    app.command("noop")(lambda: None)  # two commands: Typer keeps "offload_command" as a name
    args = ["offload-command", "--blocks", "2", "--seq", "16", "--hidden", "64", "--heads", "4", "--ffn", "128"]
    r = CliRunner().invoke(app, args + ["--format", "json", "--gpus", "2"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.output.splitlines()]
    assert rows and all(KEYS <= set(x) for x in rows if "error" not in x)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "makespan against budget" in r.output
    r = CliRunner().invoke(app, args[:-2] + ["--ffn", "7", "--parts", "2"])
    assert r.exit_code == 1 and "error" in r.output


def test_gpu_script_dry_run(tmp_path):
    script = Path(__file__).resolve().parents[2] / "experiments" / "offload_gpu.py"
    p = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in (tmp_path / "offload.jsonl").read_text().splitlines()]
    runtime = [r for r in rows if r["kind"] == "runtime"]
    assert len(runtime) == 8 and all(r["equal"] for r in runtime)
    assert json.loads((tmp_path / "summary.json").read_text())["all_equal"]
    assert (tmp_path / "makespan.png").stat().st_size > 0


def test_cuda_backend_imports_without_gpu():
    import vmstoolkit.exec.backends.cuda as c

    assert c._c_strides((2, 3, 4), 4) == (48, 16, 4)
