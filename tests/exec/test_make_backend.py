"""``make_backend``: the one place that picks the runtime's backend (issue 35, item 4)."""

import ast
from pathlib import Path

import pytest

import vmstoolkit
from vmstoolkit.exec.backends import BACKENDS, BackendKind, backend_kind, make_backend
from vmstoolkit.exec.backends.sim import SimBackend
from vmstoolkit.exec.errors import InvalidOptionError
from vmstoolkit.exec.experiment import run_offload_experiment
from vmstoolkit.exec.train_experiment import run_train_experiment


def test_kinds_and_the_sim_backend():
    assert BACKENDS == ("sim", "cuda")
    assert backend_kind("cuda") is BackendKind.cuda and BackendKind.cuda.real and not BackendKind.sim.real
    be = make_backend("sim", seed=3, jitter=0.0)
    assert isinstance(be, SimBackend) and be.jitter == 0.0


@pytest.mark.parametrize("run", [lambda: make_backend("gpu"), lambda: run_offload_experiment("gpu"),
                                 lambda: run_train_experiment("gpu")])
def test_an_unknown_backend_is_one_error_naming_it(run):
    with pytest.raises(InvalidOptionError, match="unknown backend 'gpu'"):
        run()


def test_backends_are_constructed_only_in_make_backend():
    """No module of the package but ``exec/backends`` builds a backend class itself."""
    root = Path(vmstoolkit.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        if path.parts[-3:-1] == ("exec", "backends"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if name in ("SimBackend", "CudaBackend"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, f"backends built outside make_backend: {found}"


def test_doctests():
    import doctest

    import vmstoolkit.exec.backends as backends

    assert doctest.testmod(backends).failed == 0
