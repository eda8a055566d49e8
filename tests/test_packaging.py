"""The package's metadata says what is true of the environment it is tested in (issue 37:
the CUDA classifier said 12 beside cuda-bindings 13; issue 35 item 6: Python 3.10 was claimed
while the code needs 3.11)."""

import re
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_cuda_classifier_names_the_installed_cuda_bindings_major():
    majors = {int(m) for c in PROJECT["classifiers"] for m in re.findall(r"NVIDIA CUDA :: (\d+)$", c)}
    assert int(version("cuda-bindings").split(".")[0]) in majors, majors


def test_the_oldest_python_claimed_is_the_one_required_and_this_one_satisfies_it():
    low = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)", PROJECT["requires-python"]).groups())
    claimed = sorted(tuple(int(x) for x in m.groups()) for c in PROJECT["classifiers"]
                     if (m := re.fullmatch(r"Programming Language :: Python :: (\d+)\.(\d+)", c)))
    assert claimed and claimed[0] == low, (claimed, low)
    assert sys.version_info[:2] >= low



def test_every_disk_cached_compiled_function_uses_the_user_cache_folder():
    """Numba's own ``cache=True`` writes into the install folder (issue 37's install trap): every
    module of the package that caches compiled code takes ``njit`` from ``vmstoolkit._jit``."""
    import ast

    offenders = []
    for p in sorted((ROOT / "vmstoolkit").rglob("*.py")):
        if p.name == "_jit.py":
            continue
        tree = ast.parse(p.read_text(), str(p))
        ours = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and n.module == "vmstoolkit._jit" for a in n.names}
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and any(k.arg == "cache" and getattr(k.value, "value", None) is True
                                               for k in n.keywords):
                if not (isinstance(n.func, ast.Name) and n.func.id in ours):
                    offenders.append(f"{p.relative_to(ROOT).as_posix()}:{n.lineno}")
    assert offenders == [], offenders
