"""The claims about the code and the layer itself (the summary and frameworks pages), and the three exercises.

The exercises are answered by trained models: the tour's own small ones
(:mod:`selfattn.tour.exercises`), or ``selfattn study --exercises``'s when its folder is read.
"""

from __future__ import annotations

from typing import Any

from selfattn.tour.claims._base import _claim

__all__ = ["code_claims", "exercise_claims"]


def _layer_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """What the layer is: a weighted average, the Transformer's block, its shape, one input three times."""
    shape = results["self_attention"]["shape"]
    masked = results["self_attention"]["masked"]
    return [
        _claim(
            "weighted-average",
            "summary",
            "The output for each token is a weighted average of all tokens, with weights determined by query-key "
            "compatibility.",
            "Each output row is the attention weights (non-negative, summing to 1) times the value rows.",
            "derived",
            {"largest |row sum - 1| of the weights (section 1)": masked["row_sum_error"]},
            "rows sum to 1 (to rounding)",
            masked["row_sum_error"] < 1e-5,
            basis="the softmax over the scores makes each row of weights non-negative and sum to 1, by construction",
        ),
        _claim(
            "elementary-block",
            "summary",
            "This is the elementary block of every Transformer encoder and decoder layer.",
            "Every Transformer encoder and decoder layer is built around self-attention.",
            "not shown",
            None,
            "a statement about an architecture",
            None,
            basis="a statement about the Transformer's design (Vaswani et al. 2017), which no run can measure; the "
            "tour's own stacks (section 8) are selfattn.models.TransformerBlock, one self-attention each",
        ),
        _claim(
            "n-grams",
            "chapter",
            "one-dimensional CNNs can process local features such as $n$-grams in text.",
            "One convolution of width k reads the k tokens up to each position: a k-gram.",
            "derived",
            {"layers of width 3 before input 1 reaches output 5": results["comparison"]["x1_to_x5"]["layers"]},
            "a window of k tokens per layer",
            results["comparison"]["x1_to_x5"]["layers"] == 2,
            basis="the receptive field of a width-k convolution is k tokens by construction (nn.Conv1d); the count "
            "of layers restates it",
        ),
        _claim(
            "self-attention-shape",
            "chapter",
            "The output tensor has the same shape.",
            "Self-attention outputs a tensor of its input's shape.",
            "derived",
            shape["shape"],
            str(shape["expected"]),
            shape["ok"],
            basis="how the layer is written: one output row per query, W_o maps back to d features",
            also_on=("note", "summary", "frameworks"),
        ),
        _claim(
            "same-input",
            "chapter",
            "In self-attention, the queries, keys, and values all come from the same place.",
            "Queries, keys and values are the same input.",
            "derived",
            None,
            "attention(X, X, X)",
            True,
            basis="the definition: the tour calls the layer with X three times",
            also_on=("note", "slides", "summary", "frameworks"),
        ),
    ]


_PRINTED_MODULE = (
    "MultiHeadAttention( (attention): DotProductAttention( (dropout): Dropout(p=0.5, inplace=False) ) "
    "(W_q): Linear(in_features=100, out_features=100, bias=False) "
    "(W_k): Linear(in_features=100, out_features=100, bias=False) "
    "(W_v): Linear(in_features=100, out_features=100, bias=False) "
    "(W_o): Linear(in_features=100, out_features=100, bias=False) )"
)


def _printed_module(results: dict[str, Any]) -> dict[str, object]:
    """The frameworks page prints its PyTorch layer: four bias-free 100 x 100 projections around the attention."""
    projections = results["self_attention"]["shape"].get("projections")
    if projections is None:  # a results.json written before the tour recorded the projections
        return _claim("printed-module", "frameworks", _PRINTED_MODULE, _PRINTED_STATEMENT, "not shown", None,
                      "[100, 100, no bias] for each", None, basis="this run did not record the layer's projections")  # fmt: skip
    return _claim(
        "printed-module", "frameworks", _PRINTED_MODULE, _PRINTED_STATEMENT, "derived",
        {name: f"{i} -> {o}, {'bias' if bias else 'no bias'}" for name, (i, o, bias) in projections.items()},
        "W_q, W_k, W_v, W_o: 100 -> 100, no bias",
        all(entry == [100, 100, False] for entry in projections.values()),
        basis="how selfattn.attention.MultiHeadAttention(100, 5, 0.5) is written (section 1 builds it); its "
        "dropout sits in the layer itself rather than in a DotProductAttention submodule",
    )  # fmt: skip


_PRINTED_STATEMENT = (
    "The tab's PyTorch layer (this quote is its printed module, not a sentence) holds four bias-free 100 x 100 "
    "projections W_q, W_k, W_v and W_o; selfattn's layer of the same sizes holds the same four."
)


def _recipe_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The pages' code (as the tour rewrote it): the odd width, and the tabs against each other."""
    odd = results["frameworks"]["odd_width"]
    tabs = results["frameworks"]["tabs"]
    others = [name for name in odd if name != "summary page (mxnet)"]
    return [
        _claim(
            "odd-width-summary",
            "summary",
            "self.P[:, :, 1::2] = np.cos(X[:, :num_hiddens // 2])",
            "The summary page's MXNet code (this quote is a line of its code, not a sentence) builds P for an odd "
            "num_hiddens; every tab of the chapter and the frameworks page fails there.",
            "derived",
            {name: entry["builds"] for name, entry in odd.items()},
            "the summary page's recipe builds a table for odd d; the others raise",
            bool(odd["summary page (mxnet)"]["builds"]) and not any(odd[name]["builds"] for name in others),
            basis="each recipe's slicing decides it (X[:, :num_hiddens // 2] fits the d // 2 cosine columns; the "
            "others' X has one column too many); run on the tour's own rewrites of the pages' code in NumPy and "
            "PyTorch, since MXNet, TensorFlow and Paddle are not installed",
        ),
        _claim(
            "tabs-agree",
            "frameworks",
            'class PositionalEncoding(nn.Block): """位置编码"""',
            "The page's MXNet, PyTorch, TensorFlow and Paddle tabs (this quote is the first tab's code, not a "
            "sentence) build the same P, as rewritten by the tour in NumPy and PyTorch (MXNet, TensorFlow and Paddle "
            "are not installed).",
            "identity",
            dict(zip([f"n={n:,}" for n in tabs["lengths"]], tabs["max_difference"], strict=True)),
            "largest difference between two tabs < 1e-4 (float32 rounding)",
            max(tabs["max_difference"]) < 1e-4,
            basis="the four tabs write the same formula; the rewrites differ only in float32 or float64 rounding",
        ),
    ]


def code_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The claims about the layer and the pages' code."""
    return [*_layer_claims(results), *_recipe_claims(results), _printed_module(results)]


def _source(found: dict[str, Any]) -> str:
    return str(found.get("source", "selfattn study --exercises"))


def _deep_stack_exercise(by_depth: dict[str, Any] | None) -> dict[str, object]:
    quote = (
        "Suppose that we design a deep architecture to represent a sequence by stacking self-attention layers with "
        "positional encoding. What could the possible issues be?"
    )
    statement = (
        "An issue of depth, trained: at the deepest depth trained, the sinusoidal stack without residual connections "
        "does not train (within 0.05 of chance) while the one with residual connections does."
    )
    stacks = (by_depth or {}).get("stacks", {}).get("sinusoidal", {})
    if not {"residual", "no_residual"} <= set(stacks):
        return _claim("exercise-deep-stack", "chapter", quote, statement, "not shown", None, "trained stacks", None,
                      basis="needs sinusoidal stacks trained with and without residual connections")  # fmt: skip
    deepest = max(entry["depth"] for entry in stacks["residual"])
    kept = next(e for e in stacks["residual"] if e["depth"] == deepest)
    bare = next((e for e in stacks["no_residual"] if e["depth"] == deepest), None)
    number = {
        "source": _source(by_depth or {}),
        "chance": round(by_depth["chance"], 3) if by_depth else None,
        **{
            f"depth {e['depth']}, {variant}": {"task accuracy": round(e["task_accuracy"], 3), "steps": e["steps"]}
            for variant in ("residual", "no_residual")
            for e in stacks[variant]
        },
    }
    holds = bare is not None and kept["trains"] and not bare["trains"]
    return _claim("exercise-deep-stack", "chapter", quote, statement, "measured", number,
                  f"at depth {deepest}: residual trains, no residual stays within 0.05 of chance", holds)  # fmt: skip


def _encoding_exercises(by_length: dict[str, Any] | None) -> list[dict[str, object]]:
    learnable = "Can you design a learnable positional encoding method?"
    offsets = (
        "Can we assign different learned embeddings according to different offsets between queries and keys that "
        "are compared in self-attention?"
    )
    learned_statement = (
        "A learned table of positions (one row per position, LearnedPositionalEncoding) learns a task that needs "
        "position at its training length, and answers at chance past it, where no row was trained."
    )
    offset_statement = (
        "Learned embeddings by offset (Shaw's, T5's) learn the same task and keep answering past the training length."
    )
    if by_length is None:
        return [
            _claim(id_, "chapter", quote, statement, "not shown", None, "trained models", None,
                   basis="needs the tour's trained models (selfattn.tour.exercises.encodings_by_length)")
            for id_, quote, statement in (("exercise-learnable", learnable, learned_statement),
                                          ("exercise-offsets", offsets, offset_statement))
        ]  # fmt: skip
    config, chance, runs = by_length["config"], by_length["chance"], by_length["encodings"]
    train_len, longest = config["train_len"], max(config["eval_lens"])

    def cells(name: str) -> tuple[float, float]:
        run = runs[name]["by_length"]
        return run[str(train_len)]["all"], run[str(longest)]["past_train_len"]

    def shown(names: tuple[str, ...]) -> dict[str, object]:
        return {
            "copy back": config["delta"], "trained steps": config["train_steps"], "chance": round(chance, 3),
            **{f"{name}: at {train_len} / past {train_len} (of {longest})": [round(v, 3) for v in cells(name)]
               for name in names},
        }  # fmt: skip

    learned_in, learned_past = cells("learned")
    offset_cells = [cells(name) for name in ("shaw", "t5")]
    return [
        _claim("exercise-learnable", "chapter", learnable, learned_statement, "measured", shown(("learned",)),
               f">= 90% at length {train_len}; past it within 0.1 of chance",
               learned_in >= 0.9 and learned_past <= chance + 0.1),
        _claim("exercise-offsets", "chapter", offsets, offset_statement, "measured", shown(("shaw", "t5")),
               f">= 90% at length {train_len} and >= 80% past it, for both",
               all(inside >= 0.9 and past >= 0.8 for inside, past in offset_cells)),
    ]  # fmt: skip


def exercise_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The chapter's three exercises, each answered by trained models or not shown."""
    return [
        _deep_stack_exercise(results.get("depth_by_depth")),
        *_encoding_exercises((results.get("exercises") or {}).get("by_length")),
    ]
