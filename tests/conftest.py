import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from selfattn.core import dispatch

sys.path.insert(0, os.path.dirname(__file__))  # tests/reference.py

torch.set_num_threads(1)  # pytest -n 2 runs two workers on two cores
# Every call whose route the dispatcher remembers is also chosen in full, and the two must agree.
dispatch.VERIFY_REMEMBERED_CHOICES = True
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
# pytest --hypothesis-profile=deep: thousands of cases for a developer (tests/test_fuzz_routes.py: 400 per route).
settings.register_profile("deep", max_examples=400, deadline=None)
settings.load_profile("ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked ``gpu`` where CUDA is missing (CI): one place, not a skipif per test."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (pytest -m gpu on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documentation site of this checkout, built once with ``mkdocs build --strict`` (as ``make docs``).

    Shared by tests/test_docs.py and tests/test_docs_coverage.py: one build (minutes under load) for both.
    """
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]' (make test installs it)")
    pytest.importorskip(
        "mkdocstrings_handlers.python", reason="mkdocstrings[python] is not installed: pip install -e '.[docs]'"
    )
    root = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(root / "mkdocs.yml")]
    build = subprocess.run(
        [*command, "--site-dir", str(out)], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    return out
