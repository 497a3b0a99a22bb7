"""Every keyword transformers' models pass to an attention function is honoured by selfattn's backend or refused.

The installed transformers is scanned for its models' ``attention_interface(...)`` calls, so a new
keyword in a new release fails here until it is classified. Each honoured keyword is compared
with the eager attention function of a family that passes it, and whole tiny models of those
families run with ``attn_implementation="selfattn"`` against ``"eager"``.
"""

from __future__ import annotations

import ast
import functools
import math
import re
import types
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn.integrations._hf_keywords import HONOURED, NOT_READ, REFUSED  # noqa: E402
from selfattn.integrations.transformers import attention_forward, register  # noqa: E402

ATOL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    register()


# --------------------------------------------------------------------------- the scan of transformers


def _splat_keys() -> set[str]:
    """What ``**kwargs`` of a model's attention layer may carry: transformers' typed keyword dicts."""
    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
    from transformers.utils.generic import TransformersKwargs

    return set(TransformersKwargs.__annotations__) | set(FlashAttentionKwargs.__annotations__)


_BOUND = re.compile(r"^\s*(\w+)\s*(?::[^=\n]*)?=[^\n]*ALL_ATTENTION_FUNCTIONS", re.MULTILINE)
_DICT = re.compile(r"^\s*(\w+)\s*(?::[^=\n]*)?=\s*\{", re.MULTILINE)
_EAGER = re.compile(r"^\s*def (\w*attention_forward)\(", re.MULTILINE)


def _closing(text: str, opening: int) -> int:
    """Index just past the bracket that closes ``text[opening]`` (strings and comments skipped)."""
    depth, i = 0, opening
    while i < len(text):
        char = text[i]
        if char in "\"'":
            quote = text[i : i + 3] if text[i : i + 3] in ('"""', "'''") else char
            i = text.index(quote, i + len(quote)) + len(quote)
            continue
        if char == "#":
            i = text.index("\n", i)
            continue
        depth += char in "([{"
        depth -= char in ")]}"
        i += 1
        if depth == 0:
            return i
    raise AssertionError(f"unbalanced bracket at {opening}")


def _call_keywords(call: ast.Call, literals: dict[str, set[str]]) -> set[str]:
    keywords: set[str] = set()
    for keyword in call.keywords:
        if keyword.arg is not None:
            keywords.add(keyword.arg)
        elif isinstance(keyword.value, ast.Name) and keyword.value.id == "kwargs":
            keywords |= _splat_keys()
        elif isinstance(keyword.value, ast.Name) and keyword.value.id in literals:
            keywords |= literals[keyword.value.id]
        else:
            keywords.add(f"**{ast.unparse(keyword.value)}")  # unknown contents: must be looked at
    if len(call.args) > 5:
        keywords.add(f"<{len(call.args)} positional arguments>")
    return keywords


def _file_keywords(text: str) -> set[str]:
    """Keywords one modeling file passes to attention functions, and its eager functions' extra parameters.

    Parsing whole files takes tens of seconds; each call, dict literal and ``def`` is found by
    pattern and parsed alone.
    """
    literals: dict[str, set[str]] = {}
    for match in _DICT.finditer(text):
        literal = ast.parse(text[match.end() - 1 : _closing(text, match.end() - 1)], mode="eval").body
        if isinstance(literal, ast.Dict):  # not a set or a comprehension
            keys = {key.value for key in literal.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)}
            literals.setdefault(match.group(1), set()).update(keys)
    keywords: set[str] = set()
    for name in {"attention_interface", *_BOUND.findall(text)}:
        for match in re.finditer(rf"(?<![\w.]){name}\(", text):
            call = ast.parse(text[match.start() : _closing(text, match.end() - 1)], mode="eval").body
            assert isinstance(call, ast.Call)
            keywords |= _call_keywords(call, literals)
    for match in _EAGER.finditer(text):
        definition = ast.parse(text[match.start() : _closing(text, match.end() - 1)].strip() + ": pass").body[0]
        assert isinstance(definition, ast.FunctionDef)
        arguments = definition.args
        if arguments.args and arguments.args[0].arg == "module":  # past (module, query, key, value, mask)
            keywords |= {argument.arg for argument in arguments.args[5:] + arguments.kwonlyargs}
    return keywords


@functools.cache
def _scan() -> dict[str, set[str]]:
    """keyword -> the model families that pass it to an attention function (or take it in their eager one)."""
    passed: dict[str, set[str]] = {}
    for path in sorted((Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        for keyword in _file_keywords(path.read_text()):
            passed.setdefault(keyword, set()).add(path.parent.name)
    return passed


def test_every_keyword_transformers_passes_is_honoured_or_refused() -> None:
    passed = _scan()
    # The scan sees what it must: the keywords that once were silently ignored are there.
    assert {"indices", "block_indices", "sinks", "s_aux", "cu_seq_lens_q", "output_attentions"} <= set(passed)
    classified = HONOURED | set(NOT_READ) | set(REFUSED)
    unclassified = {keyword: sorted(families)[:5] for keyword, families in passed.items() if keyword not in classified}
    assert not unclassified, f"keywords selfattn neither honours nor refuses (families): {unclassified}"
    assert not HONOURED & set(NOT_READ) and not HONOURED & set(REFUSED)


def test_a_keyword_of_no_table_is_refused() -> None:
    q, k, v = _qkv(3, 3)
    with pytest.raises(ValueError, match=r"attention_forward got future_keyword=2\.0: selfattn does not know"):
        attention_forward(_module(), q, k, v, None, future_keyword=2.0)
    with pytest.raises(ValueError, match=r"got attention_window=a tensor of shape \(2, 3\)"):
        attention_forward(_module(), q, k, v, None, attention_window=torch.ones(2, 3))
    plain, _ = attention_forward(_module(), q, k, v, None)
    quiet, _ = attention_forward(_module(), q, k, v, None, future_keyword=None, position_ids=torch.arange(3)[None])
    torch.testing.assert_close(quiet, plain, atol=0, rtol=0)  # None and the not-read keywords change nothing


# --------------------------------------------------------------------------- direct calls against eager


def _module(is_causal: bool = True, groups: int = 2, **extra: Any) -> Any:
    return types.SimpleNamespace(is_causal=is_causal, num_key_value_groups=groups, training=False, **extra)


def _qkv(lq: int, lk: int, heads: int = 4, kv_heads: int = 2, batch: int = 2, dv: int = 8) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(lq * 10 + lk)
    q = torch.randn(batch, heads, lq, 8, generator=gen)
    return q, torch.randn(batch, kv_heads, lk, 8, generator=gen), torch.randn(batch, kv_heads, lk, dv, generator=gen)


def _padded_causal(batch: int, lq: int, lk: int) -> torch.Tensor:
    """transformers' bool (b, 1, lq, lk) mask: causal, the first key of row 1 padded."""
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq).expand(batch, 1, lq, lk).clone()
    mask[1:, ..., 0] = False
    return mask


def _additive(mask: torch.Tensor) -> torch.Tensor:
    """The float mask eager takes for a bool one."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def _seen(visible: torch.Tensor, heads: int = 4) -> torch.Tensor:
    """``(b, lq, h)``: the queries that see some key (the others are compared in tests/test_hf_backend.py)."""
    seen = visible.any(-1).expand(-1, heads, -1).transpose(1, 2)
    assert seen.float().mean() > 0.7  # most rows are compared
    return seen


def _topk(batch: int, lq: int, lk: int, t: int, seed: int = 5) -> torch.Tensor:
    """``(b, lq, t)`` distinct key indices per query (int32, as the DSA indexers return them)."""
    scores = torch.rand(batch, lq, lk, generator=torch.Generator().manual_seed(seed))
    return scores.topk(t, dim=-1).indices.to(torch.int32)


def _fold(indices: torch.Tensor, mask: torch.Tensor, lk: int) -> torch.Tensor:
    """What DeepSeek-V3.2 does for eager: keep only the selected keys (-1 entries select none)."""
    slots = indices.long().masked_fill(indices < 0, lk)
    chosen = torch.zeros(*indices.shape[:-1], lk + 1, dtype=torch.bool).scatter(-1, slots, True)[..., :lk]
    return mask & chosen.unsqueeze(1)


@pytest.mark.parametrize("name", ["indices", "topk_indices"])
@pytest.mark.parametrize(("lq", "lk"), [(6, 6), (2, 7)])
def test_sparse_key_selection_matches_deepseek_v32_eager(name: str, lq: int, lk: int) -> None:
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import eager_attention_forward

    q, k, v = _qkv(lq, lk, dv=6)  # MLA: values narrower than keys
    mask = _padded_causal(2, lq, lk)
    indices = _topk(2, lq, lk, 3)
    indices[0, -1, 0] = -1  # an unused slot
    visible = _fold(indices, mask, lk)
    expected, expected_weights = eager_attention_forward(_module(), q, k, v, _additive(visible), 0.3)
    got, weights = attention_forward(_module(), q, k, v, mask, scaling=0.3, output_attentions=True, **{name: indices})
    seen = _seen(visible)
    torch.testing.assert_close(got[seen], expected[seen], atol=ATOL, rtol=0)
    torch.testing.assert_close(weights.transpose(1, 2)[seen], expected_weights.transpose(1, 2)[seen], atol=ATOL, rtol=0)
    dense, _ = attention_forward(_module(), q, k, v, mask, scaling=0.3)
    assert (dense - expected)[seen].abs().max() > 0.05  # the selection matters here


def test_sparse_key_selection_without_a_mask_keeps_causality() -> None:
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import eager_attention_forward

    q, k, v = _qkv(6, 6, kv_heads=4)
    causal = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6)
    indices = _topk(2, 6, 6, 4)  # also names future keys: causality must still hide them
    visible = _fold(indices, causal, 6)
    expected, _ = eager_attention_forward(_module(groups=1), q, k, v, _additive(visible), 0.35)
    got, _ = attention_forward(_module(groups=1), q, k, v, None, scaling=0.35, indices=indices)
    seen = _seen(visible)
    torch.testing.assert_close(got[seen], expected[seen], atol=ATOL, rtol=0)


def test_block_selection_matches_minimax_m3_eager() -> None:
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLIndexer, eager_attention_forward

    config = MiniMaxM3VLTextConfig(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8, index_n_heads=2, index_head_dim=8,
        index_block_size=3, index_topk_blocks=2, index_local_blocks=1,
    )  # fmt: skip
    indexer = MiniMaxM3VLIndexer(config, 0)
    q, k, v = _qkv(7, 7)
    blocks = torch.tensor([[0, -1], [0, -1], [0, -1], [1, 0], [1, -1], [1, 0], [2, 0]])  # (lq, t), 3 blocks of 3 keys
    block_indices = torch.stack([blocks, blocks.roll(1, dims=-1)]).expand(2, 2, 7, 2)  # (b, hk, lq, t)
    mask = _padded_causal(2, 7, 7)
    positions = torch.arange(7).expand(2, 7)
    folded = indexer.build_block_mask(block_indices, mask, 7, torch.float32, q.device, positions)
    expected, _ = eager_attention_forward(_module(), q, k, v, folded, 0.3)
    module = _module(indexer=indexer)
    got, _ = attention_forward(module, q, k, v, mask, scaling=0.3, block_indices=block_indices)
    seen = (folded == 0).any(-1).transpose(1, 2)  # (b, lq, h): eager spreads a row with no key uniformly
    torch.testing.assert_close(got[seen], expected[seen], atol=ATOL, rtol=0)
    assert seen.float().mean() > 0.8
    with pytest.raises(ValueError, match=r"block_indices needs the size of a key block"):
        attention_forward(_module(), q, k, v, mask, block_indices=block_indices)


def test_per_query_sinks_match_inkling2_eager() -> None:
    from transformers.models.inkling2.modeling_inkling2 import eager_attention_forward

    q, k, v = _qkv(5, 5)
    mask = _padded_causal(2, 5, 5)
    gen = torch.Generator().manual_seed(7)
    sinks = torch.randn(2, 4, 5, 1, generator=gen) * 2  # (b, h, lq, 1): one sink per token
    position_bias = torch.randn(2, 4, 5, 5, generator=gen)
    expected, expected_weights = eager_attention_forward(
        _module(), q, k, v, _additive(mask), 0.3, position_bias=position_bias, sinks=sinks
    )
    got, weights = attention_forward(
        _module(), q, k, v, mask, scaling=0.3, position_bias=position_bias, sinks=sinks, output_attentions=True
    )
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=ATOL, rtol=0)
    sinkless, _ = attention_forward(_module(), q, k, v, mask, scaling=0.3, position_bias=position_bias)
    assert (sinkless - expected).abs().max() > 0.05
    causal_only, _ = attention_forward(_module(), q, k, v, None, scaling=0.3, sinks=sinks)  # no mask: causal
    reference, _ = eager_attention_forward(
        _module(), q, k, v, _additive(torch.ones(5, 5).tril().bool()), 0.3, sinks=sinks
    )
    torch.testing.assert_close(causal_only, reference, atol=ATOL, rtol=0)


def test_per_head_sinks_under_either_name_match_gpt_oss_eager() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v = _qkv(5, 5)
    mask = _padded_causal(2, 5, 5)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3)) * 2
    expected, _ = eager_attention_forward(_module(sinks=sinks), q, k, v, _additive(mask), 0.3)
    got, _ = attention_forward(_module(), q, k, v, mask, scaling=0.3, sinks=sinks)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 softmax(q k^T scale) over the visible keys: (b, h, lq, lk) weights; a row with no key weighs each 1 / lk (eager)."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, 1)
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~visible, -math.inf)
    blind = ~visible.any(-1, keepdim=True)
    return scores.masked_fill(blind, 0.0).softmax(-1)


def test_head_mask_scales_each_heads_weights() -> None:
    q, k, v = _qkv(5, 5)
    mask = _padded_causal(2, 5, 5)
    head_mask = torch.tensor([1.0, 0.0, 0.5, 2.0])
    weights = _reference(q, k, v, mask, 0.3) * head_mask.double().view(1, 4, 1, 1)
    expected = (weights @ v.double().repeat_interleave(2, 1)).transpose(1, 2)
    got, got_weights = attention_forward(
        _module(), q, k, v, mask, scaling=0.3, head_mask=head_mask, output_attentions=True
    )
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_weights.double(), weights, atol=ATOL, rtol=0)
    per_batch, _ = attention_forward(_module(), q, k, v, mask, scaling=0.3, head_mask=head_mask.view(1, 4, 1, 1))
    torch.testing.assert_close(per_batch, got, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match=r"head_mask must be a float \(h,\) or one broadcastable to \(b, h, lq, 1\)"):
        attention_forward(_module(), q, k, v, mask, head_mask=torch.ones(1, 4, 1, 5))


def _packed_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int], k_lens: list[int]) -> Any:
    """float64 per-document causal attention, each document aligned to its last key, concatenated."""
    outputs, q_start, k_start = [], 0, 0
    for nq, nk in zip(q_lens, k_lens, strict=True):
        visible = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        qd, kd, vd = (
            q[..., q_start : q_start + nq, :],
            k[..., k_start : k_start + nk, :],
            v[..., k_start : k_start + nk, :],
        )
        weights = _reference(qd, kd, vd, visible, 0.3)
        outputs.append(weights @ vd.double().repeat_interleave(q.shape[1] // k.shape[1], 1))
        q_start, k_start = q_start + nq, k_start + nk
    return torch.cat(outputs, dim=-2).transpose(1, 2)


@pytest.mark.parametrize(("q_lens", "k_lens"), [([3, 1, 4], [3, 1, 4]), ([1, 2, 1], [3, 2, 4])])
def test_packed_lengths_without_a_mask_are_documents(q_lens: list[int], k_lens: list[int]) -> None:
    q, k, v = _qkv(sum(q_lens), sum(k_lens), batch=1)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    expected = _packed_reference(q, k, v, q_lens, k_lens)
    got, _ = attention_forward(
        _module(), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=4, max_length_k=4
    )
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=0)
    unpacked, _ = attention_forward(_module(), q, k, v, None, scaling=0.3)
    assert (unpacked.double() - expected).abs().max() > 0.05


def test_packed_lengths_refusals() -> None:
    q, k, v = _qkv(4, 4)
    cu = torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match=r"cu_seq_lens_q/k pack sequences into one row; the call has a batch of 2"):
        attention_forward(_module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    q, k, v = _qkv(4, 4, batch=1)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q must be non-decreasing cumulative lengths .* got \[0, 2, 3\]"):
        attention_forward(_module(), q, k, v, None, cu_seq_lens_q=torch.tensor([0, 2, 3]))
    with pytest.raises(ValueError, match=r"cu_seq_lens_k must be an integer tensor"):
        attention_forward(_module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu.float())
    with pytest.raises(ValueError, match=r"cu_seq_lens_q holds 2 documents and cu_seq_lens_k 1"):
        attention_forward(_module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 4]))


def test_sequence_ids_are_documents() -> None:
    q, k, v = _qkv(5, 5)
    seq_idx = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    visible = (seq_idx[:, :, None] == seq_idx[:, None, :]).unsqueeze(1) & torch.ones(5, 5, dtype=torch.bool).tril()
    expected = (_reference(q, k, v, visible, 0.3) @ v.double().repeat_interleave(2, 1)).transpose(1, 2)
    got, _ = attention_forward(_module(), q, k, v, None, scaling=0.3, seq_idx=seq_idx)
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match=r"seq_idx must be \(b, l\) ids of a packed row"):
        attention_forward(_module(), q, k, v, None, seq_idx=seq_idx[:, :4])


def test_output_attentions_returns_eagers_weights() -> None:
    from transformers.models.llama.modeling_llama import eager_attention_forward

    q, k, v = _qkv(4, 6)
    mask = _padded_causal(2, 4, 6)
    expected_out, expected = eager_attention_forward(_module(), q, k, v, _additive(mask), 0.3)
    out, weights = attention_forward(_module(), q, k, v, mask, scaling=0.3, output_attentions=True)
    torch.testing.assert_close(weights, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(out, expected_out, atol=ATOL, rtol=0)
    assert attention_forward(_module(), q, k, v, mask, scaling=0.3)[1] is None
    with pytest.raises(ValueError, match=r"output_attentions=True with dropout=0.1: eager returns the weights after"):
        attention_forward(_module(), q, k, v, mask, dropout=0.1, output_attentions=True)


def test_bad_selections_and_sinks_are_refused() -> None:
    q, k, v = _qkv(4, 4)
    mask = _padded_causal(2, 4, 4)
    indices = _topk(2, 4, 4, 2)
    with pytest.raises(
        ValueError, match=r"indices must lie in \[-1, 4\) \(4 keys; -1 = no entry\), got values in \[\d, 4\]"
    ):
        attention_forward(_module(), q, k, v, mask, indices=indices.masked_fill(indices == 0, 4))
    with pytest.raises(ValueError, match=r"topk_indices must lie in \[-1, 4\)"):
        attention_forward(_module(), q, k, v, mask, topk_indices=indices - 2)
    with pytest.raises(ValueError, match=r"indices must be an integer tensor, got torch.float32"):
        attention_forward(_module(), q, k, v, mask, indices=indices.float())
    with pytest.raises(
        ValueError, match=r"indices must be \(b, lq, t\) or \(b, hs, lq, t\) with hs dividing the 4 heads"
    ):
        attention_forward(_module(), q, k, v, mask, indices=indices[:, :3])
    with pytest.raises(ValueError, match=r"indices and topk_indices both given"):
        attention_forward(_module(), q, k, v, mask, indices=indices, topk_indices=indices)
    sinks = torch.zeros(2, 4, 4, 1)
    with pytest.raises(ValueError, match=r"s_aux and sinks both given"):
        attention_forward(_module(), q, k, v, mask, s_aux=torch.zeros(4), sinks=sinks)
    with pytest.raises(ValueError, match=r"sinks must be \(h,\) or broadcastable to \(b, h, lq, 1\) = \(2, 4, 4, 1\)"):
        attention_forward(_module(), q, k, v, mask, sinks=torch.zeros(2, 4, 4, 2))
    with pytest.raises(ValueError, match=r"softcap=5.0 with per-query sinks"):
        attention_forward(_module(), q, k, v, mask, sinks=sinks, softcap=5.0)


# --------------------------------------------------------------------------- whole tiny models against eager

_LAYERS = 2
_MLA = dict(
    hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=_LAYERS, num_attention_heads=4,
    num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8, index_topk=3,
    index_head_dim=16, index_n_heads=2, vocab_size=100, max_position_embeddings=64, pad_token_id=0, bos_token_id=2,
    eos_token_id=1,
)  # fmt: skip
_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # the DSA families pass the indexer's top-k keys as indices=
    "deepseek_v32": ("DeepseekV32ForCausalLM", dict(_MLA, first_k_dense_replace=1)),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", dict(_MLA, first_k_dense_replace=1)),
    "axk2": ("AXK2ForCausalLM", dict(_MLA, gated_norm_rank=4, qk_head_dim=16)),
    # also s_aux, with a value head size other than the query/key one (issue 30's item 6)
    "hy_v4": ("HYV4ForCausalLM", dict(_MLA, qk_head_dim=16, v_head_dim=8, hc_mult=2)),
    "mistral_large4_text": ("MistralLarge4TextModel", dict(_MLA, qk_head_dim=16, first_k_dense_replace=1)),
    "dots3_note_text": ("Dots3NoteForCausalLM", dict(_MLA, sliding_window=4, shared_experts_intermediate_size=16)),
    # block_indices= over blocks of 2 keys
    "minimax_m3_vl_text": (
        "MiniMaxM3VLForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=_LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            dense_intermediate_size=32,
            shared_intermediate_size=16,
            rotary_dim=4,
            index_n_heads=2,
            index_head_dim=8,
            index_block_size=2,
            index_topk_blocks=2,
            index_local_blocks=1,
            layer_types=["minimax_m3_sparse"] * _LAYERS,
            vocab_size=100,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
        ),
    ),
    # per-token sinks= (b, h, lq, 1) and a position_bias
    "inkling2_text": (
        "Inkling2ForCausalLM",
        dict(
            hidden_size=32,
            num_hidden_layers=_LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=8,
            sliding_window_size=4,
            d_rel=4,
            rel_extent=8,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            vocab_size=100,
            unpadded_vocab_size=100,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
            n_layers_per_attn_res_block=1,
        ),
    ),
}


def _tiny_model(family: str) -> Any:
    """The family's model from its config class with tiny sizes (per-layer lists cut to the layers): no download."""
    class_name, sizes = _FAMILIES[family]
    defaults = transformers.AutoConfig.for_model(family).to_dict()
    per_layer = {
        name: value[:_LAYERS]
        for name, value in defaults.items()
        if isinstance(value, list) and len(value) == defaults.get("num_hidden_layers")
    }
    config = transformers.AutoConfig.for_model(family, **{**per_layer, **sizes})
    torch.manual_seed(0)
    return getattr(transformers, class_name)(config).eval()


def _outputs(model: Any, implementation: str) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Logits (or last hidden states) of real tokens of a right-padded batch and of an unpadded one, and the weights.

    Right padding: a padded query still sees keys, so every row has an answer (a left-padded row
    that sees no key gets eager's even spread, but MiniMax-M3's indexer reads every key's hidden
    state, a padded one's too, into the next layer's selection).
    """
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, -2:] = 0
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=attention_mask, output_attentions=True)
        unpadded = model(input_ids=ids[:1])
    field = "logits" if hasattr(padded, "logits") else "last_hidden_state"
    real_queries = attention_mask.bool()[:, None, :, None]
    weights = [layer[real_queries.expand_as(layer)] for layer in padded.attentions]
    return getattr(padded, field)[attention_mask.bool()], getattr(unpadded, field), weights


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_model_matches_eager(family: str) -> None:
    model = _tiny_model(family)
    expected = _outputs(model, "eager")
    got = _outputs(model, "selfattn")
    torch.testing.assert_close(got[0], expected[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], expected[1], atol=ATOL, rtol=0)
    assert len(got[2]) == len(expected[2]) == _LAYERS  # output_attentions=True: every layer's weights
    for got_weights, expected_weights in zip(got[2], expected[2], strict=True):
        torch.testing.assert_close(got_weights, expected_weights, atol=ATOL, rtol=0)


def test_left_padded_minimax_m3_matches_eager() -> None:
    """Left padding: the first queries of row 1 see no key, and their outputs reach the next layer's indexer.

    MiniMax-M3's indexer scores every token's hidden state, a padded one's too, so the blocks a
    real query selects in layer 2 depend on what layer 1 gave the padded queries: eager's even
    spread over the keys (selfattn gave zeros, and real tokens' logits differed by 0.12).
    """
    model = _tiny_model("minimax_m3_vl_text")
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0
    logits = {}
    for implementation in ("eager", "selfattn"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            logits[implementation] = model(input_ids=ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(logits["selfattn"], logits["eager"], atol=ATOL, rtol=0)  # padded positions too


@pytest.mark.parametrize("family", ["deepseek_v32", "minimax_m3_vl_text", "inkling2_text"])
def test_generation_matches_eager(family: str) -> None:
    """Decoding from a cache: one query, a selection over every cached key (or per-token sinks)."""
    model = _tiny_model(family)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    runs = {}
    for implementation in ("eager", "selfattn"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            runs[implementation] = model.generate(
                input_ids=ids, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True
            )
    assert torch.equal(runs["selfattn"].sequences, runs["eager"].sequences)
    for got, expected in zip(runs["selfattn"].scores, runs["eager"].scores, strict=True):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_a_static_caches_prefill_keeps_its_free_slots_in_the_weights_and_the_bias() -> None:
    """No mask, causal, more keys than queries (a prefill into a static cache): selfattn keeps the first ``lq``
    keys, and the weights still have a column per key passed (zeros for the free slots), and a position bias of
    the documented ``(1, h, lq, lk)`` is cut with the keys."""
    q, k, v = _qkv(3, 7)
    bias = torch.randn(1, 4, 3, 7)
    out, weights = attention_forward(_module(), q, k, v, None, output_attentions=True)
    kept_out, kept = attention_forward(_module(), q, k[..., :3, :], v[..., :3, :], None, output_attentions=True)
    assert weights.shape == (2, 4, 3, 7) and not weights[..., 3:].any()
    torch.testing.assert_close(weights[..., :3], kept)
    torch.testing.assert_close(out, kept_out)
    biased, _ = attention_forward(_module(), q, k, v, None, position_bias=bias)
    kept_biased, _ = attention_forward(_module(), q, k[..., :3, :], v[..., :3, :], None, position_bias=bias[..., :3])
    torch.testing.assert_close(biased, kept_biased)
