"""Issue 37 "The CLI": one consistency check over every command's ``--help``. A flag name, and a
short letter, means the same thing everywhere; the flags that commands share are there; help
texts come out as written; ``-a <TAB>`` completes allocator names."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from vmstoolkit.cli import app

runner = CliRunner(env={"COLUMNS": "1000"})  # no folding: a help text stays on one line
TOP = get_command(app)

# What a name means wherever it stands: its value as the help shows it (a flag: none).
MEANING = {
    "--allocator": "NAME", "--option": "[ALLOC:]KEY=VALUE", "--capacity": "SIZE", "--format": "[table|json|csv]",
    "--backend": "sim|cuda", "--gpu": "N", "--lenient": "", "--max-bytes": "SIZE", "--max-objects": "N",
    "--oom-exit-code": "N", "--jobs": "N", "--cluster": "local:N|ADDRESS",
}
SHORT = {"-a": "--allocator", "-o": "--option", "-f": "--format", "-g": "--grid"}
SNAPSHOT_FLAGS = {"--allocator", "--option", "--capacity", "--gpu", "--lenient", "--max-bytes", "--max-objects",
                  "--oom-exit-code"}
# Commands that replay snapshots in bulk take every flag of SNAPSHOT_FLAGS; those that print rows, --format.
BULK = ["replay", "sweep", "experiment fragmentation"]
PRINT_ROWS = ["replay", "sweep", "compare", "info", "experiment offload", "experiment train-offload",
              "run generate", "run train"]


def commands(group=TOP, prefix=()):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from commands(cmd, (*prefix, name))
        else:
            yield " ".join((*prefix, name)), cmd


COMMANDS = dict(commands())


def flags(name: str) -> dict[str, tuple[list[str], str]]:
    """``{long name: (its short names, its value)}`` of one command, as its --help shows them
    (hidden aliases of old names are not shown, and not counted)."""
    cmd = COMMANDS[name]
    ctx = cmd.make_context(name.split()[-1], [], resilient_parsing=True)
    out = {}
    for p in cmd.params:
        record = p.get_help_record(ctx) if p.param_type_name == "option" else None
        if record is None:
            continue
        head = record[0].split(" / ")[0]  # --lenient / --no-lenient: a flag
        m = re.fullmatch(r"(-{1,2}[\w-]+(?:, -{1,2}[\w-]+)*)\s*(.*)", head)
        assert m, f"{name}: cannot read {record[0]!r}"
        decls, value = m.group(1).split(", "), m.group(2) if " / " not in record[0] else ""
        longs = [d for d in decls if d.startswith("--")]
        for long in longs:
            out[long] = ([d for d in decls if not d.startswith("--")], value.strip())
    return out


def test_every_command_is_checked():
    assert {"replay", "allocators", "compare", "view", "record", "info", "sweep", "experiment fragmentation",
            "experiment offload", "experiment train-offload"} <= set(COMMANDS)


def test_a_name_means_the_same_everywhere():
    seen: dict[str, dict[str, str]] = defaultdict(dict)
    letters: dict[str, dict[str, str]] = defaultdict(dict)
    for name in COMMANDS:
        for long, (shorts, value) in flags(name).items():
            seen[long][name] = value
            for s in shorts:
                letters[s][name] = long
    for long, where in seen.items():
        values = set(where.values())
        if long in MEANING:
            assert values == {MEANING[long]}, f"{long} takes {where}, not {MEANING[long]!r} everywhere"
        elif long != "--out":  # --out: a FILE or a DIR, the command's output either way
            assert len(values) == 1, f"{long} means different things: {where}"
    for letter, where in letters.items():
        assert set(where.values()) == {SHORT[letter]}, f"{letter} stands for {where}"
    # a device number is --gpu everywhere; --device is never one (it is replay's old name of --backend)
    assert seen["--gpu"].keys() >= {"replay", "sweep", "experiment fragmentation", "info"}
    assert set(seen.get("--device", {}).values()) <= {"sim|cuda"}


def test_shared_flags_are_where_they_belong():
    for name in BULK:
        missing = SNAPSHOT_FLAGS - set(flags(name))
        assert not missing, f"{name} lacks {sorted(missing)}"
    for name in PRINT_ROWS:
        assert flags(name)["--format"] == (["-f"], "[table|json|csv]"), name
    for name in ["compare", "view"]:
        assert {"--allocator", "--option", "--capacity"} <= set(flags(name)), name


def test_old_names_still_work(monkeypatch):
    """info's --device N and --json stay, hidden, beside --gpu and --format json."""
    import json

    old = runner.invoke(app, ["info", "--device", "0", "--json"])
    new = runner.invoke(app, ["info", "--gpu", "0", "--format", "json"])
    assert old.exit_code == new.exit_code == 0, old.output + new.output
    assert json.loads(old.stdout).keys() == json.loads(new.stdout).keys()
    r = runner.invoke(app, ["info", "--gpu", "0", "--device", "1"])
    assert r.exit_code == 2 and "--gpu 0 and --device 1" in r.output


def _bracketed(text: str) -> list[str]:
    return re.findall(r"\S*\[[^\]\s]+\]\S*", text or "")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_prints_brackets_as_written(name):
    """Rich read ``[cluster]`` as markup: ``pip install 'vmstoolkit[cluster]'`` came out as
    ``pip install 'vmstoolkit'`` in sweep's and fragmentation's help."""
    cmd = COMMANDS[name]
    r = runner.invoke(app, [*name.split(), "--help"])
    assert r.exit_code == 0, r.output
    texts = [getattr(p, "help", "") or "" for p in cmd.params] + [cmd.help or ""]
    written = [w.replace("\\[", "[") for t in texts for w in _bracketed(t)]  # as the source has them
    for w in written:
        assert w.strip("'\".,;:()") in r.stdout, f"`vmstoolkit {name} --help` lost {w!r}"


def test_install_hint_keeps_its_extra():
    for name in ("sweep", "experiment fragmentation"):
        r = runner.invoke(app, [*name.split(), "--help"])
        assert "pip install 'vmstoolkit[cluster]'" in r.stdout, name
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    assert doc.count("vmstoolkit[cluster]") >= 2 and "pip install &#x27;vmstoolkit&#x27;" not in doc


def complete(args: list[str], incomplete: str) -> list[str]:
    """What bash completion offers for ``vmstoolkit ARGS INCOMPLETE<TAB>``."""
    words = ["vmstoolkit", *args, incomplete]
    r = runner.invoke(app, [], prog_name="vmstoolkit", env={
        "_VMSTOOLKIT_COMPLETE": "complete_bash", "COMP_WORDS": " ".join(words), "COMP_CWORD": str(len(words) - 1)})
    assert r.exit_code == 0, r.output
    return r.stdout.split()


@pytest.mark.parametrize("args", [["replay", "-a"], ["sweep", "--allocator"], ["compare", "-a"], ["view", "-a"],
                                  ["experiment", "fragmentation", "-a"], ["allocators"]])
def test_allocator_names_complete(args):
    assert complete(args, "pytorch") == ["pytorch-caching", "pytorch-expandable"]
    assert "vms" in complete(args, "")
