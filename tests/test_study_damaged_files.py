"""What a study folder holds that the study did not write whole: each refused naming the file, or cleared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from selfattn.study.runner import _Distributed, pending_runs, prepare_runs_folder, refuse_other_settings
from selfattn.study.training import RunSpec, _load_checkpoint


def test_a_damaged_checkpoint_is_a_value_error_naming_it(tmp_path: Path) -> None:
    """torch's RuntimeError ("failed finding central directory") came out as a traceback on --resume."""
    path = tmp_path / "copy-rotary-s0.pt"
    path.write_bytes(b"PK\x03\x04 not a whole checkpoint")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=rf"checkpoint {path} cannot be read .* remove it to start that run over"):
        _load_checkpoint(path, model, torch.optim.SGD(model.parameters(), lr=0.1), None)


def test_a_run_record_that_is_not_its_run_s_is_refused_naming_it(tmp_path: Path) -> None:
    """Any runs/KEY.json counted as finished: a truncated one stopped the merge with a JSON message naming no file,
    and {} with a KeyError traceback."""
    finished, damaged, other = (RunSpec("copy", name, 0) for name in ("alibi", "rotary", "none"))
    (tmp_path / f"{finished.key}.json").write_text(json.dumps({**finished.as_dict(), "steps": 3}))
    waiting = RunSpec("copy", "t5", 0)
    assert pending_runs([finished, waiting], tmp_path) == [waiting]
    (tmp_path / f"{damaged.key}.json").write_text('{"task": "co')
    with pytest.raises(ValueError, match=rf"{damaged.key}.json is not a finished run's record \(Unterminated"):
        pending_runs([finished, damaged], tmp_path)
    (tmp_path / f"{other.key}.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"not a finished run's record \(not the record of run {other.key}\)"):
        pending_runs([other], tmp_path)
    config = tmp_path / "config.json"
    config.write_text("{")
    with pytest.raises(ValueError, match=rf"--resume: {config} cannot be read"):
        refuse_other_settings(config, {"study": {}}, tmp_path)


def test_a_new_study_clears_the_results_of_the_one_before(tmp_path: Path) -> None:
    """An interrupted new study left the earlier study's results.json and study.html beside its own config.json;
    --resume keeps them."""
    made = ("results.json", "study.html", "text.md", "figures/a.png")
    for name in made:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("earlier study")
    prepare_runs_folder(tmp_path, {"study": {"steps": 3}}, _Distributed(), resume=True)
    assert all((tmp_path / name).exists() for name in made)
    prepare_runs_folder(tmp_path, {"study": {"steps": 3}}, _Distributed(), resume=False)
    assert not any((tmp_path / name).exists() for name in made)
    assert (tmp_path / "config.json").is_file() and (tmp_path / "runs").is_dir()


def test_a_memory_error_without_a_message_says_out_of_memory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed "MemoryError:" and nothing after (the exception object, not its text, was tested)."""
    import selfattn.cli.compare as compare
    from selfattn.cli.main import main

    def out_of_memory(args: object) -> int:
        raise MemoryError

    monkeypatch.setattr(compare, "run", out_of_memory)
    assert main(["compare"]) != 0
    assert capsys.readouterr().err == "selfattn compare: error: MemoryError: out of memory\n"
