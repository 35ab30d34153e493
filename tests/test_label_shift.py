"""Targets are the next tokens: in the batches, in the loss train.py optimises, and in behaviour."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import causality as C
import train
from data import load_corpus
from model import GPT
from mutants import batcher, mask_leaks_one_step, substitute
from training import TrainConfig, parse_args

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask

ROOT = Path(__file__).resolve().parent.parent


def test_targets_are_the_next_tokens_and_offsets_cover_every_window():
    C.require(C.check_batch_shift())


def test_model_loss_is_cross_entropy_against_the_next_corpus_token():
    model = C.leak_test_model("manual")
    corpus = np.random.default_rng(0).integers(0, model.config.vocab_size, 500).astype(np.uint16)
    check = C.check_loss_is_next_token_cross_entropy(model, corpus)
    C.require(check)


def test_exact_val_loss_is_cross_entropy_against_the_next_corpus_token():
    model = C.leak_test_model("manual")
    corpus = np.random.default_rng(0).integers(0, model.config.vocab_size, 2 * model.config.block_size + 5)
    check = C.check_exact_loss_is_next_token_cross_entropy(model, corpus.astype(np.uint16))
    C.require(check)


def test_the_exact_loss_check_catches_a_shift_forgotten_in_the_exact_loss_alone(monkeypatch):
    """The mutant lives only where exact_loss cuts its windows: the batches stay right, so only the
    exact-loss check can see it."""
    import training.evaluate

    monkeypatch.setattr(training.evaluate, "inputs_and_targets", lambda w: (w[:, :-1], w[:, :-1]))
    model = C.leak_test_model("manual")
    corpus = np.random.default_rng(0).integers(0, model.config.vocab_size, 2 * model.config.block_size + 5)
    assert C.check_batch_shift().ok
    assert not C.check_exact_loss_is_next_token_cross_entropy(model, corpus.astype(np.uint16)).ok


def _write_random_text(path, n: int, alphabet: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    path.write_text("".join(rng.choice(list(alphabet), n)), encoding="utf-8")


def test_the_loss_train_py_optimises_is_next_token_cross_entropy(tmp_path, monkeypatch):
    """Record every (x, y, loss) the training loop computes and redo the loss by hand from the corpus."""
    text = tmp_path / "unique_windows.txt"
    _write_random_text(text, 3000, "abcdefghijklmnopqrst", seed=1)  # 20^8 windows: each occurs once
    records = []
    real_forward = GPT.forward

    def recording_forward(self, idx, targets=None, cache=None):
        logits, loss = real_forward(self, idx, targets, cache)
        if self.training and targets is not None:
            records.append((idx.clone(), targets.clone(), logits.detach().clone(), loss.detach().clone()))
        return logits, loss

    monkeypatch.setattr(GPT, "forward", recording_forward)
    cfg = TrainConfig(dataset=str(text), cache_dir=str(tmp_path / "cache"), out_dir=str(tmp_path / "out"),
                      device="cpu", dtype="float32", n_layer=1, n_head=2, n_embd=16, block_size=8, dropout=0.0,
                      batch_size=4, max_iters=3, eval_interval=100, eval_iters=1, tensorboard=False, exact_val=False)
    train.train(cfg, verbose=False)
    corpus = load_corpus(str(text), tmp_path / "cache").train.astype(np.int64)
    assert len(records) == 3
    for x, y, logits, loss in records:
        offsets = C.find_offsets(corpus, x)
        next_tokens = torch.tensor(np.stack([corpus[i + 1:i + 1 + 8] for i in offsets]))
        assert torch.equal(y, next_tokens)
        by_hand = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), next_tokens.reshape(-1))
        torch.testing.assert_close(loss, by_hand, rtol=0, atol=1e-6)


# --- behaviour: on i.i.d. random tokens nothing is predictable -----------------------------------

ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEF"  # V = 32


@pytest.fixture(scope="module")
def random_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("random") / "random.txt"
    _write_random_text(path, 60_000, ALPHABET, seed=0)
    return path


def _train_on_random_tokens(path, tmp_path) -> dict:
    cfg = TrainConfig(dataset=str(path), cache_dir=str(tmp_path / "cache"), out_dir=str(tmp_path / "out"),
                      device="cpu", n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.0, batch_size=16,
                      max_iters=80, learning_rate=1e-2, min_lr=1e-3, warmup_iters=10, lr_decay_iters=80,
                      eval_interval=80, eval_iters=20, tensorboard=False, exact_val=True)
    return train.train(cfg, verbose=False)


@pytest.mark.parametrize(
    "bug, piece, replacement",
    [("none", None, None),
     ("targets equal inputs", "get_batch", batcher(0)),
     ("mask leaks one step", "causal_mask", mask_leaks_one_step)],
)
def test_random_tokens_stay_unpredictable_unless_labels_or_mask_leak(bug, piece, replacement, random_corpus,
                                                                     tmp_path, monkeypatch):
    ln_v = math.log(len(ALPHABET))
    if piece is not None:
        substitute(monkeypatch, piece, replacement)
    summary = _train_on_random_tokens(random_corpus, tmp_path)
    val = summary["last_val_estimate"]  # the val loss as training measures it (through get_batch)
    if bug == "none":
        assert val >= ln_v - 0.05, f"val {val:.3f} below ln(V) = {ln_v:.3f}: something leaks"
        assert summary["final_val_loss"] >= ln_v - 0.05
    else:
        assert val < ln_v - 1.0, f"{bug}: val {val:.3f} should fall far below ln(V) = {ln_v:.3f}"


CPU_CONFIGS = [p for p in sorted((ROOT / "configs").glob("*.toml")) if 'device = "cpu"' in p.read_text()]


@pytest.mark.parametrize("config", CPU_CONFIGS, ids=lambda p: p.name)
def test_an_edit_of_causal_mask_reaches_the_training_of_every_shipped_cpu_config(config, random_corpus, tmp_path,
                                                                                 monkeypatch):
    """Every recipe trains on the from-scratch attention (test_config.py), so a mask that admits one
    future key changes what a CPU recipe learns from its first steps (3 steps of each config's own model
    and optimizer, batch 2: the loss estimates differ; without the edit two runs agree to the bit)."""
    cfg, _ = parse_args([str(config), f"--dataset={random_corpus}", f"--cache_dir={tmp_path / 'cache'}",
                         "--device=cpu", "--compile=false", "--dtype=float32", "--batch_size=2", "--max_iters=3",
                         "--eval_interval=3", "--eval_iters=2", "--tensorboard=false", "--exact_val=false",
                         "--warmup_iters=1", "--lr_decay_iters=3"])

    def losses(name: str) -> list[float]:
        run = cfg.replace(out_dir=str(tmp_path / name))
        return [(h["train_loss"], h["val_loss"]) for h in train.train(run, verbose=False)["history"]]

    clean = losses("clean")
    assert losses("again") == clean  # the comparison below can only differ because of the edit
    substitute(monkeypatch, "causal_mask", mask_leaks_one_step)
    leaky = losses("leaky")
    assert all(a != b for a, b in zip(clean, leaky, strict=True)), \
        f"{config.name}: a one-step leak in causal_mask left the losses as they were (does training bypass it?)"
