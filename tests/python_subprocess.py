"""Run Python code in a fresh interpreter, with chosen top-level packages made unimportable."""

from __future__ import annotations

import os
import subprocess
import sys

# A finder that makes an import fail as it does where the package is not installed.
_BLOCK = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
"""


def run_python(code: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python -c code`` with this process's import path, ``blocked`` packages absent."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    source = _BLOCK.format(blocked=set(blocked)) + code
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, env=env, timeout=300)
