"""Atomic outputs: the target is either the old one or the complete new one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from selfattn._atomic import atomic_directory, atomic_write_path


def test_atomic_write_path_replaces_on_success_and_keeps_suffix(tmp_path: Path) -> None:
    target = tmp_path / "P.npy"
    target.write_text("old")
    with atomic_write_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".npy" and tmp != target
        tmp.write_text("new")
        assert target.read_text() == "old"  # nothing visible until the block ends
    assert target.read_text() == "new"
    assert os.listdir(tmp_path) == ["P.npy"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_atomic_write_path_leaves_the_old_file_on_failure(tmp_path: Path, error: type[BaseException]) -> None:
    target = tmp_path / "P.csv"
    target.write_text("old")
    with pytest.raises(error), atomic_write_path(target) as tmp:
        tmp.write_text("half")
        raise error()
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["P.csv"]


def test_atomic_write_path_gives_a_readable_file(tmp_path: Path) -> None:
    target = tmp_path / "new.txt"
    with atomic_write_path(target) as tmp:
        tmp.write_text("x")
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_atomic_directory_swaps_the_folder_and_keeps_foreign_files(tmp_path: Path) -> None:
    target = tmp_path / "report"
    with atomic_directory(target) as tmp:
        (tmp / "results.json").write_text("1")
        (tmp / "stale.png").write_text("old figure")
    (target / "notes.txt").write_text("the user's")
    with atomic_directory(target) as tmp:
        assert not (tmp / "results.json").exists()
        (tmp / "results.json").write_text("2")
        (tmp / "stale.png").write_text("new figure")
    assert (target / "results.json").read_text() == "2"
    assert (target / "stale.png").read_text() == "new figure"
    assert (target / "notes.txt").read_text() == "the user's"
    assert os.listdir(tmp_path) == ["report"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_atomic_directory_leaves_the_old_folder_on_failure(tmp_path: Path, error: type[BaseException]) -> None:
    target = tmp_path / "report"
    target.mkdir()
    (target / "results.json").write_text("old")
    with pytest.raises(error), atomic_directory(target) as tmp:
        (tmp / "results.json").write_text("new")
        raise error()
    assert os.listdir(target) == ["results.json"]
    assert (target / "results.json").read_text() == "old"
    assert os.listdir(tmp_path) == ["report"]


def test_atomic_directory_refuses_a_file_and_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="not a folder"), atomic_directory(tmp_path / "f"):
        pass
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="working folder"), atomic_directory("."):
        pass
