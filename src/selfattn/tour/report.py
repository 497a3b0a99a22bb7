"""The tour's HTML report: one self-contained page, figures beside it in ``figures/``.

Nothing is fetched from the network; the page opens offline from the file system. Every
number shown here is in ``results.json``.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence

from selfattn import __version__
from selfattn.tour import depth
from selfattn.tour.comparison import CHAPTER, KINDS
from selfattn.study.summary import study_section_html

__all__ = ["render_report"]

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1100px; margin: 2em auto;
       padding: 0 1em; color: #1d1d1f; line-height: 1.5; }
h1 { border-bottom: 2px solid #ddd; padding-bottom: .3em; }
h2 { margin-top: 2em; border-bottom: 1px solid #eee; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: .3em .6em; text-align: left; vertical-align: top; }
th { background: #f4f4f6; }
td.num { text-align: right; font-variant-numeric: tabular-nums; font-family: ui-monospace, monospace; }
.ok { color: #137333; font-weight: bold; }
.fail { color: #b3261e; font-weight: bold; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.9em; color: #555; }
code { background: #f4f4f6; padding: 0 .2em; }
.note { background: #fff8e1; border-left: 4px solid #f0b400; padding: .5em 1em; }
"""


def _fmt(value: object) -> str:
    """Numbers as a reader wants them: small ones in scientific notation, lists element by element."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if value == 0:
            return "0"
        return f"{value:.2e}" if abs(value) < 1e-3 or abs(value) >= 1e5 else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        shown = [_fmt(v) for v in value[:12]]
        return "[" + ", ".join(shown) + (", ..." if len(value) > 12 else "") + "]"
    return str(value)


def _e(text: object) -> str:
    return html.escape(str(text))


def _table(header: Sequence[str], rows: Iterable[Sequence[object]], numeric_from: int = 1) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = []
        for index, cell in enumerate(row):
            css = ' class="num"' if index >= numeric_from and not isinstance(cell, str) else ""
            cells.append(f"<td{css}>{_e(_fmt(cell))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _figure(figures: dict[str, str], name: str, caption: str) -> str:
    if name not in figures:
        return ""
    png = figures[name]
    svg = png[: -len(".png")] + ".svg"
    return (
        f'<figure id="fig-{_e(name)}"><a href="{_e(svg)}"><img src="{_e(png)}" alt="{_e(caption)}"></a>'
        f'<figcaption>{_e(caption)} (<a href="{_e(svg)}">SVG</a>)</figcaption></figure>'
    )


def _checks(results: dict) -> str:
    rows = []
    for check in results["checks"]:
        mark = '<span class="ok">pass</span>' if check["ok"] else '<span class="fail">FAIL</span>'
        rows.append(
            f'<tr><td>{_e(check["name"])}</td><td class="num">{_e(_fmt(check["measured"]))}</td>'
            f"<td>{_e(check['expected'])}</td><td>{mark}</td></tr>"
        )
    return (
        "<table><thead><tr><th>claim</th><th>measured</th><th>expected</th><th></th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _section_self_attention(results: dict, figures: dict[str, str]) -> str:
    shape = results["self_attention"]["shape"]
    masked = results["self_attention"]["masked"]
    return f"""
<h2 id="s1">1. Self-attention</h2>
<p>In self-attention the queries, keys and values all come from the same tokens
x<sub>1</sub>, ..., x<sub>n</sub>: each output y<sub>i</sub> attends from x<sub>i</sub> to every
(x<sub>j</sub>, x<sub>j</sub>). The chapter's cell runs multi-head attention with 100 hidden units and
5 heads on a (2, 4, 100) input with <code>valid_lens = [3, 2]</code>: the output has shape
<b>{_e(tuple(shape["shape"]))}</b>, the input's shape.</p>
<p>Below, the first head's weights on a random input with <code>valid_lens = {_e(masked["valid_lens"])}</code>.
Keys at or past the valid length are padding: the largest weight any of them receives is
<b>{_e(_fmt(masked["masked_weight_max"]))}</b>, and every row sums to 1 within
{_e(_fmt(masked["row_sum_error"]))}.</p>
{_figure(figures, "attention_weights", "Attention weights with valid_lens: masked keys are exactly zero")}
"""


def _section_permutation(results: dict, figures: dict[str, str]) -> str:
    perm = results["permutation"]
    return f"""
<h2 id="s2">2. Without positions, self-attention cannot tell the order</h2>
<p>Self-attention treats its input as a set: permuting the {perm["num_steps"]} tokens permutes the outputs
in the same way. Measured in float64, <code>max |f(X)[perm] - f(X[perm])|</code> is
<b>{_e(_fmt(perm["without_pe_error"]))}</b> (rounding). After adding P the permuted tokens meet different
rows of P and the outputs change by up to <b>{_e(_fmt(perm["with_pe_change"]))}</b> (outputs are of size
{_e(_fmt(perm["output_scale"]))}). That is why the chapter adds a positional encoding.</p>
{_figure(figures, "permutation", "Permutation error without and with the positional encoding")}
"""


def _section_comparison(results: dict, figures: dict[str, str]) -> str:
    comp = results["comparison"]
    sweep = comp["sweep"]
    rows = []
    for kind in KINDS:
        entry, claim = comp[kind], CHAPTER[kind]
        k = f", k={entry['k']}" if entry["k"] else ""
        rows.append(
            [
                claim["label"],
                claim["complexity"],
                f"{entry['flops_exponent_n']:.3f}",
                f"{entry['flops_exponent_d']:.3f}",
                claim["sequential_ops"],
                entry["sequential_ops"],
                claim["max_path_length"],
                f"{entry['max_path_length']} (n={entry['n']}{k})",
                f"{entry['time_exponent_n']:.2f}",
            ]
        )
    table = _table(
        [
            "layer",
            "chapter: compute",
            "measured FLOPs ~ n^",
            "measured FLOPs ~ d^",
            "chapter: sequential ops",
            f"measured chain (n={sweep['n'][-1]})",
            "chapter: max path",
            "measured path",
            "measured time ~ n^",
        ],
        rows,
    )
    sa = comp["self_attention"]
    series_rows = [
        [
            n,
            comp["cnn"]["flops_by_n"][i],
            comp["rnn"]["flops_by_n"][i],
            sa["flops_by_n"][i],
            sa["layer_flops_by_n"][i],
            comp["cnn"]["sequential_ops_by_n"][i],
            comp["rnn"]["sequential_ops_by_n"][i],
            sa["sequential_ops_by_n"][i],
            comp["cnn"]["path_length_by_n"][i],
            comp["rnn"]["path_length_by_n"][i],
            sa["path_length_by_n"][i],
        ]
        for i, n in enumerate(sweep["n"])
    ]
    series = _table(
        [
            "n",
            "CNN FLOPs",
            "RNN FLOPs",
            "attention FLOPs",
            "attention layer FLOPs",
            "CNN chain",
            "RNN chain",
            "attention chain",
            "CNN path",
            "RNN path",
            "attention path",
        ],
        series_rows,
        numeric_from=0,
    )
    cnn = comp["cnn"]
    by_k = _table(
        ["k", "CNN FLOPs", "measured path", "ceil((n-1)/(k-1))"],
        zip(sweep["k"], cnn["flops_by_k"], cnn["path_length_by_k"], cnn["expected_path_length_by_k"]),
        numeric_from=0,
    )
    return f"""
<h2 id="s3">3. CNN vs RNN vs self-attention, measured</h2>
<p>The chapter's table, with each column measured on real PyTorch layers that map n tokens of size d to n tokens:
a width-k 1-D convolution (<code>nn.Conv1d</code>, padded on the left), a tanh RNN (<code>nn.RNN</code>)
and a self-attention layer (<code>selfattn.MultiHeadAttention</code>, one head).</p>
<ul>
<li><b>Compute</b>: FLOPs counted by <code>torch.utils.flop_counter.FlopCounterMode</code> on one forward pass,
for n in {_e(sweep["n"])} (d = {sweep["fixed_d"]}), d in {_e(sweep["d"])} (n = {sweep["fixed_n"]}) and, for the
CNN, k in {_e(sweep["k"])}; the exponent is the least-squares slope on log-log axes. For self-attention the
exponents are those of the score and value matmuls, the chapter's O(n<sup>2</sup>d); the whole layer adds
the four d&times;d projections, O(nd<sup>2</sup>): its exponents are {sa["layer_flops_exponent_n"]:.2f} in n and
{sa["layer_flops_exponent_d"]:.2f} in d over this sweep. PyTorch's counter has no formula for the fused CPU
attention kernel, so the layer is counted on its explicit matmul path (same products).</li>
<li><b>Sequential operations</b>: the length of the longest chain of matrix products that depend on each other,
read from the layer's autograd graph.</li>
<li><b>Maximum path length</b>: the fewest steps a gradient needs to carry output n back to input 1, read off
gradients in float64: for stacked convolutions or self-attention layers, the smallest depth at which output n
depends on input 1; for the RNN, the fewest recurrent steps back-propagation must run through.</li>
<li><b>Wall-clock</b>: median forward time on this machine on one thread ({sweep["repeats"]} runs); the
exponent is fitted from n = {comp["cnn"]["time_fit_from_n"]} up, where fixed per-call costs no longer dominate.</li>
</ul>
{table}
{_figure(figures, "comparison", "Measured FLOPs, path lengths and wall-clock time against n and d (log-log)")}
<p>The measured series:</p>
{series}
<p>The CNN against its kernel width k (FLOPs at n = {sweep["fixed_n"]}, paths at n = {cnn["n"]}): FLOPs grow as
k<sup>{cnn["flops_exponent_k"]:.2f}</sup>.</p>
{by_k}
<p>Both the CNN and self-attention run in parallel (a chain that does not grow with n), self-attention has the
shortest path, and its n<sup>2</sup> compute is what makes very long sequences slow.</p>
"""


def _section_positional(results: dict, figures: dict[str, str]) -> str:
    pe = results["positional_encoding"]
    binary = "".join(f"<tr><td>{i}</td><td><code>{_e(bits)}</code></td></tr>" for i, bits in enumerate(pe["binary"]))
    periods = ", ".join(f"column {c}: {p:.1f}" for c, p in zip(pe["columns"], pe["column_periods"]))
    return f"""
<h2 id="s4">4. Positional encoding</h2>
<p>The encoding adds P to the input X, with P[i, 2j] = sin(i / 10000<sup>2j/d</sup>) and
P[i, 2j+1] = cos(i / 10000<sup>2j/d</sup>). Rows are positions, columns encoding dimensions. The chapter's plot,
columns {_e(pe["columns"])} for d = {pe["num_hiddens"]} over {pe["num_steps"]} positions: columns 6 and 7 oscillate faster
than 8 and 9 (periods in positions: {_e(periods)}), and each pair is offset by the sine/cosine alternation.</p>
{_figure(figures, "pe_columns", "Columns 6 to 9 of P against the position")}
<p>Like the bits of a binary number, where higher bits flip less often, the frequency falls along the columns.</p>
{_figure(figures, "pe_heatmap", "Heat map of P beside the binary representations of 0..7")}
<table><thead><tr><th>i</th><th>binary</th></tr></thead><tbody>{binary}</tbody></table>
"""


def _section_absolute(results: dict, figures: dict[str, str]) -> str:
    q = results["absolute"]["qualities"]
    precision = results["absolute"]["precision"]
    rows = [
        [
            "a unique row per position",
            f"smallest distance between two rows among {q['num_positions']} positions",
            q["min_row_distance"],
        ],
        ["bounded values", "largest |P[i, j]|", q["max_abs_value"]],
        ["bounded values", "row norms (min, max); sqrt(d/2) for even d", [q["row_norm_min"], q["row_norm_max"]]],
        [
            "distance independent of i",
            "max over delta of (max_i - min_i) |P[i] - P[i+delta]|",
            q["offset_distance_spread_max"],
        ],
        [
            f"past the longest position seen ({q['num_seen']})",
            "smallest distance from a new row to a seen row",
            q["unseen_nearest_distance"],
        ],
        [f"past the longest position seen ({q['num_seen']})", "largest |P| of the new rows", q["unseen_max_abs_value"]],
    ]
    rows += [
        [
            f"precision at {length} positions",
            "error of the textbook's float32 angles / of selfattn's float64 angles",
            [textbook, ours],
        ]
        for length, textbook, ours in zip(
            precision["lengths"], precision["textbook_error"], precision["selfattn_error"]
        )
    ]
    return f"""
<h2 id="s5">5. Absolute position: what a good encoding needs</h2>
<p>An absolute encoding should give every position its own row, keep its values bounded whatever the length,
keep the distance between two positions the same wherever they sit, and keep working past the longest
sequence seen in training. Each quality measured on the float64 table (d = {q["num_hiddens"]}):</p>
{_table(["quality", "measurement", "value"], rows, numeric_from=2)}
{_figure(figures, "absolute", "Distance between positions i and i+delta along i, and float32 drift far out")}
"""


def _section_relative(results: dict, figures: dict[str, str]) -> str:
    sim = results["relative"]["similarity"]
    closed = sim.get("closed_form_error")
    closed_text = (
        ""
        if closed is None
        else (f" It equals the closed form sum<sub>j</sub> cos(&delta; w<sub>j</sub>) within {_e(_fmt(closed))}.")
    )
    return f"""
<h2 id="s6">6. Relative position</h2>
<p>For any fixed offset &delta;, the pair (P[i, 2j], P[i, 2j+1]) is mapped to (P[i+&delta;, 2j], P[i+&delta;, 2j+1]) by the
rotation M<sub>&delta;</sub> = [[cos &delta;w<sub>j</sub>, sin &delta;w<sub>j</sub>], [-sin &delta;w<sub>j</sub>,
cos &delta;w<sub>j</sub>]], which does not depend on i. The largest error of M<sub>&delta;</sub>P[i] against
P[i+&delta;] over all i, &delta; and pairs j is <b>{_e(_fmt(results["rotation_max_error"]))}</b> (float64).</p>
<p>So the similarity P[i] &middot; P[i+&delta;] depends on &delta; only: curves from different starting positions lie on
top of each other (largest difference {_e(_fmt(sim["spread"]))}).{closed_text}</p>
{_figure(figures, "relative", "P[i] . P[i+delta] against delta for several i")}
"""


def _section_family(results: dict, figures: dict[str, str]) -> str:
    fam = results["family"]
    if not fam["available"]:
        return f"""
<h2 id="s7">7. The family of encodings</h2>
<p class="note">Skipped: {_e(fam["note"])}.</p>
"""
    rows = [
        [
            name,
            d["class"],
            d["acts_on"],
            "relative" if d["is_relative"] else "absolute",
            d["shift_spread"],
            d["shift_change"],
            d["far_positions"],
        ]
        for name, d in fam["encodings"].items()
    ]
    table = _table(
        [
            "name",
            "class",
            "acts on",
            "declared",
            "score spread at one offset",
            "output change under a shift",
            "positions far out",
        ],
        rows,
        numeric_from=4,
    )
    panels = "".join(
        _figure(figures, f"family_{name}", f"{name}: position scores, score against offset, attention on one input")
        for name in fam["encodings"]
    )
    some = next(iter(fam["encodings"].values()))
    return f"""
<h2 id="s7">7. The family of encodings</h2>
<p>Every encoding in <code>selfattn.positional</code> through the same diagnostics, on {some["num_steps"]} positions with
seeded random weights (learned tables and biases are shown as initialized, so their patterns are noise until
trained). The <i>position score</i> is what positions alone contribute to the attention scores when every token
holds the same content: P<sub>i</sub>&middot;P<sub>j</sub>/&radic;d for an encoding added to the input,
&lang;R<sub>i</sub>u, R<sub>j</sub>u&rang;/&radic;d<sub>h</sub> for rotary, the bias itself for a score encoding.
Its spread along one offset is 0 when it depends on the offset only. The output change is how much a
self-attention layer's output moves when every position shifts by {some["shift"]}: 0 for an encoding that is
relative in practice. The sinusoidal table's scores depend on the offset only, yet the layer's output moves,
because P is added to the content, not compared with itself alone.</p>
{table}
{panels}
"""


def _section_depth(results: dict, figures: dict[str, str]) -> str:
    fam = results["family"]
    available = fam["encodings"] if fam["available"] else {}
    learned = (
        ", ".join(
            f"<code>{_e(n)}</code>" for n, d in available.items() if not d["is_relative"] and d["far_positions"] != "ok"
        )
        or "a learned table"
    )
    relative = (
        ", ".join(f"<code>{_e(n)}</code>" for n, d in available.items() if d["acts_on"] != "input")
        or "relative encodings"
    )
    return f"""
<h2 id="s8">8. The exercises</h2>
{depth.section_html(results["depth"], figures, results.get("depth_study"))}
<p><b>A learnable encoding</b>: {learned} (<code>selfattn.positional.LearnedPositionalEncoding</code>) learns one row
per position; it has no row past its <code>max_len</code>, which is why it refuses positions far out in
section 7. <b>Embeddings by offset</b> (Shaw et al. 2018; Huang et al. 2018) and their successors act inside
attention: {relative} in section 7, whose scores depend on the offset only.</p>
"""


def render_report(results: dict, figures: dict[str, str]) -> str:
    """The report page for JSON-ready ``results`` and ``{figure name: relative png path}``."""
    passed = sum(c["ok"] for c in results["checks"])
    mode = "quick sizes (<code>--quick</code>)" if results.get("quick") else "full sizes"
    sections = [
        _section_self_attention(results, figures),
        _section_permutation(results, figures),
        _section_comparison(results, figures),
        _section_positional(results, figures),
        _section_absolute(results, figures),
        _section_relative(results, figures),
        _section_family(results, figures),
        _section_depth(results, figures),
        study_section_html(),
    ]
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>selfattn tour: self-attention and positional encoding, checked</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>Self-attention and positional encoding, reproduced and checked</h1>
<p>Each claim of the chapter (Dive into Deep Learning, "Self-Attention and Positional Encoding") measured on real
numbers by <code>selfattn tour</code> (selfattn {_e(__version__)}, {mode}). Every number is also in
<a href="results.json">results.json</a>. <b>{passed} of {len(results["checks"])} checks pass.</b></p>
<nav><ol>
<li><a href="#s1">Self-attention</a></li><li><a href="#s2">Permutation</a></li>
<li><a href="#s3">CNN vs RNN vs self-attention</a></li><li><a href="#s4">Positional encoding</a></li>
<li><a href="#s5">Absolute position</a></li><li><a href="#s6">Relative position</a></li>
<li><a href="#s7">The family</a></li><li><a href="#s8">The exercises</a></li><li><a href="#checks">All checks</a></li>
</ol></nav>
{"".join(sections)}
<h2 id="checks">All checks</h2>
{_checks(results)}
</body>
</html>
"""
