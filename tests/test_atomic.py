"""Atomic outputs: the target is either the old one or the complete new one."""

from __future__ import annotations

import errno
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


def record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every fsync from now on, as (path, what the path held then): a file's text, or "folder"."""
    calls: list[tuple[str, str]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        calls.append((path, "folder" if os.path.isdir(path) else Path(path).read_text()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads which file a descriptor is from /proc")
def test_atomic_write_path_syncs_the_data_before_the_rename_and_the_folder_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "results.json"
    calls = record_fsyncs(monkeypatch)
    with atomic_write_path(target) as tmp:
        tmp.write_text("new")
    # The temporary file holding the new data, then the folder holding the renamed entry.
    assert calls == [(str(tmp), "new"), (str(tmp_path), "folder")]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads which file a descriptor is from /proc")
def test_atomic_directory_syncs_every_file_and_folder_then_the_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "report"
    calls = record_fsyncs(monkeypatch)
    with atomic_directory(target) as tmp:
        (tmp / "figures").mkdir()
        (tmp / "figures" / "a.svg").write_text("a")
        (tmp / "report.html").write_text("page")
    synced = dict(calls)
    assert synced[str(tmp / "figures" / "a.svg")] == "a" and synced[str(tmp / "report.html")] == "page"
    assert synced[str(tmp / "figures")] == synced[str(tmp)] == "folder"
    assert calls[-1] == (str(tmp_path), "folder")  # after the rename


def test_errors_name_the_target_never_the_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "figure.png"
    with pytest.raises(OSError) as failed, atomic_write_path(target) as tmp:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp))  # as a writer reports a full disk
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(target)

    def no_rename(source: object, destination: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(source), str(destination))

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(PermissionError) as failed, atomic_write_path(target) as tmp:
        tmp.write_text("x")
    assert failed.value.filename == str(target) and ".tmp-" not in str(failed.value)
    assert os.listdir(tmp_path) == []


def test_errors_inside_a_temporary_folder_name_the_same_place_in_the_target(tmp_path: Path) -> None:
    target = tmp_path / "report"
    with pytest.raises(OSError) as failed, atomic_directory(target) as tmp:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "figures" / "a.png"))
    assert failed.value.filename == str(target / "figures" / "a.png")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a folder no one can create files in (/proc)")
def test_a_folder_that_takes_no_new_file_is_named_as_the_caller_gave_it() -> None:
    with pytest.raises(OSError) as failed, atomic_write_path("/proc/x.png"):
        pass
    assert failed.value.filename == "/proc/x.png"
    with pytest.raises(OSError) as failed, atomic_directory("/proc/report"):
        pass
    assert failed.value.filename == "/proc/report"


def test_a_file_where_a_folder_is_wanted_is_said_in_words(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    words = r"cannot write '.*f/sub/x.png': '.*f' is a file, not a folder"
    with pytest.raises(ValueError, match=words), atomic_write_path(tmp_path / "f" / "sub" / "x.png"):
        pass
    words = r"cannot write '.*f/report': '.*f' is a file, not a folder"
    with pytest.raises(ValueError, match=words), atomic_directory(tmp_path / "f" / "report"):
        pass
    with pytest.raises(ValueError, match=r"cannot write the file '.*': it is a folder"), atomic_write_path(tmp_path):
        pass
    assert os.listdir(tmp_path) == ["f"]
