"""Packed documents: block-diagonal attention with positions restarting per document == each alone."""

import pytest
import torch
from reference_mha import ENCODINGS, make_encoding

from selfattn import MultiHeadAttention
from selfattn.attention import document_positions

D, H = 16, 4


@pytest.mark.parametrize("name", ENCODINGS)
@pytest.mark.parametrize("causal", [False, True])
def test_packed_equals_separate(name, causal):
    position = make_encoding(name, D, H)
    torch.manual_seed(1)
    mha = MultiHeadAttention(D, H, position=position, num_kv_heads=2).double().eval()
    lengths = [[3, 5, 2], [10]]
    docs = [torch.randn(1, n, D, dtype=torch.float64) for row in lengths for n in row]
    packed = torch.cat([torch.cat(docs[:3], 1), docs[3]])  # (2, 10, D)
    document_ids = torch.tensor([[0] * 3 + [1] * 5 + [2] * 2, [4] * 10])
    with torch.no_grad():
        out, weights = mha(packed, packed, packed, causal=causal, document_ids=document_ids, return_weights=True)
        fused = mha(packed, packed, packed, causal=causal, document_ids=document_ids)
        alone = [mha(doc, doc, doc, causal=causal) for doc in docs]
    torch.testing.assert_close(fused, out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out[0], torch.cat(alone[:3], 1)[0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out[1], alone[3][0], atol=1e-12, rtol=1e-10)
    assert weights[0, :, :3, 3:].abs().max() == 0  # nothing leaks across documents


def test_document_positions_restart():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [7, 7, 3, 3, 3, 3]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]


def test_document_ids_errors():
    mha = MultiHeadAttention(D, H)
    x, kv = torch.randn(2, 3, D), torch.randn(2, 4, D)
    with pytest.raises(ValueError, match=r"document_ids must be an integer tensor of shape \(2, 3\)"):
        mha(x, x, x, document_ids=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="document_ids needs self-attention"):
        mha(x, kv, kv, document_ids=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="either offset or positions/document_ids"):
        mha(x, x, x, offset=2, document_ids=torch.zeros(2, 3, dtype=torch.long))


def test_documents_with_valid_lens_that_drop_keys():
    position = make_encoding("alibi", D, H)
    torch.manual_seed(2)
    mha = MultiHeadAttention(D, H, position=position).double().eval()
    a, b = torch.randn(1, 3, D, dtype=torch.float64), torch.randn(1, 2, D, dtype=torch.float64)
    packed = torch.cat([a, b, torch.zeros(1, 3, D, dtype=torch.float64)], 1)  # 3 padding tokens at the end
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    with torch.no_grad():
        out = mha(packed, packed, packed, torch.tensor([5]), causal=True, document_ids=document_ids)
        alone = torch.cat([mha(a, a, a, causal=True), mha(b, b, b, causal=True)], 1)
    torch.testing.assert_close(out[:, :5], alone, atol=1e-12, rtol=1e-10)
    assert out[:, 5:].abs().max() == 0  # padding rows see no key of their own document (W_o has no bias)
