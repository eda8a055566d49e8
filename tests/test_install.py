"""A new user's install: ``pip install .``, the main job, ``pip install -e .`` in the same
environment, and an import again (issue 37's install trap); and a read-only install with no
writable home (attack item 3).

Numba's ``cache=True`` used to write its index and object files into the installed package's
``__pycache__`` folders; pip did not know them, so after the editable reinstall uninstalled the
copy, ``site-packages/vmstoolkit/`` stayed behind as an empty namespace package that shadowed the
editable install, and a read-only install failed at import (``no locator available``).

Fast on purpose (it runs in CI): the virtual environment has no pip of its own and sees this
environment's packages through a ``.pth`` file (numba, setuptools, pip; not this environment's
vmstoolkit, whose editable finder is a ``.pth`` that a plain path line does not run), pip runs
with ``--no-deps --no-build-isolation --no-index --no-compile``, and the compiled code comes from
the user cache the rest of the suite fills (same sources, same cache folder: ``vmstoolkit._jit``).
"""

import contextlib
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "vmstoolkit" / "data" / "traces" / "llama-full.caching.pickle.gz"


def _copy_source(dst: Path) -> Path:
    """The files a build needs, so that pip's build folders and egg-info stay out of the checkout."""
    dst.mkdir()
    for f in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / f, dst / f)
    shutil.copytree(ROOT / "vmstoolkit", dst / "vmstoolkit", ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _venv(path: Path) -> tuple[Path, Path]:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    py = path / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    purelib = Path(purelib)
    parents = [p for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()]
    (purelib / "_parent_env.pth").write_text("\n".join(parents) + "\n")
    return py, purelib


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(NUMBA_ENABLE_CUDASIM="1", **extra)
    return env


def _run(args, cwd, **kw):
    r = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{args}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _pip(py, *args, cwd):
    return _run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                 "--no-compile", "--disable-pip-version-check", *args], cwd=cwd, env=_env())


def _foreign_files(purelib: Path) -> list[str]:
    """Files under the installed package that pip's RECORD does not know (a byte-compiled module
    of a recorded ``.py`` is pip's too: it removes those on uninstall)."""
    record = next(purelib.glob("vmstoolkit-*.dist-info")) / "RECORD"
    known = {line.split(",")[0] for line in record.read_text().splitlines()}
    out = []
    for p in (purelib / "vmstoolkit").rglob("*"):
        if p.is_dir():
            continue
        rel = p.relative_to(purelib).as_posix()
        if rel in known:
            continue
        if p.parent.name == "__pycache__" and p.suffix == ".pyc":
            src = (p.parent.parent / (p.name.split(".")[0] + ".py")).relative_to(purelib).as_posix()
            if src in known:
                continue
        out.append(rel)
    return sorted(out)


@contextlib.contextmanager
def _read_only(installed: Path):
    """The installed package cannot be written, even by root (who writes through any mode bit):
    every folder loses its write bits, and each ``__pycache__`` is a plain file while it lasts."""
    dirs = [installed, *(p for p in installed.rglob("*") if p.is_dir() and p.name != "__pycache__")]
    aside = []
    for d in dirs:
        c = d / "__pycache__"
        if c.is_dir():
            c.rename(d / "__pycache__.aside")
            aside.append(d)
        c.touch()
    for d in dirs:
        d.chmod(d.stat().st_mode & ~0o222)
    try:
        yield
    finally:
        for d in dirs:
            d.chmod(d.stat().st_mode | 0o200)
        for d in dirs:
            (d / "__pycache__").unlink()
        for d in aside:
            (d / "__pycache__.aside").rename(d / "__pycache__")


def _no_home_env() -> dict:
    env = _env(HOME="/dev/null")  # not a folder: nothing can be made below it, not even by root
    for k in ("XDG_CACHE_HOME", "VMSTOOLKIT_CACHE_DIR", "NUMBA_CACHE_DIR"):
        env.pop(k, None)
    return env


def test_install_run_reinstall_editable_import(tmp_path):
    world = tmp_path
    src = _copy_source(world / "src")
    py, purelib = _venv(world / "venv")
    _pip(py, src, cwd=world)
    installed = purelib / "vmstoolkit"
    assert (installed / "__init__.py").is_file()

    # The main job, on one bundled trace: the scanner and paged's heap compile (or load) here.
    out = world / "results"
    _run([world / "venv" / "bin" / "vmstoolkit", "experiment", "fragmentation", TRACE, "-a", "paged",
          "-a", "vms", "--jobs", "1", "--out", out], cwd=world, env=_env())
    assert (out / "fragmentation.json").is_file()
    assert _foreign_files(purelib) == [], "the package wrote into its install folder"

    # A read-only install with no writable home still imports and runs compiled code (attack item 3).
    with _read_only(installed):
        r = _run([py, "-c", "import vmstoolkit.trace.scan, vmstoolkit.pools.paged.replay;"
                  "import numpy as np; from vmstoolkit.pools.paged import heap;"
                  "m = np.zeros(64, np.int64); m[heap.M_NB] = 8; print(heap._bucket(m, 5))"],
                 cwd=world, env=_no_home_env())
        assert r.stdout.strip() == "5", r.stdout
    assert _foreign_files(purelib) == []

    # The editable reinstall uninstalls the copy entirely, and the import finds the editable one.
    _pip(py, "-e", src, cwd=world)
    assert not installed.exists(), sorted(p.relative_to(installed).as_posix() for p in installed.rglob("*"))
    r = _run([py, "-c", "import vmstoolkit, vmstoolkit.pools.paged.heap as h; print(vmstoolkit.__file__)"],
             cwd=world, env=_env())
    assert Path(r.stdout.strip()) == src / "vmstoolkit" / "__init__.py"
