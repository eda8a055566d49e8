"""Every notebook in notebooks/ runs top to bottom, and is saved with its outputs.

The kernel must be the interpreter that runs pytest (the one vmstoolkit is installed in), not
whatever ``python3`` kernelspec a machine happens to have. So the fixture installs a kernelspec
named ``python3`` that points at ``sys.executable`` into a temporary prefix and puts that prefix
first on ``JUPYTER_PATH``: jupyter_client takes the first ``python3`` it finds on that path,
before the user's and the system's. ``test_kernel_is_this_interpreter`` checks that it worked.

Each notebook runs in a temporary working directory, so nothing it writes lands in the repo.
"""

import json
import os
import sys
from pathlib import Path

import pytest

# nbformat and nbclient are imported by the tests that use them, not at collection: the workers
# that run none of these skip the imports

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "python3"  # what the notebooks' metadata names
CELL_TIMEOUT = 120  # seconds per cell


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """``python3`` kernelspec of this interpreter, first on JUPYTER_PATH while the module runs."""
    from ipykernel.kernelspec import install
    from jupyter_client.kernelspec import KernelSpecManager

    prefix = tmp_path_factory.mktemp("jupyter")
    install(kernel_name=KERNEL, prefix=str(prefix), display_name="Python 3 (vmstoolkit tests)")
    data_dir = prefix / "share" / "jupyter"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(data_dir), os.environ.get("JUPYTER_PATH")])))
        mp.delenv("MPLBACKEND", raising=False)  # let ipykernel pick the inline backend
        spec = KernelSpecManager().get_kernel_spec(KERNEL)
        assert spec.argv[0] == sys.executable, f"kernel {KERNEL!r} resolves to {spec.argv} in {spec.resource_dir}"
        yield KERNEL


def run_notebook(nb, kernel_name: str, cwd: Path):
    from nbclient import NotebookClient

    client = NotebookClient(nb, kernel_name=kernel_name, timeout=CELL_TIMEOUT,
                            resources={"metadata": {"path": str(cwd)}})
    return client.execute()


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == [
        "01_fragmentation.ipynb", "02_stitching.ipynb", "03_your_snapshot.ipynb", "04_offload_runtime.ipynb",
        "05_training_under_budget.ipynb"]


def test_kernel_is_this_interpreter(kernel, tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(
        "import json, sys, vmstoolkit\nprint(json.dumps([sys.executable, sys.prefix, vmstoolkit.__file__]))"))
    run_notebook(nb, kernel, tmp_path)
    executable, prefix, package = json.loads(nb.cells[0].outputs[0]["text"])
    import vmstoolkit

    assert os.path.samefile(executable, sys.executable)
    assert prefix == sys.prefix
    assert os.path.samefile(package, vmstoolkit.__file__)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, kernel, tmp_path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    run_notebook(nb, kernel, tmp_path)  # raises CellExecutionError naming the failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_saved_with_outputs(path):
    """Readers on GitHub see results: every code cell was run, in order, without errors.
    After editing a notebook, run ``python scripts/execute_notebooks.py``."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name} not saved executed top to bottom: {counts}"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), f"{path.name} has no figure"
