"""The attention function: the seeds' worked examples, what goes wrong when a step is done otherwise, the mask."""

import math

import pytest
import torch
import torch.nn.functional as F

from model import GPTConfig
from model.attention import CausalSelfAttention, additive_mask, attention, causal_mask, fused_attention

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask
I2, V2, Q3, V3 = [[1, 0], [0, 1]], [[2, 0], [0, 4]], [[1, 0], [0, 1], [1, 1]], [[10, 0], [0, 10], [10, 10]]
t = lambda rows: torch.tensor(rows, dtype=torch.float64)[None, None]  # (1, 1, T, D): one batch, one head
qkv = lambda T=4, D=3, dtype=torch.float64: torch.randn(  # q, k, v: (2, 2, T, D) each
    3, 2, 2, T, D, generator=torch.Generator().manual_seed(0), dtype=dtype).unbind(0)


@pytest.mark.parametrize("q, k, v, causal, weights, out", [  # the first rows of each that the chapter prints
    (I2, I2, V2, True, [[1, 0], [0.3302, 0.6698]], [[2, 0], [0.6605, 2.6790]]),  # token 1: scores 0, 1/sqrt(2)
    (I2, I2, V2, False, [[0.6698, 0.3302]], []),  # unmasked, row 0 reads its future
    (Q3, Q3, V3, False, [[0.4011, 0.1978, 0.4011], [0.1978, 0.4011, 0.4011], [0.2483, 0.2483, 0.5035]],
     [[8.0222, 5.9889]]),
    (Q3, Q3, V3, True, [[1, 0, 0], [0.3302, 0.6698, 0], [0.2483, 0.2483, 0.5035]],
     [[10, 0], [3.3024, 6.6976], [7.5174, 7.5174]]),
    # the chapter prints rows 0-1 of the output from rounded weights (and 1.224 is a slip): exact values
    ([[2, 1], [0, 1], [1, 1], [1, 1]], [[0, 2], [2, 0], [1, 1], [1, 1]], [[2, 1], [0, 2], [1, 2], [1, 1]], False,
     [[0.1091, 0.4486, 0.2212, 0.2212]], [[0.6605, 1.6698], [1.3395, 1.3302], [1, 1.5], [1, 1.5]]),
], ids=["identity", "identity-unmasked", "three-tokens", "three-tokens-causal", "four-tokens"])
def test_the_seeds_worked_examples(q, k, v, causal, weights, out):
    o, w = attention(t(q), t(k), t(v), causal_mask(len(q), len(q)) if causal else None)
    for got, rows in ((w[0, 0, :len(weights)], weights), (o[0, 0, :len(out)], out)):
        if rows and not torch.allclose(got, torch.tensor(rows, dtype=torch.float64), atol=1e-4, rtol=0):
            pytest.fail(f"the seeds' worked example: got {got.numpy().round(4).tolist()}, the chapter has {rows}",
                        pytrace=False)


def test_scores_times_the_mask_instead_of_minus_inf_leaves_weight_on_the_future():
    q = k = t(Q3)
    wrong = torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(2))[0, 0] * causal_mask(3, 3), dim=-1)
    assert wrong[0, 1:].sum().item() == pytest.approx(0.4965, abs=1e-4)  # exp(0) = 1, not 0
    assert attention(q, k, q, causal_mask(3, 3))[1][0, 0, 0, 1:].sum().item() == 0.0, "LEAK: query 0 reads a later key"


def test_mask_after_softmax_leaves_rows_unnormalised_and_reads_the_future_through_the_denominator():
    (q, k, v), allowed = qkv(), causal_mask(4, 4)
    masked_after = lambda k: torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(3), dim=-1) * allowed
    after = masked_after(k)
    assert (after.sum(-1)[..., :-1] < 1 - 1e-3).all(), "causal_mask(4, 4) hides no later key from a query"
    k2 = k + torch.tensor([0, 0, 0, 5.0], dtype=torch.float64)[:, None]  # only the last key changes
    assert not torch.allclose(after[:, :, 0], masked_after(k2)[:, :, 0])
    assert torch.equal(attention(q, k, v, allowed)[1][:, :, :-1], attention(q, k2, v, allowed)[1][:, :, :-1]), \
        "LEAK: a change of the last key moved the weights of earlier queries"  # masking first: it must not


@pytest.mark.parametrize("padded", [False, True])  # True: batch row 1 has 2 left-padded keys
def test_weights_rows_sum_to_one_masked_keys_get_exactly_zero_and_allowed_ones_more(padded):
    """Also when causal and padding masks combine by broadcasting to (B, 1, Tq, Tk)."""
    q, k, v = (x * 3 for x in qkv(T=7, D=4))
    real = torch.tensor([[True] * 7, [not padded] * 2 + [True] * 5])  # padded queries 0, 1 keep their causal keys
    allowed = causal_mask(7, 7) & (real[:, None, None, :] | (torch.arange(7) < 2)[:, None])  # (B, 1, Tq, Tk)
    _, w = attention(q, k, v, allowed if padded else causal_mask(7, 7))
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 7, dtype=torch.float64))
    allowed = allowed.expand_as(w)
    assert (w[~allowed] == 0).all(), "LEAK: a later or padded key got weight"
    assert (w[allowed] > 0).all() and (w[1, :, 2:, :2] == 0).all() == padded


@pytest.mark.parametrize("window", [0, 2])
def test_causal_mask_aligns_the_queries_with_the_last_keys(window):
    """Tq queries on Tk keys (decoding after a cache) are the square mask's last Tq rows (grid: test_causality)."""
    for Tq in range(1, 6):
        assert torch.equal(causal_mask(Tq, 5, window=window), causal_mask(5, 5, window=window)[5 - Tq:])
    with pytest.raises(ValueError, match="Tq=3, Tk=2"):
        causal_mask(3, 2)


def test_a_query_that_may_read_no_key_is_refused_instead_of_nan():
    q, k, v = qkv()
    allowed = causal_mask(4, 4) & (torch.arange(4) != 2)[:, None]  # query 2 reads nothing
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
    _, w = attention(*qkv(dtype=torch.float16), causal_mask(4, 4))
    assert (w[..., ~causal_mask(4, 4)] == 0).all() and torch.isfinite(w).all()


def test_keys_decide_the_weights_and_values_the_outputs():
    (q, k, v), swap = qkv(), [1, 0, 2, 3]
    (out, w), (out2, w2) = attention(q, k, v), attention(q, k, v[:, :, swap])
    assert torch.equal(w, w2) and not torch.allclose(out, out2)
    assert not torch.allclose(w, attention(q, k[:, :, swap], v)[1])


def test_the_sdpa_backend_computes_the_manual_function_with_the_same_mask():
    """The module on both backends agrees to 1e-12 in float64."""
    torch.manual_seed(0)
    manual, fused = (CausalSelfAttention(GPTConfig(vocab_size=1, block_size=9, n_embd=32, n_head=4, bias=True,
                                                   attn_backend=backend), 0).double() for backend in ("manual", "sdpa"))
    fused.load_state_dict(manual.state_dict())
    x, mask = torch.randn(3, 9, 32, dtype=torch.float64), additive_mask(causal_mask(9, 9), torch.float64)
    torch.testing.assert_close(manual(x, mask), fused(x, mask), atol=1e-12, rtol=0)


def test_bf16_sdpa_on_a_cpu_is_float32_sdpa_rounded_under_autocast_gradients_included():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8).bfloat16().requires_grad_() for _ in range(3))
    mask = additive_mask(causal_mask(16, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_attention(q, k, v, mask, 0.0)
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref.bfloat16())
    g = torch.randn_like(ref).bfloat16()
    torch.autograd.backward([out, ref], [g, g.float()])
    assert all(torch.equal(a.grad, b.grad.bfloat16()) for a, b in zip((q, k, v), ref_in, strict=True))
