"""The GPU tests' helpers (``torch_bf16``) are imported by name: pytest runs with
``--import-mode=importlib`` (pyproject.toml), which puts no test folder on ``sys.path``, so this
folder goes there itself."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
