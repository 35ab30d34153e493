"""The attention function: the seeds' worked examples value for value, their counterfactuals (what goes
wrong when a step is done differently), and its contract with the mask."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model import GPTConfig
from model.attention import CausalSelfAttention, additive_mask, attention, causal_mask, fused_attention

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask


def t(rows) -> torch.Tensor:
    """A (1, 1, T, D) float64 tensor: one batch, one head."""
    return torch.tensor(rows, dtype=torch.float64)[None, None]


def close(got: torch.Tensor, rows) -> None:
    want = torch.tensor(rows, dtype=torch.float64)
    if not torch.allclose(got, want, atol=1e-4, rtol=0):
        pytest.fail(f"the seeds' worked example: got {got.numpy().round(4).tolist()}, the chapter has {rows}",
                    pytrace=False)


def test_identity_example():
    """Q = K = I2, V = [[2,0],[0,4]]: token 1 sees keys 0 and 1 with scores 0 and 1/sqrt(2)."""
    q = k = t([[1, 0], [0, 1]])
    out, w = attention(q, k, t([[2, 0], [0, 4]]), causal_mask(2, 2))
    close(w[0, 0], [[1, 0], [0.3302, 0.6698]])
    close(out[0, 0], [[2, 0], [0.6605, 2.6790]])
    close(attention(q, k, q)[1][0, 0, 0], [0.6698, 0.3302])  # unmasked, row 0 reads its future


def test_three_token_example_unmasked_and_causal():
    q = k = t([[1, 0], [0, 1], [1, 1]])
    v = t([[10, 0], [0, 10], [10, 10]])
    out, w = attention(q, k, v)
    close(w[0, 0], [[0.4011, 0.1978, 0.4011], [0.1978, 0.4011, 0.4011], [0.2483, 0.2483, 0.5035]])
    close(out[0, 0, 0], [8.0222, 5.9889])
    out, w = attention(q, k, v, causal_mask(3, 3))
    close(w[0, 0], [[1, 0, 0], [0.3302, 0.6698, 0], [0.2483, 0.2483, 0.5035]])
    close(out[0, 0], [[10, 0], [3.3024, 6.6976], [7.5174, 7.5174]])


def test_four_token_example():
    """The chapter prints rows 0-1 of the output from rounded weights (and 1.224 is a slip): exact values."""
    q, k = t([[2, 1], [0, 1], [1, 1], [1, 1]]), t([[0, 2], [2, 0], [1, 1], [1, 1]])
    out, w = attention(q, k, t([[2, 1], [0, 2], [1, 2], [1, 1]]))
    close(w[0, 0, 0], [0.1091, 0.4486, 0.2212, 0.2212])
    close(out[0, 0], [[0.6605, 1.6698], [1.3395, 1.3302], [1, 1.5], [1, 1.5]])


def test_scores_times_the_mask_instead_of_minus_inf_leaves_weight_on_the_future():
    q = k = t([[1, 0], [0, 1], [1, 1]])
    wrong = torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(2))[0, 0] * causal_mask(3, 3), dim=-1)
    assert wrong[0, 1:].sum().item() == pytest.approx(0.4965, abs=1e-4)  # exp(0) = 1, not 0
    assert attention(q, k, q, causal_mask(3, 3))[1][0, 0, 0, 1:].sum().item() == 0.0, "LEAK: query 0 reads a later key"


def qkv(T: int = 4, D: int = 3, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, T, D, generator=g, dtype=dtype) for _ in range(3))


def test_mask_after_softmax_leaves_rows_unnormalised_and_reads_the_future_through_the_denominator():
    q, k, v = qkv()
    allowed = causal_mask(4, 4)
    _, before = attention(q, k, v, allowed)
    after = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(3), dim=-1) * allowed
    assert (after.sum(-1)[..., :-1] < 1 - 1e-3).all(), "causal_mask(4, 4) hides no later key from a query"
    k2 = k.clone()
    k2[:, :, -1] += 5  # only the last key changes
    after2 = torch.softmax(q @ k2.transpose(-2, -1) / math.sqrt(3), dim=-1) * allowed
    assert not torch.allclose(after[:, :, 0], after2[:, :, 0])
    assert torch.equal(before[:, :, :-1], attention(q, k2, v, allowed)[1][:, :, :-1]), \
        "LEAK: a change of the last key moved the weights of earlier queries"  # masking first: it must not


def test_weights_rows_sum_to_one_masked_keys_get_exactly_zero_and_allowed_ones_more():
    q, k, v = (x * 3 for x in qkv(T=7, D=4))
    _, w = attention(q, k, v, causal_mask(7, 7))
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 7, dtype=torch.float64))
    assert (w[..., ~causal_mask(7, 7)] == 0).all() and (w[..., causal_mask(7, 7)] > 0).all()


@pytest.mark.parametrize("window", [0, 2])
def test_causal_mask_aligns_the_queries_with_the_last_keys(window):
    """Tq queries against Tk keys (decoding after a cache) are the last Tq rows of the square mask, whatever the
    rule (its grid itself is checked against tests/reference.py by the causality checks)."""
    for Tq in range(1, 6):
        assert torch.equal(causal_mask(Tq, 5, window=window), causal_mask(5, 5, window=window)[5 - Tq:])
    with pytest.raises(ValueError, match="Tq=3, Tk=2"):
        causal_mask(3, 2)


def test_a_query_that_may_read_no_key_is_refused_instead_of_nan():
    q, k, v = qkv()
    allowed = causal_mask(4, 4).clone()
    allowed[2] = False
    with pytest.raises(ValueError, match="query 2 may read no key"):
        attention(q, k, v, allowed)
    assert torch.isnan(torch.softmax(torch.full((3,), float("-inf")), dim=-1)).all()  # what it prevents
    # a mask held elsewhere (the meta device stands in for a GPU) is never read on the host
    out, w = attention(*(x.to("meta") for x in (q, k, v)), allowed.to("meta"))
    assert out.shape == (2, 2, 4, 3) and w.shape == (2, 2, 4, 4)


def test_minus_1e9_overflows_float16_while_minus_inf_keeps_masked_weights_at_zero():
    with pytest.raises(RuntimeError, match="overflow"):
        torch.zeros(1, 3, dtype=torch.float16).masked_fill(torch.tensor([[False, True, True]]), -1e9)
    assert additive_mask(causal_mask(4, 4), torch.float16)[0, 1].item() == float("-inf"), "LEAK: query 0 reads key 1"
    q, k, v = qkv(dtype=torch.float16)
    _, w = attention(q, k, v, causal_mask(4, 4))
    assert (w[..., ~causal_mask(4, 4)] == 0).all() and torch.isfinite(w).all()


def test_causal_and_padding_masks_combine_by_broadcasting():
    q, k, v = qkv(T=5)
    real = torch.tensor([[True] * 5, [False, False, True, True, True]])  # batch 1: 2 left-padded keys
    allowed = (causal_mask(5, 5) & real[:, None, None, :]).expand(2, 1, 5, 5).clone()  # (B, 1, Tq, Tk)
    allowed[1, :, :2] = causal_mask(5, 5)[:2]  # padded queries keep their own key: no empty row
    _, w = attention(q, k, v, allowed)
    assert (w[..., ~causal_mask(5, 5)] == 0).all() and (w[1, :, 2:, :2] == 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 5, dtype=torch.float64))


def test_keys_decide_the_weights_and_values_the_outputs():
    q, k, v = qkv()
    out, w = attention(q, k, v)
    swap = [1, 0, 2, 3]
    out2, w2 = attention(q, k, v[:, :, swap])
    assert torch.equal(w, w2) and not torch.allclose(out, out2)
    assert not torch.allclose(w, attention(q, k[:, :, swap], v)[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_sdpa_backend_computes_the_manual_function_with_the_same_mask(dtype):
    """The module on both backends (float64: to 1e-12); in bf16 on a CPU, sdpa is float32 sdpa rounded,
    also under autocast, gradients included."""
    torch.manual_seed(0)
    manual, fused = (CausalSelfAttention(GPTConfig(vocab_size=1, block_size=9, n_embd=32, n_head=4, bias=True,
                                                   attn_backend=backend), 0).double() for backend in ("manual", "sdpa"))
    fused.load_state_dict(manual.state_dict())
    x = torch.randn(3, 9, 32, dtype=torch.float64)
    mask = additive_mask(causal_mask(9, 9), torch.float64)
    if dtype == torch.float64:
        torch.testing.assert_close(manual(x, mask), fused(x, mask), atol=1e-12, rtol=0)
        return
    q, k, v = (torch.randn(2, 3, 16, 8).bfloat16().requires_grad_() for _ in range(3))
    mask = additive_mask(causal_mask(16, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_attention(q, k, v, mask, 0.0)
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref.bfloat16())
    g = torch.randn_like(ref).bfloat16()
    out.backward(g)
    ref.backward(g.float())
    assert all(torch.equal(a.grad, b.grad.bfloat16()) for a, b in zip((q, k, v), ref_in, strict=True))
