"""The lightning indexer against transformers' DeepseekV32Indexer / GlmMoeDsaIndexer and a float64 formula.

Picks are compared as sets on the keys each query can see: on keys it cannot see (a query with
fewer than ``top_k`` earlier keys) transformers' top-k picks hidden keys by ``torch.topk``'s
order among equal masked scores, which selfattn returns as ``-1``. Each comparison first checks
that the inputs have no tie at the ``top_k`` boundary, so the picks are defined.

Shape legend: b batch, n tokens, T keys, H index heads, D index head size, k picks.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from selfattn.sparse import IndexerKeyCache, LightningIndexer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

SIZES = dict(
    hidden_size=32, q_lora_rank=24, index_n_heads=8, index_head_dim=16, qk_rope_head_dim=8, index_topk=5,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8,
    num_hidden_layers=1, vocab_size=50,
)  # fmt: skip


def _hf_indexer(family: str = "deepseek_v32", dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """transformers' indexer of a tiny config (random weights) and the model's rotary embedding."""
    if family == "deepseek_v32":
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as modeling

        config = transformers.DeepseekV32Config(**SIZES)
        indexer, rotary = modeling.DeepseekV32Indexer(config, 0), modeling.DeepseekV32RotaryEmbedding(config)
    else:
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as modeling

        config = transformers.GlmMoeDsaConfig(**SIZES)
        indexer, rotary = modeling.GlmMoeDsaIndexer(config, 0), modeling.GlmMoeDsaRotaryEmbedding(config)
    torch.manual_seed(0)
    for parameter in indexer.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return indexer.to(dtype).eval(), rotary


def _inputs(b: int, n: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, n, SIZES["hidden_size"], generator=generator, dtype=dtype)
    latent = torch.randn(b, n, SIZES["q_lora_rank"], generator=generator, dtype=dtype)
    return hidden, latent


def _reference_scores(indexer: LightningIndexer, hidden: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """``I(t, s) = sum_h w_th ReLU(q_th . k_s / sqrt(D))`` in float64 from the formula, ``(b, n, n)`` (no mask)."""
    d, heads, rope = indexer.head_dim, indexer.num_heads, indexer.rope_dim
    weights = {name: p.detach().double() for name, p in indexer.named_parameters()}
    hidden, latent = hidden.double(), latent.double()
    keys = torch.nn.functional.layer_norm(
        hidden @ weights["wk.weight"].T, (d,), weights["k_norm.weight"], weights["k_norm.bias"], eps=1e-6
    )
    queries = (latent @ weights["wq_b.weight"].T).unflatten(-1, (heads, d))
    angles = torch.arange(hidden.shape[1], dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(0, rope, 2, dtype=torch.float64) / rope
    )  # (n, rope / 2): pair p of the two halves turns by angle p

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        first, second = x[..., : rope // 2], x[..., rope // 2 : rope]
        return torch.cat([first * cos - second * sin, second * cos + first * sin, x[..., rope:]], dim=-1)

    keys = rotate(keys, angles.cos(), angles.sin())
    queries = rotate(queries, angles.cos()[:, None], angles.sin()[:, None])
    head_weights = (hidden @ weights["weights_proj.weight"].T) / heads**0.5  # (b, n, H)
    relu = torch.relu(torch.einsum("bqhd,bkd->bqhk", queries, keys) / d**0.5)
    return torch.einsum("bqh,bqhk->bqk", head_weights, relu)


def _our_scores(
    indexer: LightningIndexer, hidden: torch.Tensor, latent: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """The indexer's own unmasked scores ``(b, n, n)`` from its parts (for the tie check)."""
    with torch.no_grad():
        queries, weights = indexer.index_queries(hidden, latent, *cos_sin)
        keys = indexer.index_keys(hidden, *cos_sin)
        return torch.einsum("bqh,bqhk->bqk", weights, torch.relu(torch.einsum("bqhd,bkd->bqhk", queries, keys)))


def _visible(n: int, padding: torch.Tensor | None, total: int | None = None) -> torch.Tensor:
    """Bool ``(b or 1, n, T)``: causal (the queries are the last n of T keys) and not padding."""
    total = n if total is None else total
    seen = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
    return seen[None] if padding is None else seen[None] & ~padding[:, None, :]


def _as_sets(picks: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Bool ``(b, n, T)``: which visible keys were picked (-1 and hidden picks dropped)."""
    total = visible.shape[-1]
    slots = picks.long().masked_fill(picks < 0, total)
    chosen = torch.zeros(*picks.shape[:-1], total + 1, dtype=torch.bool).scatter(-1, slots, True)[..., :total]
    return chosen & visible


def _assert_no_boundary_tie(scores: torch.Tensor, visible: torch.Tensor, k: int, gap: float = 1e-4) -> None:
    """The k-th and (k+1)-th visible scores of every query differ by more than ``gap`` (the picks are defined)."""
    ordered = scores.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True).values
    for row in ordered.reshape(-1, ordered.shape[-1]):
        finite = row[torch.isfinite(row)]
        if finite.numel() > k:
            assert finite[k - 1] - finite[k] > gap, "a tie at the top-k boundary: pick other inputs"


@pytest.mark.parametrize(("family", "seed"), [("deepseek_v32", 2), ("glm_moe_dsa", 1)])  # seeds without a tie
def test_picks_equal_transformers_on_a_left_padded_batch(family: str, seed: int) -> None:
    hf, rotary = _hf_indexer(family)
    ours = LightningIndexer.from_transformers(hf)
    assert ours.interleaved == (family == "glm_moe_dsa")
    hidden, latent = _inputs(2, 11, seed=seed)
    padding = torch.zeros(2, 11, dtype=torch.bool)
    padding[1, :3] = True  # row 1 is left-padded
    visible = _visible(11, padding)
    positions = torch.arange(11)[None].expand(2, -1)
    cos_sin = rotary(hidden, positions)
    _assert_no_boundary_tie(
        _our_scores(ours, hidden, latent, cos_sin)[~padding], visible.expand(2, -1, -1)[~padding], 5
    )
    expected = hf(hidden, latent, cos_sin, visible, positions)
    got = ours(hidden, latent, rotary=cos_sin, key_padding=padding)
    assert got.shape == expected.shape == (2, 11, 5) and got.dtype == torch.long
    real = ~padding  # padded queries see no key: transformers' picks there are arbitrary
    torch.testing.assert_close(_as_sets(got, visible)[real], _as_sets(expected, visible)[real], atol=0, rtol=0)
    # the same picks from positions (selfattn's own rotary) as from transformers' (cos, sin)
    assert torch.equal(ours(hidden, latent, positions=positions, key_padding=padding), got)


def test_scores_and_picks_equal_the_float64_formula() -> None:
    hf, _ = _hf_indexer()
    ours = LightningIndexer.from_transformers(hf).double()
    hidden, latent = _inputs(2, 13, torch.float64, seed=1)
    scores = _reference_scores(ours, hidden, latent)
    visible = _visible(13, None)
    _assert_no_boundary_tie(scores, visible, ours.top_k)
    expected = scores.masked_fill(~visible, float("-inf")).topk(5, dim=-1).indices
    got = ours(hidden, latent)
    torch.testing.assert_close(_as_sets(got, visible), _as_sets(expected, visible), atol=0, rtol=0)


def test_a_query_with_fewer_than_k_earlier_keys_sees_all_of_them() -> None:
    hf, _ = _hf_indexer()
    ours = LightningIndexer.from_transformers(hf)
    hidden, latent = _inputs(1, 8)
    got = ours(hidden, latent)  # top_k = 5
    for query in range(5):
        assert sorted(got[0, query][got[0, query] >= 0].tolist()) == list(range(query + 1))
        assert int((got[0, query] == -1).sum()) == 5 - (query + 1)
    assert bool((got[0, 5:] >= 0).all())  # from 5 earlier keys on, every slot holds a pick


def test_cached_decoding_equals_the_full_pass() -> None:
    hf, _ = _hf_indexer()
    ours = LightningIndexer.from_transformers(hf)
    hidden, latent = _inputs(2, 12, seed=1)
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[0, :2] = True
    rotary = ours.rotary(torch.arange(12), torch.float32)
    _assert_no_boundary_tie(
        _our_scores(ours, hidden, latent, rotary)[~padding], _visible(12, padding).expand(2, -1, -1)[~padding], 5
    )
    full = ours(hidden, latent, key_padding=padding)
    visible = _visible(12, padding)
    cache = IndexerKeyCache(max_len=16)
    steps = [ours(hidden[:, :7], latent[:, :7], key_padding=padding[:, :7], cache=cache)]
    for t in range(7, 12):
        steps.append(ours(hidden[:, t : t + 1], latent[:, t : t + 1], key_padding=padding[:, t : t + 1], cache=cache))
    assert cache.length == 12 and cache.nbytes() == 2 * 12 * (16 * 4 + 1)
    for t, step in zip([range(7), *[[t] for t in range(7, 12)]], steps, strict=True):
        rows = list(t)
        step_sets = _as_sets(step, visible[:, rows, : rows[-1] + 1])
        assert torch.equal(step_sets, _as_sets(full[:, rows], visible[:, rows, : rows[-1] + 1]))


def test_a_failed_call_leaves_the_cache_as_it_was() -> None:
    hf, _ = _hf_indexer()
    ours = LightningIndexer.from_transformers(hf)
    hidden, latent = _inputs(1, 4)
    cache = IndexerKeyCache(max_len=6)
    ours(hidden, latent, cache=cache)
    with pytest.raises(ValueError, match=r"IndexerKeyCache\(max_len=6\) holds 4 tokens and cannot take 4 more"):
        ours(hidden, latent, cache=cache)
    with pytest.raises(ValueError, match=r"key_padding must be a bool \(b, n\) = \(1, 4\)"):
        ours(hidden, latent, key_padding=torch.zeros(1, 3, dtype=torch.bool), cache=cache)
    assert cache.length == 4
    ours(hidden[:, :2], latent[:, :2], cache=cache)
    assert cache.length == 6


@pytest.mark.parametrize("top_k", [0, -3, 2.5, True])
def test_bad_top_k_is_refused(top_k: object) -> None:
    with pytest.raises(ValueError, match=rf"top_k must be a positive integer, got {top_k!r}"):
        LightningIndexer(32, 24, 4, 16, 8, top_k)  # type: ignore[arg-type]


def test_bad_sizes_and_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"rope_dim must be an even non-negative integer, got 7"):
        LightningIndexer(32, 24, 4, 16, 7, 5)
    with pytest.raises(ValueError, match=r"rope_dim=18 is larger than head_dim=16"):
        LightningIndexer(32, 24, 4, 16, 18, 5)
    ours = LightningIndexer(32, 24, 4, 16, 8, 5)
    hidden, latent = _inputs(1, 4)
    with pytest.raises(
        ValueError, match=r"q_latent must be a float \(b, n, 24\) tensor, got torch.float32 \(1, 4, 23\)"
    ):
        ours(hidden, latent[..., :23])
    with pytest.raises(ValueError, match=r"positions and rotary both given"):
        ours(hidden, latent, positions=torch.arange(4), rotary=ours.rotary(torch.arange(4), torch.float32))
    with pytest.raises(ValueError, match=r"IndexerKeyCache: max_len|max_len must be a positive integer"):
        IndexerKeyCache(0)


def test_positions_rotary_padding_cache_and_theta_are_checked() -> None:
    """Bool positions were read as 0 and 1 (15 of 24 rows picked other keys), a theta of -1 gave NaN scores; the other
    misfits raised RuntimeError or AttributeError. Each is a ValueError naming the argument now."""
    from selfattn.latent import LatentCache
    from selfattn.sparse import select_top_k

    ours = LightningIndexer(32, 24, 4, 16, 8, 5)
    hidden, latent = _inputs(2, 4)
    cos, sin = ours.rotary(torch.arange(4), torch.float32)
    misfits = [
        (dict(positions=torch.ones(4, dtype=torch.bool)), r"positions must be integer .* got torch.bool \(4,\)"),
        (dict(positions=torch.zeros(3, 4, dtype=torch.long)), r"\(b, n\) = \(2, 4\), got torch.int64 \(3, 4\)"),
        (dict(rotary=cos), r"rotary must be \(cos, sin\) .* with b=2, got torch.float32 \(1, 4, 8\)$"),
        (dict(rotary=(cos.expand(3, 4, 8), sin.expand(3, 4, 8))), r"with b=2, got torch.float32 \(3, 4, 8\)"),
        (dict(key_padding=[[False] * 4] * 2), r"key_padding must be a bool \(b, n\) = \(2, 4\) tensor, got list"),
        (dict(cache=LatentCache(max_len=8)), "cache must be an IndexerKeyCache, got LatentCache"),
    ]
    for options, message in misfits:
        with pytest.raises(ValueError, match=message):
            ours(hidden, latent, **options)
    assert ours(hidden, latent, positions=torch.arange(4)[None]).shape == (2, 4, 4)  # (1, n) broadcasts
    for theta in (-1.0, 1.0, math.inf):
        with pytest.raises(ValueError, match=rf"rope_theta must be a finite number greater than 1, got {theta!r}"):
            LightningIndexer(32, 24, 4, 16, 8, 5, rope_theta=theta)
    for top_k in (0, -1):
        with pytest.raises(ValueError, match=rf"top_k must be a positive integer, got {top_k}"):
            select_top_k(torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2), torch.randn(1, 3, 4), None, 0, top_k)
