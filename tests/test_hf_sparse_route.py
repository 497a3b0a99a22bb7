"""A DSA model with ``attn_implementation="selfattn"``: its ``indices=`` run on the sparse route and equal eager.

The route is counted by the profiler range the dispatcher opens for it (``selfattn::sparse selection``),
so a test fails when the selection goes to a dense masked pass instead.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from selfattn.core import dispatch
from selfattn.core.routes.sparse import SPARSE_MAX_SHARE
from selfattn.functional._sparse import describe_sparse_attention
from selfattn.integrations.transformers import attention_forward, register

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

ATOL = 1e-5
LAYERS = 2
TOP_K = 3
SIZES = dict(
    hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=LAYERS, num_attention_heads=4,
    num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8,
    index_topk=TOP_K, index_head_dim=16, index_n_heads=2, vocab_size=100, max_position_embeddings=64, pad_token_id=0,
    bos_token_id=2, eos_token_id=1, first_k_dense_replace=1,
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    register()


def _model() -> Any:
    config = transformers.DeepseekV32Config(**SIZES)
    torch.manual_seed(0)
    return transformers.DeepseekV32ForCausalLM(config).eval()


def _sparse_route_runs(run: Any) -> tuple[Any, int]:
    """``run()``'s result and how many attention calls the "sparse selection" route computed in it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = run()
    return result, sum(event.name == "selfattn::sparse selection" for event in profile.events())


def test_a_right_padded_batch_runs_on_the_sparse_route_and_equals_eager() -> None:
    model = _model()
    length = 16  # TOP_K picks of 16 keys: a small enough share for the sparse route
    assert SPARSE_MAX_SHARE * length >= TOP_K
    ids = torch.randint(3, 100, (2, length), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, -3:] = 0
    logits = {}
    for implementation in ("eager", "selfattn"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            output, runs = _sparse_route_runs(lambda: model(input_ids=ids, attention_mask=attention_mask))
        logits[implementation] = output.logits[attention_mask.bool()]
        assert runs == (LAYERS if implementation == "selfattn" else 0)
    torch.testing.assert_close(logits["selfattn"], logits["eager"], atol=ATOL, rtol=0)


def test_generation_runs_on_the_sparse_route_and_equals_eager() -> None:
    model = _model()
    ids = torch.randint(3, 100, (1, 14), generator=torch.Generator().manual_seed(2))
    generated = {}
    for implementation in ("eager", "selfattn"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            generated[implementation], runs = _sparse_route_runs(
                lambda: model.generate(
                    input_ids=ids, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True
                )
            )
    assert runs == LAYERS * 4  # the prefill and three decoding steps, each layer once
    assert torch.equal(generated["selfattn"].sequences, generated["eager"].sequences)
    for got, expected in zip(generated["selfattn"].scores, generated["eager"].scores, strict=True):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_explain_names_the_sparse_route_for_the_backend_call() -> None:
    q = torch.randn(1, 2, 6, 4)
    picks = torch.tensor([[[0, -1], [1, 0], [2, 1], [3, 0], [4, 2], [5, 4]]])
    mask = torch.ones(1, 1, 6, 24, dtype=torch.bool)
    k = torch.randn(1, 2, 24, 4)
    explanation = dispatch.explain(describe_sparse_attention(q, k, k, picks, mask=mask))
    assert explanation.route == "sparse selection"
    got, _ = attention_forward(torch.nn.Module(), q, k, k, mask, scaling=0.5, indices=picks.int())
    chosen = torch.zeros(1, 6, 25, dtype=torch.bool).scatter(-1, picks.masked_fill(picks < 0, 24), True)[..., :24]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=chosen[:, None], scale=0.5)
    torch.testing.assert_close(got, expected.transpose(1, 2), atol=1e-6, rtol=0)
