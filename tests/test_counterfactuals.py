"""The seeds' counterfactuals: what goes wrong when a step of attention is done differently."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import attention, causal_mask

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask


def qkv(T: int = 4, D: int = 3, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, T, D, generator=g, dtype=dtype) for _ in range(3))


def test_mask_after_softmax_leaves_rows_unnormalised_and_depends_on_the_future():
    q, k, v = qkv()
    allowed = causal_mask(4, 4)
    _, before = attention(q, k, v, allowed)
    after = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(3), dim=-1) * allowed
    torch.testing.assert_close(before.sum(-1), torch.ones(2, 2, 4, dtype=torch.float64))
    assert (after.sum(-1)[..., :-1] < 1 - 1e-3).all()  # every row but the last lost its future mass
    k2 = k.clone()
    k2[:, :, -1] += 5  # change only the last key
    after2 = torch.softmax(q @ k2.transpose(-2, -1) / math.sqrt(3), dim=-1) * allowed
    assert not torch.allclose(after[:, :, 0], after2[:, :, 0])  # row 0 changed through the denominator
    _, before2 = attention(q, k2, v, allowed)
    assert torch.equal(before[:, :, :-1], before2[:, :, :-1])  # masking first: rows before it do not


def test_fully_masked_row_raises_instead_of_nan():
    q, k, v = qkv()
    allowed = torch.zeros(4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="may read no key"):
        attention(q, k, v, allowed)
    # what the check prevents: softmax over a row of -inf is NaN
    assert torch.isnan(torch.softmax(torch.full((3,), float("-inf")), dim=-1)).all()


def test_minus_1e9_overflows_float16_while_minus_inf_and_finfo_min_behave():
    scores = torch.tensor([[0.5, 0.25, -0.5]], dtype=torch.float16)
    future = torch.tensor([[False, True, True]])
    assert torch.isinf(torch.tensor(-1e9).half())  # -1e9 is not a float16 number
    with pytest.raises(RuntimeError, match="overflow"):
        scores.masked_fill(future, -1e9)
    for fill in (float("-inf"), torch.finfo(torch.float16).min):
        w = torch.softmax(scores.masked_fill(future, fill).float(), dim=-1)
        assert w[0, 0].item() == 1.0 and (w[0, 1:] == 0).all()
    # and the real attention in float16 keeps future weights at exactly 0
    q, k, v = qkv(dtype=torch.float16)
    _, w = attention(q, k, v, causal_mask(4, 4))
    assert (w[..., ~causal_mask(4, 4)] == 0).all() and torch.isfinite(w).all()


@pytest.mark.parametrize("padding_shape", ["(B,1,1,Tk)", "(1,1,Tq,Tk)"])
def test_causal_and_padding_masks_combine_by_broadcasting(padding_shape):
    q, k, v = qkv(T=5)
    causal = causal_mask(5, 5)
    real = torch.tensor([[True] * 5, [False, False, True, True, True]])  # batch 1: 2 left-padded keys
    if padding_shape == "(B,1,1,Tk)":
        allowed = causal & real[:, None, None, :]  # (B,1,1,Tk) & (Tq,Tk) -> (B,1,Tq,Tk)
        assert allowed.shape == (2, 1, 5, 5)
        allowed[1, :, :2] = causal[:2]  # padded queries keep their own key, so no row is empty
    else:
        allowed = causal.view(1, 1, 5, 5)
    out, w = attention(q, k, v, allowed)
    assert w.shape == (2, 2, 5, 5)
    assert (w[..., ~causal] == 0).all()
    if padding_shape == "(B,1,1,Tk)":
        assert (w[1, :, 2:, :2] == 0).all()  # real queries never read padding
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 5, dtype=torch.float64))


def test_swapping_rows_of_v_changes_outputs_not_weights():
    # keys decide the matching (the weights), values decide the content (the outputs)
    q, k, v = qkv()
    out, w = attention(q, k, v)
    v2 = v.clone()
    v2[:, :, [0, 1]] = v[:, :, [1, 0]]
    out2, w2 = attention(q, k, v2)
    assert torch.equal(w, w2)
    assert not torch.allclose(out, out2)
    # swapping the same rows of k changes the weights
    k2 = k.clone()
    k2[:, :, [0, 1]] = k[:, :, [1, 0]]
    _, w3 = attention(q, k2, v)
    assert not torch.allclose(w, w3)
