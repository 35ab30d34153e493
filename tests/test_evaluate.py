"""The two loss measurements of a run: the in-training estimate and the exact val loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data import get_batch
from model import GPT, GPTConfig
from training import estimate_loss, exact_loss

V, T, B = 11, 8, 3


@pytest.fixture(scope="module")
def model_and_splits():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=1, n_head=2, n_embd=16))
    rng = np.random.default_rng(0)
    splits = {"train": torch.from_numpy(rng.integers(0, V, 500)), "val": torch.from_numpy(rng.integers(0, V, 203))}
    return model, splits


@pytest.mark.parametrize("batches_per_forward", [1, 3, 7, 50])
def test_estimate_is_the_mean_loss_of_the_seeded_batches_however_they_are_grouped(model_and_splits,
                                                                                   batches_per_forward):
    """7 batches in groups of 3 ends with a group of 1: it must weigh as one batch, not as three."""
    model, splits = model_and_splits
    got = estimate_loss(model, splits, B, T, 7, seed=5, device="cpu", batches_per_forward=batches_per_forward)
    for name, data in splits.items():
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            by_hand = np.mean([model(*get_batch(data, B, T, gen))[1].item() for _ in range(7)])
        assert got[name] == pytest.approx(by_hand, abs=1e-6)
    assert model.training  # put back in the mode it came in


def test_exact_loss_scores_every_target_once_from_its_window(model_and_splits):
    """203 tokens = 202 targets: 25 full windows of 8 and one of 2, every target exactly once."""
    model, splits = model_and_splits
    data = splits["val"]
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(data) - 1, T):
            x, y = data[s:s + T][None], data[s + 1:s + 1 + T][None]
            x = x[:, :y.size(1)]
            total += F.cross_entropy(model(x)[0][0].double(), y[0], reduction="sum").item()
            count += y.size(1)
    assert count == len(data) - 1
    assert exact_loss(model, data, T, 4, "cpu") == pytest.approx(total / count, abs=1e-6)


class _Failing(torch.nn.Module):
    def forward(self, idx, targets=None):
        assert not self.training, "evaluated in training mode"
        raise RuntimeError("out of memory (pretend)")


@pytest.mark.parametrize("evaluate", ["estimate", "exact"])
def test_a_failed_evaluation_puts_the_model_back_in_training_mode(evaluate):
    """Dropout must not stay off after an eval that raised (evaluating() restores the mode)."""
    model = _Failing().train()
    data = torch.arange(100) % 7
    with pytest.raises(RuntimeError, match="pretend"):
        if evaluate == "estimate":
            estimate_loss(model, {"val": data}, 2, 8, 1, 0, "cpu")
        else:
            exact_loss(model, data, 8, 2, "cpu")
    assert model.training


@pytest.mark.parametrize("extra", range(10))
def test_the_exact_val_loss_scores_every_target_for_every_split_length_modulo_block_size(extra):
    """2 full windows of block_size 10 and `extra` targets more: extra = 1 leaves a last window of a
    single target, extra = 0 none at all. Each length is checked against a by-hand cross-entropy."""
    import causality as C

    model = C.leak_test_model("manual")
    corpus = np.random.default_rng(extra).integers(0, model.config.vocab_size, 2 * 10 + extra + 1)
    check = C.check_exact_loss_is_next_token_cross_entropy(model, corpus.astype(np.uint16))
    C.require(check)
