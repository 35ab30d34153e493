"""The attention function against the seeds' worked examples, and its basic invariants."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import CausalSelfAttention, additive_mask, attention, causal_mask

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask


def t(rows) -> torch.Tensor:
    """A (1, 1, T, D) float64 tensor from nested lists: one batch, one head."""
    return torch.tensor(rows, dtype=torch.float64)[None, None]


def test_identity_example_causal_weights_and_outputs():
    # Q = K = I2, V = [[2,0],[0,4]]: token 1 sees keys 0 and 1 with scores 0 and 1/sqrt(2)
    q = k = t([[1, 0], [0, 1]])
    v = t([[2, 0], [0, 4]])
    out, w = attention(q, k, v, causal_mask(2, 2))
    torch.testing.assert_close(w[0, 0], torch.tensor([[1, 0], [0.3302, 0.6698]], dtype=torch.float64),
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(out[0, 0], torch.tensor([[2, 0], [0.6605, 2.6790]], dtype=torch.float64),
                               atol=1e-4, rtol=0)
    _, w_free = attention(q, k, v)  # without the mask row 0 reads its future too
    torch.testing.assert_close(w_free[0, 0, 0], torch.tensor([0.6698, 0.3302], dtype=torch.float64),
                               atol=1e-4, rtol=0)


def test_three_token_example_unmasked_and_causal():
    q = k = t([[1, 0], [0, 1], [1, 1]])
    v = t([[10, 0], [0, 10], [10, 10]])
    out, w = attention(q, k, v)
    expected_w = [[0.4011, 0.1978, 0.4011], [0.1978, 0.4011, 0.4011], [0.2483, 0.2483, 0.5035]]
    torch.testing.assert_close(w[0, 0], torch.tensor(expected_w, dtype=torch.float64), atol=1e-4, rtol=0)
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([8.0222, 5.9889], dtype=torch.float64),
                               atol=1e-4, rtol=0)

    out_c, w_c = attention(q, k, v, causal_mask(3, 3))
    expected_wc = [[1, 0, 0], [0.3302, 0.6698, 0], [0.2483, 0.2483, 0.5035]]
    torch.testing.assert_close(w_c[0, 0], torch.tensor(expected_wc, dtype=torch.float64), atol=1e-4, rtol=0)
    expected_out = [[10, 0], [3.3024, 6.6976], [7.5174, 7.5174]]
    torch.testing.assert_close(out_c[0, 0], torch.tensor(expected_out, dtype=torch.float64), atol=1e-4, rtol=0)


def test_multiplying_future_scores_by_zero_leaves_weight_on_the_future():
    # The classic mistake: scores * mask instead of masked_fill(-inf). exp(0) = 1, not 0.
    q = k = t([[1, 0], [0, 1], [1, 1]])
    scores = (q @ k.transpose(-2, -1) / math.sqrt(2))[0, 0]
    wrong = torch.softmax(scores * causal_mask(3, 3), dim=-1)
    assert wrong[0, 1:].sum().item() == pytest.approx(0.4965, abs=1e-4)
    _, right = attention(q, k, q, causal_mask(3, 3))
    assert right[0, 0, 0, 1:].sum().item() == 0.0


def test_four_token_example_exact_values():
    # Q, K, V of the "4 tokens, d_k = 2" example. The chapter prints rows 0-1 of the output as
    # (0.660, 1.672) and (1.337, 1.224): it multiplied rounded weights, and 1.224 is an arithmetic
    # slip. These are the exact values.
    q = t([[2, 1], [0, 1], [1, 1], [1, 1]])
    k = t([[0, 2], [2, 0], [1, 1], [1, 1]])
    v = t([[2, 1], [0, 2], [1, 2], [1, 1]])
    out, w = attention(q, k, v)
    torch.testing.assert_close(w[0, 0, 0], torch.tensor([0.1091, 0.4486, 0.2212, 0.2212], dtype=torch.float64),
                               atol=1e-4, rtol=0)
    expected = [[0.6605, 1.6698], [1.3395, 1.3302], [1, 1.5], [1, 1.5]]
    torch.testing.assert_close(out[0, 0], torch.tensor(expected, dtype=torch.float64), atol=1e-4, rtol=0)


def test_weight_rows_sum_to_one_and_future_weights_are_exactly_zero():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=g) * 3 for _ in range(3))
    _, w = attention(q, k, v, causal_mask(7, 7))
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 7))
    future = ~causal_mask(7, 7)
    assert torch.all(w[..., future] == 0)
    assert torch.all(w[..., ~future] > 0)  # and nothing allowed is dropped


def test_causal_mask_aligns_queries_with_the_last_keys():
    assert torch.equal(causal_mask(3, 3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    # one new query against a history of 4 keys sees all of them
    assert torch.equal(causal_mask(1, 4), torch.ones(1, 4, dtype=torch.bool))
    assert torch.equal(causal_mask(2, 4), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))
    with pytest.raises(ValueError, match="Tq=3, Tk=2"):
        causal_mask(3, 2)


def test_query_row_without_any_allowed_key_raises():
    q = k = v = torch.randn(1, 1, 3, 2)
    allowed = causal_mask(3, 3).clone()
    allowed[1] = False
    with pytest.raises(ValueError, match="may read no key"):
        attention(q, k, v, allowed)


def test_manual_and_sdpa_backends_agree():
    torch.manual_seed(0)
    manual = CausalSelfAttention(32, 4, 0.0, True, "manual", False, 0).double()
    fused = CausalSelfAttention(32, 4, 0.0, True, "sdpa", False, 0).double()
    fused.load_state_dict(manual.state_dict())
    x = torch.randn(3, 9, 32, dtype=torch.float64)
    mask = additive_mask(causal_mask(9, 9), torch.float64)
    torch.testing.assert_close(manual(x, mask), fused(x, mask), atol=1e-12, rtol=0)
