"""The attention function: the seeds' worked examples, combined masks, refusals, -inf in float16, the fused kernel.
Which keys each query reads (weights, outputs, gradients, half precision, the mask's grid): tests/causality.py."""

import pytest
import torch
import torch.nn.functional as F

from model.attention import additive_mask, attention, causal_mask, fused_attention

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask
I2, V2, Q3, V3 = [[1, 0], [0, 1]], [[2, 0], [0, 4]], [[1, 0], [0, 1], [1, 1]], [[10, 0], [0, 10], [10, 10]]
t = lambda rows: torch.tensor(rows, dtype=torch.float64)[None, None]  # (1, 1, T, D): one batch, one head
qkv = lambda T=4, D=3: torch.randn(3, 2, 2, T, D, generator=torch.Generator().manual_seed(0),  # q, k, v: (2, 2, T, D)
                                  dtype=torch.float64).unbind(0)


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
    chapter = torch.ones(len(q), len(q), dtype=torch.bool).tril()  # its causal mask, not the rule: an edit leaves it
    o, w = attention(t(q), t(k), t(v), chapter if causal else None)
    for got, rows in ((w[0, 0, :len(weights)], weights), (o[0, 0, :len(out)], out)):
        if rows and not torch.allclose(got, torch.tensor(rows, dtype=torch.float64), atol=1e-4, rtol=0):
            pytest.fail(f"the seeds' worked example: got {got.numpy().round(4).tolist()}, the chapter has {rows}",
                        pytrace=False)


def test_causal_and_padding_masks_combined_by_broadcasting_keep_weights_on_allowed_keys_alone_summing_to_one():
    """A (B, 1, Tq, Tk) mask of the causal rule and batch row 1's 2 left-padded keys (the rule alone: causality.py)."""
    q, k, v = (x * 3 for x in qkv(T=7, D=4))
    real = torch.tensor([[True] * 7, [False] * 2 + [True] * 5])  # padded queries 0, 1 keep their causal keys
    allowed = causal_mask(7, 7) & (real[:, None, None, :] | (torch.arange(7) < 2)[:, None])  # (B, 1, Tq, Tk)
    _, w = attention(q, k, v, allowed)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 7, dtype=torch.float64))
    allowed = allowed.expand_as(w)
    assert (w[~allowed] == 0).all(), "LEAK: a later or padded key got weight"
    assert (w[allowed] > 0).all()


def test_a_query_that_may_read_no_key_or_more_queries_than_keys_are_refused():
    (q, k, v), allowed = qkv(), causal_mask(4, 4) & (torch.arange(4) != 2)[:, None]  # query 2 reads nothing
    with pytest.raises(ValueError, match="query 2 may read no key"):
        attention(q, k, v, allowed)
    assert torch.isnan(torch.softmax(torch.full((3,), float("-inf")), dim=-1)).all()  # what it prevents
    with pytest.raises(ValueError, match="Tq=3, Tk=2"):  # the queries are the last Tq of the keys' positions
        causal_mask(3, 2)
    # a mask held elsewhere (the meta device stands in for a GPU) is never read on the host
    out, w = attention(*(x.to("meta") for x in (q, k, v)), allowed.to("meta"))
    assert out.shape == (2, 2, 4, 3) and w.shape == (2, 2, 4, 4)


def test_minus_1e9_overflows_float16_so_the_additive_mask_holds_minus_inf():
    with pytest.raises(RuntimeError, match="overflow"):
        torch.zeros(1, 3, dtype=torch.float16).masked_fill(torch.tensor([[False, True, True]]), -1e9)
    assert additive_mask(causal_mask(4, 4), torch.float16)[0, 1].item() == float("-inf"), "LEAK: query 0 reads key 1"


def test_keys_decide_the_weights_and_values_the_outputs():
    (q, k, v), swap = qkv(), [1, 0, 2, 3]
    (out, w), (out2, w2) = attention(q, k, v), attention(q, k, v[:, :, swap])
    assert torch.equal(w, w2) and not torch.allclose(out, out2)
    assert not torch.allclose(w, attention(q, k[:, :, swap], v)[1])


@pytest.mark.parametrize("p", [0.0, 0.5])  # 0.5: float32's dropout too, under the same seed
def test_bf16_sdpa_on_a_cpu_is_float32_sdpa_rounded_under_autocast_gradients_included(p):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8).bfloat16().requires_grad_() for _ in range(3))
    mask = additive_mask(causal_mask(16, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)
        out = fused_attention(q, k, v, mask, p)
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    torch.manual_seed(1)
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask, dropout_p=p)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref.bfloat16()), "fused_attention's bf16 CPU path is not " \
        f"float32 sdpa under the same mask (max difference {(out.float() - ref).abs().max():.3g}; model/attention.py)"
    g = torch.randn_like(ref).bfloat16()
    torch.autograd.backward([out, ref], [g, g.float()])
    assert all(torch.equal(a.grad, b.grad.bfloat16()) for a, b in zip((q, k, v), ref_in, strict=True))
