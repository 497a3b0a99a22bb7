"""Float64 attention written from the formulas, for the differential fuzz (tests/test_fuzz_routes.py).

Nothing here calls selfattn: the visibility of each (query, key) pair is built from the mask
rules' definitions, each score encoding's bias from its paper's formula (with the module's
parameters), the projections by hand. Every function takes and returns float64 torch tensors,
so autograd gives the reference gradients.

A visibility rule is plain data, a nested tuple:
    ("causal",), ("window", w), ("chunks", C), ("position chunks", C), ("prefix", lengths),
    ("spans", ids), ("documents", ids), ("valid", lengths), ("padding", padding),
    ("dense", mask), ("selected", picks), ("and", a, b), ("or", a, b)
where ``lengths`` is an int or a ``(b,)`` / ``(b, lq)`` tensor, ``ids`` ``(b, l)``, ``padding``
bool ``(b, lk)`` (True = padding), ``mask`` bool broadcastable to ``(b, h, lq, lk)`` and ``picks``
integer ``(b or 1, lq, t)`` key indices each query may see (-1 names none).

Shape legend: b batch, h heads, hk key/value heads, lq queries, lk keys, dh head size, dv value size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

F64 = torch.float64


# ---------------------------------------------------------------------------------------- visibility


def visible(rule: tuple, batch: int, lq: int, lk: int, q_first: int, q_pos=None, k_pos=None) -> torch.Tensor:
    """Bool ``(b, 1 or h, lq, lk)``: may query ``r`` (global index ``q_first + r``) see key ``j``.

    ``q_pos`` / ``k_pos`` ``(b, lq)`` / ``(b, lk)`` are the tokens' positions (for position chunks).
    """
    i = (q_first + torch.arange(lq))[None, None, :, None]  # (1, 1, lq, 1) global query index
    j = torch.arange(lk)[None, None, None, :]  # (1, 1, 1, lk)
    kind = rule[0]
    if kind == "and":
        return visible(rule[1], batch, lq, lk, q_first, q_pos, k_pos) & visible(
            rule[2], batch, lq, lk, q_first, q_pos, k_pos
        )
    if kind == "or":
        return visible(rule[1], batch, lq, lk, q_first, q_pos, k_pos) | visible(
            rule[2], batch, lq, lk, q_first, q_pos, k_pos
        )
    if kind == "causal":
        seen = j <= i
    elif kind == "window":
        seen = (i - j).abs() < rule[1]
    elif kind == "chunks":
        seen = (i // rule[1]) == (j // rule[1])
    elif kind == "position chunks":
        seen = (q_pos[:, None, :, None] // rule[1]) == (k_pos[:, None, None, :] // rule[1])
    elif kind == "prefix":
        lengths = rule[1]
        seen = j < (lengths if isinstance(lengths, int) else lengths.view(-1, 1, 1, 1))
    elif kind == "spans":
        ids = rule[1]
        width = ids.shape[1]

        def span(index: torch.Tensor) -> torch.Tensor:  # (b, ..) id of each index, 0 past the ids
            padded = torch.cat((ids, ids.new_zeros(ids.shape[0], 1)), dim=1)
            return padded[:, index.clamp(max=width).flatten()].view(ids.shape[0], *index.shape)

        q_ids, k_ids = span(i[0, 0]), span(j[0, 0])  # (b, lq, 1), (b, 1, lk)
        seen = ((q_ids == k_ids) & (q_ids != 0))[:, None]
    elif kind == "documents":  # self-attention over packed sequences: ids (b, l) with lq == lk == l
        ids = rule[1]
        seen = ids[:, None, :, None] == ids[:, None, None, :]
    elif kind == "valid":
        lengths = rule[1]
        seen = j < (lengths.view(-1, 1, 1, 1) if lengths.dim() == 1 else lengths[:, None, :, None])
    elif kind == "padding":
        seen = ~rule[1][:, None, None, :]
    elif kind == "selected":  # key j is one of the query's picks
        seen = (rule[1][:, :, :, None] == j[0, 0]).any(dim=2)[:, None]  # (b, 1, lq, lk)
    elif kind == "dense":
        seen = rule[1]
        while seen.dim() < 4:
            seen = seen[None]
    else:
        raise AssertionError(f"unknown rule {kind!r}")
    return torch.broadcast_to(seen, (batch, seen.shape[1] if seen.dim() == 4 else 1, lq, lk))


def all_of(*rules: tuple | None) -> tuple | None:
    """The rules joined by "and" (None when there is none)."""
    kept = [rule for rule in rules if rule is not None]
    if not kept:
        return None
    joined = kept[0]
    for rule in kept[1:]:
        joined = ("and", joined, rule)
    return joined


# ---------------------------------------------------------------------------------------- attention


def attend(q, k, v, seen, *, scale, bias=None, softcap=None, sinks=None):
    """``softmax(cap(q k^T * scale + bias))`` over the visible keys (and a sink column) times ``v``.

    q ``(b, h, lq, dh)``, k ``(b, hk, lk, dh)``, v ``(b, hk, lk, dv)``, seen bool broadcastable to
    ``(b, h, lq, lk)`` or None. Key/value head ``j`` serves query heads ``j * h / hk ..``. A row
    that sees no key gets zero weights and a zero output. Returns ``(out, weights)``.
    """
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    logits = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        logits = logits + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if seen is None:
        seen = torch.ones(logits.shape, dtype=torch.bool)
    seen = torch.broadcast_to(seen, logits.shape)
    # Exponentials of the visible logits only, shifted by the row's largest one (a sink counts too).
    logits = logits.masked_fill(~seen, -math.inf)  # exp gives 0 there, and so does its gradient
    shift = logits.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.view(*([1] * (logits.dim() - 3)), -1, 1, 1).expand(*logits.shape[:-1], 1)
        shift = torch.maximum(shift, sink)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift)).detach()
    exps = torch.exp(logits - shift)
    total = exps.sum(dim=-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sink - shift)
    empty = ~seen.any(dim=-1, keepdim=True)
    weights = torch.where(empty, torch.zeros_like(exps), exps / torch.where(empty, torch.ones_like(total), total))
    if torch.isfinite(v).all():
        return weights @ v, weights
    # a key the row does not see adds nothing, whatever its value (weights @ v would add 0 * NaN)
    terms = weights.unsqueeze(-1) * v.unsqueeze(-3)  # (b, h, lq, lk, dv)
    return torch.where(seen.unsqueeze(-1), terms, 0.0).sum(dim=-2), weights


# ---------------------------------------------------------------------------------------- encodings


def alibi_slopes(heads: int) -> torch.Tensor:
    """``2^(-8 i / n)``; for heads not a power of two, the power below's slopes then every other one of twice it."""
    lower = 2 ** math.floor(math.log2(heads))
    slopes = [2.0 ** (-8.0 * (i + 1) / lower) for i in range(lower)]
    slopes += [2.0 ** (-8.0 * (i + 1) / (2 * lower)) for i in range(0, 2 * lower, 2)][: heads - lower]
    return torch.tensor(slopes, dtype=F64)


def t5_bucket(relative: torch.Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of ``key - query`` (Raffel et al.; the published code's float32 log, truncated)."""
    half = num_buckets // 2 if bidirectional else num_buckets
    exact = half // 2
    if bidirectional:
        base = (relative > 0).long() * half
        distance = relative.abs()
    else:
        base = torch.zeros_like(relative)
        distance = torch.clamp(-relative, min=0)
    ratio = torch.log(torch.clamp(distance, min=exact).float() / exact) / math.log(max_distance / exact)
    large = torch.clamp(exact + (ratio * (half - exact)).long(), max=half - 1)
    return base + torch.where(distance < exact, distance, large)


@dataclass(frozen=True)
class Term:
    """A score encoding as the reference sees it: its kind and settings (parameters come separately)."""

    kind: str  # "alibi", "t5", "kerple", "fire", "shaw"
    causal: bool = True  # ALiBi's form
    bidirectional: bool = True  # T5
    num_buckets: int = 32
    max_distance: int = 128  # T5's, or Shaw's clipping distance
    values: bool = True  # Shaw's value table
    keys: bool = True  # Shaw's key table


def term_bias(term: Term, params: dict, q, q_pos, k_pos) -> torch.Tensor | None:
    """The ``(b, h, lq, lk)`` bias from the formula; positions ``(b, lq)`` and ``(b, lk)`` integers."""
    heads = q.shape[1]
    i, j = q_pos[:, None, :, None], k_pos[:, None, None, :]  # (b, 1, lq, 1), (b, 1, 1, lk)
    if term.kind == "alibi":
        distance = (i - j) if term.causal else (i - j).abs()
        return -alibi_slopes(heads).view(1, -1, 1, 1) * distance.to(F64)
    if term.kind == "t5":
        buckets = t5_bucket(
            j - i, bidirectional=term.bidirectional, num_buckets=term.num_buckets, max_distance=term.max_distance
        )  # (b, 1, lq, lk)
        table = params["relative_attention_bias.weight"]  # (buckets, h)
        return table[buckets[:, 0]].permute(0, 3, 1, 2)  # (b, h, lq, lk)
    if term.kind == "kerple":
        r1, r2 = F.softplus(params["raw_r1"]), F.softplus(params["raw_r2"])
        return -r1.view(1, -1, 1, 1) * torch.log1p(r2.view(1, -1, 1, 1) * (i - j).abs().to(F64))
    if term.kind == "fire":
        c, threshold = F.softplus(params["raw_c"]), F.softplus(params["raw_threshold"])
        x = torch.log1p(c * (i - j).abs().to(F64)) / torch.log1p(c * torch.maximum(i.to(F64), threshold))
        hidden = torch.relu(x[..., None] * params["mlp.0.weight"][:, 0] + params["mlp.0.bias"])  # (b, 1, lq, lk, H)
        per_head = hidden @ params["mlp.2.weight"].t() + params["mlp.2.bias"]  # (b, 1, lq, lk, h)
        return per_head[:, 0].permute(0, 3, 1, 2)
    if term.kind == "shaw":
        if not term.keys:
            return None
        index = (j - i).clamp(-term.max_distance, term.max_distance) + term.max_distance  # (b, 1, lq, lk)
        table = params["key_embeddings"][index[:, 0]]  # (b, lq, lk, dh)
        return torch.einsum("bhid,bijd->bhij", q, table) / math.sqrt(q.shape[-1])
    raise AssertionError(term.kind)


def term_values(term: Term, params: dict, weights, q_pos, k_pos) -> torch.Tensor | None:
    """Shaw's value term ``sum_j w_ij a^V_clip(j - i)`` ``(b, h, lq, dh)``, None for other terms."""
    if term.kind != "shaw" or not term.values:
        return None
    i, j = q_pos[:, :, None], k_pos[:, None, :]
    index = (j - i).clamp(-term.max_distance, term.max_distance) + term.max_distance  # (b, lq, lk)
    return torch.einsum("bhij,bijd->bhid", weights, params["value_embeddings"][index])


# ---------------------------------------------------------------------------------------- the module


def rotate(x, positions, *, interleaved: bool, base: float = 10000.0) -> torch.Tensor:
    """RoPE: pair ``m`` of the features turned by ``p * base^(-2m / d)``; x ``(b, h, l, d)``, positions ``(b, l)``."""
    d = x.shape[-1]
    frequencies = base ** (-torch.arange(0, d, 2, dtype=F64) / d)  # (d / 2,)
    angle = positions.to(F64)[:, None, :, None] * frequencies  # (b, 1, l, d / 2)
    cos, sin = torch.cos(angle), torch.sin(angle)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


@dataclass(frozen=True)
class Layer:
    """The settings of a MultiHeadAttention that change its answer."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float | None = None
    softcap: float | None = None
    qk_norm: bool = False
    gated: bool = False
    rotary: str | None = None  # "interleaved" or "half"
    term: Term | None = None


def _linear(x, params, name):
    out = x @ params[f"{name}.weight"].t()
    return out + params[f"{name}.bias"] if f"{name}.bias" in params else out


def _heads(x, heads):
    b, length, _ = x.shape
    return x.view(b, length, heads, -1).transpose(1, 2)  # (b, h, l, dh)


def _rms(x, weight, eps=1e-6):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def layer_forward(layer: Layer, params: dict, queries, keys, values, *, q_pos, k_pos, seen, float_bias=None):
    """The module's ``(out (b, lq, d), weights (b, h, lq, lk))`` with its weights ``params`` (float64 by name).

    queries ``(b, lq, dq)``, keys ``(b, lk, dk)``, values ``(b, lk, dv)``; positions ``(b, lq)`` and
    ``(b, lk)``; ``seen`` bool broadcastable to ``(b, h, lq, lk)``; ``float_bias`` the finite part of
    a float ``attn_mask``.
    """
    q = _heads(_linear(queries, params, "W_q"), layer.heads)
    k = _heads(_linear(keys, params, "W_k"), layer.kv_heads)
    v = _heads(_linear(values, params, "W_v"), layer.kv_heads)
    if layer.qk_norm:
        q, k = _rms(q, params["q_norm.weight"]), _rms(k, params["k_norm.weight"])
    if layer.rotary is not None:
        q = rotate(q, q_pos, interleaved=layer.rotary == "interleaved")
        k = rotate(k, k_pos, interleaved=layer.rotary == "interleaved")
    scale = layer.scale if layer.scale is not None else 1 / math.sqrt(layer.head_dim)
    term = layer.term
    bias = None if term is None else term_bias(term, params, q, q_pos, k_pos)
    if float_bias is not None:
        bias = float_bias if bias is None else bias + float_bias
    out, weights = attend(q, k, v, seen, scale=scale, bias=bias, softcap=layer.softcap, sinks=params.get("sinks"))
    extra = None if term is None else term_values(term, params, weights, q_pos, k_pos)
    if extra is not None:
        out = out + extra
    merged = out.transpose(1, 2).flatten(2)  # (b, lq, h * dh)
    if layer.gated:
        merged = merged * torch.sigmoid(_linear(queries, params, "W_g"))
    return _linear(merged, params, "W_o"), weights


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """``(b, l)`` positions restarting at 0 wherever the document id changes from the previous token's."""
    positions = torch.zeros_like(ids)
    for row in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            same = bool(ids[row, t] == ids[row, t - 1])
            positions[row, t] = positions[row, t - 1] + 1 if same else 0
    return positions
