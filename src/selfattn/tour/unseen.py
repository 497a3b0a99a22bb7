"""Why a learned table and Shaw's and T5's embeddings by offset answer nothing past the training lengths.

Each of them is a table with one learned row per position (the learned table), per clipped
offset (Shaw) or per distance bucket (T5). A row gets trained only if some training sequence
reaches it. Measured here on the study's own models (:func:`selfattn.study.training.build_model`,
untrained: which rows a sequence reaches depends on its length, not on the weights): the rows
that receive a nonzero gradient from a sequence of the longest training length, against the
rows a sequence of the longest evaluated length reads (the same test: a nonzero gradient).

* ``never_trained``: rows read at the longest evaluated length that no training sequence
  reaches. Training never moves them: they keep their random initial values (less weight decay).
* ``rows`` against ``positions``: how many distinct rows the long sequence reads for how many
  positions (learned) or offsets back (Shaw, T5); fewer rows than offsets means offsets past the
  clip or inside one bucket share a row, so the model cannot tell them apart.

Shape legend: b batch, l positions.
"""

from __future__ import annotations

from typing import Any

import torch

from selfattn.models import TransformerLM
from selfattn.study.tasks import get_task
from selfattn.study.training import RunSpec, StudyConfig, build_model

__all__ = ["ENCODINGS", "rows_reached", "unseen_rows"]

ENCODINGS = ("learned", "shaw", "t5")


def rows_reached(model: TransformerLM, length: int) -> set[int]:
    """Rows of the model's position tables that a sequence of ``length`` tokens sends a gradient to."""
    model.zero_grad(set_to_none=True)
    tokens = torch.randint(3, 10, (1, length), generator=torch.Generator().manual_seed(length))  # (1, l)
    logits = model(tokens)
    assert isinstance(logits, torch.Tensor)  # without return_hidden, the logits alone
    torch.autograd.backward(logits.pow(2).mean())  # every output: every row any query reads
    encoding = model.get_submodule("input_encoding" if model.input_encoding is not None else "position")
    reached: set[int] = set()
    for parameter in encoding.parameters():
        if parameter.grad is not None:
            rows = parameter.grad.reshape(parameter.shape[0], -1).ne(0).any(dim=1)  # one flag per row
            reached |= {int(i) for i in rows.nonzero().flatten()}
    return reached


def unseen_rows(task: str = "copy", config: StudyConfig | None = None) -> dict[str, Any]:
    """For each of :data:`ENCODINGS`, the rows training reaches and those the longest evaluated sequence reads.

    Args:
        task: the study's task whose sequence lengths are used.
        config: the study's settings (default :class:`StudyConfig`): the training and evaluated lengths.

    Returns:
        ``{"task", "train_len", "eval_len", "train_tokens", "eval_tokens" (sequence lengths),
        "encodings": {name: {"rows_trained", "rows_read", "never_trained", "positions"}}}``.
    """
    config = config or StudyConfig()
    shape = get_task(task)
    train_tokens, eval_tokens = shape.sequence_len(config.train_len), shape.sequence_len(config.eval_len)
    found: dict[str, dict[str, int]] = {}
    for name in ENCODINGS:
        model = build_model(RunSpec(task, name, 0), config)
        trained = rows_reached(model, train_tokens)
        read = rows_reached(model, eval_tokens)
        found[name] = {
            "rows_trained": len(trained),
            "rows_read": len(read),
            "never_trained": len(read - trained),
            "positions": eval_tokens,  # positions (learned) or causal offsets 0 .. l - 1 back (Shaw, T5)
        }
    return {
        "task": task,
        "train_len": config.train_len,
        "eval_len": config.eval_len,
        "train_tokens": train_tokens,
        "eval_tokens": eval_tokens,
        "encodings": found,
    }
