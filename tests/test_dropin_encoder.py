"""selfattn.nn.MultiheadAttention as ``self_attn`` inside torch's own nn.TransformerEncoder.

The promise (see the class docstring): the drop-in always runs, in training and in eval, and
torch's encoder around it gives what it gives around torch's attention with the same weights,
at every position, except that a sequence whose keys are all masked stays finite. Torch's
encoder takes two shortcuts in eval that used to bypass or break the drop-in: its fused layer
kernel (reads ``in_proj_weight``, never calls ``self_attn``) and its nested-tensor conversion
(decided when the encoder is built, so an encoder built with torch's attention and then given
the drop-in hands it nested tensors). Both constructions are tested here.

Shape legend: b batch, l tokens, e model size.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import selfattn.nn as snn

F64 = torch.float64
ATOL = 1e-10
EMBED, HEADS, FEEDFORWARD, LAYERS = 8, 4, 16, 2
OPTIONS = {"none": {}, "rotary": {"position": "rotary"}, "gqa": {"num_kv_heads": 2}}

pytestmark = [
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True"),  # torch's advice on its fast path
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),
]


def _randomize(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.5)


def _torch_weights_of(ours: snn.MultiheadAttention) -> dict[str, torch.Tensor]:
    """A torch MultiheadAttention state_dict computing what ``ours`` computes: grouped key/value heads repeated."""
    state = {name: t.clone() for name, t in ours.state_dict().items()}
    group = ours.num_heads // ours.num_kv_heads
    if group > 1:
        weights = state["in_proj_weight"].split(ours._split)
        biases = state["in_proj_bias"].split(ours._split)

        def repeat(t: torch.Tensor) -> torch.Tensor:  # (hk * dh, ...) -> (h * dh, ...), head i uses kv head i // group
            return t.unflatten(0, (ours.num_kv_heads, ours.head_dim)).repeat_interleave(group, dim=0).flatten(0, 1)

        state["in_proj_weight"] = torch.cat([weights[0], repeat(weights[1]), repeat(weights[2])])
        state["in_proj_bias"] = torch.cat([biases[0], repeat(biases[1]), repeat(biases[2])])
    return state


def _encoders(
    option: str, batch_first: bool, construction: str
) -> tuple[torch.nn.TransformerEncoder, torch.nn.TransformerEncoder]:
    """(torch's encoder with torch's attention, the same encoder with the drop-in as every ``self_attn``).

    ``construction`` "patched": the encoder is built with torch's attention and the drop-in replaces it
    afterwards (torch decided on nested tensors already); "built": the layer gets the drop-in first.
    """
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(EMBED, HEADS, FEEDFORWARD, dropout=0.0, batch_first=batch_first, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor advice
        reference = torch.nn.TransformerEncoder(copy.deepcopy(layer), LAYERS)
        if construction == "patched":
            ours = torch.nn.TransformerEncoder(copy.deepcopy(layer), LAYERS)
        else:
            layer.self_attn = snn.MultiheadAttention(
                EMBED, HEADS, batch_first=batch_first, dtype=F64, **OPTIONS[option]
            )
            ours = torch.nn.TransformerEncoder(layer, LAYERS)
    for index, (torch_layer, our_layer) in enumerate(zip(reference.layers, ours.layers, strict=True)):
        _randomize(torch_layer, seed=10 + index)
        for name in ("linear1", "linear2", "norm1", "norm2"):
            getattr(our_layer, name).load_state_dict(getattr(torch_layer, name).state_dict())
        if construction == "patched":
            our_layer.self_attn = snn.MultiheadAttention(
                EMBED, HEADS, batch_first=batch_first, dtype=F64, **OPTIONS[option]
            )
        _randomize(our_layer.self_attn, seed=20 + index)
        torch_layer.self_attn.load_state_dict(_torch_weights_of(our_layer.self_attn))
    return reference, ours


def _by_hand(
    encoder: torch.nn.TransformerEncoder,
    src: torch.Tensor,
    padding: torch.Tensor | None,
    mask: torch.Tensor | None,
    nested: bool,
) -> torch.Tensor:
    """The post-norm layers written out, each ``self_attn`` called directly (no torch shortcut can apply).

    Where torch's encoder runs on nested tensors (``nested``), it pads its output with zeros.
    """
    x = src
    for layer in encoder.layers:
        attended = layer.self_attn(x, x, x, key_padding_mask=padding, attn_mask=mask, need_weights=False)[0]
        x = layer.norm1(x + attended)
        x = layer.norm2(x + layer.linear2(torch.relu(layer.linear1(x))))
    if nested and padding is not None:
        padded_tokens = padding if encoder.layers[0].self_attn.batch_first else padding.T
        x = x.masked_fill(padded_tokens[..., None], 0.0)
    return x


def _inputs(batch_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """src ``(b, l, e)`` (or ``(l, b, e)``), key padding ``(b, l)`` with sequence 1 fully padded, a causal mask."""
    generator = torch.Generator().manual_seed(3)
    src = torch.randn(3, 5, EMBED, generator=generator, dtype=F64)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, 3:] = True
    padding[1, :] = True  # every key of sequence 1 masked
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    return (src if batch_first else src.transpose(0, 1)), padding, causal


@pytest.mark.parametrize("construction", ["built", "patched"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_encoder_with_the_dropin(construction: str, option: str, batch_first: bool, training: bool) -> None:
    reference, ours = _encoders(option, batch_first, construction)
    reference.train(training)
    ours.train(training)
    src, padding, causal = _inputs(batch_first)
    calls = [dict(), dict(src_key_padding_mask=padding), dict(src_key_padding_mask=padding, mask=causal)]
    for kwargs in calls:
        with torch.set_grad_enabled(training):  # eval without grad: where torch takes its shortcuts
            got = ours(src, **kwargs)
            expected = reference(src, **kwargs)
        assert got.shape == expected.shape == src.shape and got.is_contiguous()
        assert got.isfinite().all(), f"{kwargs.keys()}: the fully masked sequence must stay finite"
        # torch's encoder converts to nested tensors (zeros at padded tokens) in eval, batch-first, padding alone,
        # when the layer it was built with allows it: torch's attention, or the drop-in without options
        nested = (
            not training
            and batch_first
            and set(kwargs) == {"src_key_padding_mask"}
            and (construction == "patched" or option == "none")
        )
        with torch.no_grad():
            by_hand = _by_hand(ours, src, kwargs.get("src_key_padding_mask"), kwargs.get("mask"), nested)
        torch.testing.assert_close(got, by_hand, atol=ATOL, rtol=0)
        if option == "rotary":
            continue  # torch has no rotary: the drop-in called directly above is the reference
        # torch's attention gives NaN for the fully masked sequence (outside the nested path) and an encoder
        # built around the drop-in with options does not go nested (padded tokens not zeroed): compare the
        # tokens that are not padding
        valid = ~padding if "src_key_padding_mask" in kwargs else torch.ones(3, 5, dtype=torch.bool)
        if not batch_first:
            got, expected = got.transpose(0, 1), expected.transpose(0, 1)
        torch.testing.assert_close(got[valid], expected[valid], atol=ATOL, rtol=0)
        if nested:
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)  # zeros for sequence 1, as torch


@pytest.mark.parametrize("option", list(OPTIONS))
def test_eval_matches_training_without_dropout(option: str) -> None:
    """The drop-in runs in both modes, so its semantics (zero rows for fully masked queries) hold in both."""
    _, ours = _encoders(option, batch_first=True, construction="built")
    src, padding, causal = _inputs(batch_first=True)
    layer = ours.layers[0]
    trained = layer.train()(src, src_key_padding_mask=padding, src_mask=causal)
    with torch.no_grad():
        evaluated = layer.eval()(src, src_key_padding_mask=padding, src_mask=causal)
    assert evaluated.isfinite().all()
    torch.testing.assert_close(evaluated, trained.detach(), atol=ATOL, rtol=0)


def test_torch_fused_layer_kernel_never_replaces_the_dropin(monkeypatch: pytest.MonkeyPatch) -> None:
    """In eval without grad torch's layer would read ``in_proj_weight`` and skip ``self_attn`` (NaN rows here)."""
    reference, ours = _encoders("none", batch_first=True, construction="built")
    calls: list[int] = []
    forward = snn.MultiheadAttention.forward

    def counting(self: snn.MultiheadAttention, *args: object, **kwargs: object) -> object:
        calls.append(1)
        return forward(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(snn.MultiheadAttention, "forward", counting)
    src, padding, _ = _inputs(batch_first=True)
    with torch.no_grad():
        expected = reference.layers[0].eval()(src, src_key_padding_mask=padding)
        got = ours.layers[0].eval()(src, src_key_padding_mask=padding)
    assert calls == [1]
    assert expected[1].isnan().all() and got.isfinite().all()
    torch.testing.assert_close(got[[0, 2]], expected[[0, 2]], atol=ATOL, rtol=0)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("batch_first", [True, False])
def test_output_is_contiguous_with_torch_shape(option: str, batch_first: bool) -> None:
    torch.manual_seed(1)
    ours = snn.MultiheadAttention(EMBED, HEADS, batch_first=batch_first, dtype=F64, **OPTIONS[option])
    reference = torch.nn.MultiheadAttention(EMBED, HEADS, batch_first=batch_first, dtype=F64)
    src, _, _ = _inputs(batch_first)
    out = ours(src, src, src, need_weights=False)[0]
    assert out.shape == reference(src, src, src, need_weights=False)[0].shape
    assert out.is_contiguous()
    assert out.view(-1, EMBED).shape == (15, EMBED)  # torch's (l, b, e) output allows this


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_input_is_self_attention_within_each_sequence(layout: torch.layout) -> None:
    torch.manual_seed(2)
    ours = snn.MultiheadAttention(EMBED, HEADS, batch_first=True, dtype=F64, position="rotary")
    lengths = (3, 0, 5) if layout == torch.strided else (3, 1, 5)  # torch's encoder makes strided ones, empty too
    sequences = [torch.randn(length, EMBED, dtype=F64) for length in lengths]
    nested = torch.nested.as_nested_tensor(sequences, layout=layout)
    out, weights = ours(nested, nested, nested, need_weights=False)
    assert out.is_nested and out.layout == layout and weights is None
    for got, sequence in zip(out.unbind(), sequences, strict=True):
        alone = ours(sequence[None], sequence[None], sequence[None], need_weights=False)[0][0]
        assert got.shape == sequence.shape
        torch.testing.assert_close(got, alone, atol=ATOL, rtol=0)


def test_nested_input_refuses_what_it_cannot_honour() -> None:
    ours = snn.MultiheadAttention(EMBED, HEADS, batch_first=True, dtype=F64)
    nested = torch.nested.as_nested_tensor([torch.randn(3, EMBED, dtype=F64), torch.randn(2, EMBED, dtype=F64)])
    other = torch.nested.as_nested_tensor([torch.randn(3, EMBED, dtype=F64), torch.randn(2, EMBED, dtype=F64)])
    with pytest.raises(ValueError, match="self-attention only"):
        ours(nested, other, other, need_weights=False)
    with pytest.raises(ValueError, match="need_weights=True"):
        ours(nested, nested, nested)
    with pytest.raises(ValueError, match=r"key_padding_mask=torch.bool \(2, 3\)"):
        ours(nested, nested, nested, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool), need_weights=False)
    wrong_size = torch.nested.as_nested_tensor([torch.randn(3, 4, dtype=F64)])
    with pytest.raises(ValueError, match=r"sequences \(l_i, 8\)"):
        ours(wrong_size, wrong_size, wrong_size, need_weights=False)
