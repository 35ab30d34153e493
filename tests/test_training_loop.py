"""The training loop's arithmetic: gradient accumulation, clipping, best_val_loss, tokens/s and which
steps are logged. Each of these can be wrong while the loss still goes down, so each is pinned by an
exact identity on a tiny in-process run (tests/tiny_runs.py: milliseconds per step)."""

from __future__ import annotations

import pytest
import torch
from tiny_runs import tiny_config

import train
from training import load_checkpoint
from training.monitor import RunLog
from training.optim import AdamW


def record_gradient_norms(monkeypatch) -> list[float]:
    """Every AdamW step from now on first appends the global norm of the gradients it is given."""
    norms: list[float] = []
    real_step = AdamW.step

    def step(self):
        grads = [p.grad.norm() for g in self.param_groups for p in g["params"] if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack(grads)).item())
        real_step(self)

    monkeypatch.setattr(AdamW, "step", step)
    return norms


def test_accumulated_micro_batches_give_the_gradient_of_the_whole_batch(tmp_path, monkeypatch):
    """Batch 4 x 2 accumulation steps and batch 8 x 1, on the same 8 rows, without clipping: the
    optimizer must see the same gradient (the mean over all 8 rows). Without loss / micro_steps
    it would see twice that, and grad_clip would in effect be halved."""
    norms = record_gradient_norms(monkeypatch)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(20, (8, 16), generator=g), torch.randint(20, (8, 16), generator=g)
    batches = iter([(x[:4], y[:4]), (x[4:], y[4:]), (x, y)])
    monkeypatch.setattr(train, "get_batch", lambda *args, **kwargs: next(batches))
    common = dict(max_iters=1, grad_clip=0.0, exact_val=False, eval_iters=1, tensorboard=False)
    train.train(tiny_config(tmp_path, out_dir=str(tmp_path / "accumulated"), batch_size=4,
                            gradient_accumulation_steps=2, **common), verbose=False)
    train.train(tiny_config(tmp_path, out_dir=str(tmp_path / "whole"), batch_size=8, **common), verbose=False)
    assert len(norms) == 2
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


def test_the_optimizer_sees_gradients_clipped_to_grad_clip(tmp_path, monkeypatch):
    """Clipping rescales a larger gradient to norm exactly grad_clip; this model's are far larger."""
    norms = record_gradient_norms(monkeypatch)
    train.train(tiny_config(tmp_path, max_iters=3, grad_clip=0.01, exact_val=False, tensorboard=False),
                verbose=False)
    assert len(norms) == 3
    assert norms == pytest.approx([0.01] * 3, rel=1e-4)


def test_best_val_loss_is_the_lowest_estimate_even_when_every_eval_saves(tmp_path, monkeypatch):
    estimates = iter([3.0, 2.0, 2.5])
    monkeypatch.setattr(train, "estimate_loss", lambda *args, **kwargs: {"train": 1.0, "val": next(estimates)})
    cfg = tiny_config(tmp_path, max_iters=2, eval_interval=1, always_save_checkpoint=True, exact_val=False,
                      tensorboard=False)
    summary = train.train(cfg, verbose=False)
    assert summary["best_val_loss"] == 2.0
    assert summary["last_val_estimate"] == 2.5
    assert load_checkpoint(tmp_path / "out" / "ckpt.pt")["best_val_loss"] == 2.0


def test_tokens_per_second_counts_every_micro_batch(tmp_path):
    """3 steps of 2 micro-batches of 4 x 16 tokens: 384 tokens in train_seconds."""
    cfg = tiny_config(tmp_path, max_iters=3, gradient_accumulation_steps=2, exact_val=False, tensorboard=False)
    summary = train.train(cfg, verbose=False)
    assert summary["tokens_per_second"] * summary["train_seconds"] == pytest.approx(3 * 2 * 4 * 16, rel=1e-9)


def test_a_resumed_run_measures_tokens_per_second_over_its_own_steps(tmp_path, monkeypatch):
    """After --resume at step 3, the first progress line covers the one step this process ran: its
    tokens/s times its ms/step is one step's tokens (4 x 16), not four steps' worth."""
    train.train(tiny_config(tmp_path, max_iters=3, always_save_checkpoint=True, exact_val=False,
                            tensorboard=False), verbose=False)
    lines = []
    monkeypatch.setattr(RunLog, "progress", lambda self, step, loss, lr, ms, tok_s: lines.append((step, ms, tok_s)))
    train.train(tiny_config(tmp_path, max_iters=6, resume=True, exact_val=False, tensorboard=False), verbose=False)
    step, ms, tok_s = lines[0]
    assert step == 3
    assert tok_s * ms / 1000 == pytest.approx(4 * 16, rel=1e-9)


def test_the_last_training_step_is_logged_whatever_the_interval(tmp_path, monkeypatch):
    logged = []
    real_scalars = RunLog.scalars

    def scalars(self, step, values):
        if "train/loss" in values:
            logged.append(step)
        real_scalars(self, step, values)

    monkeypatch.setattr(RunLog, "scalars", scalars)
    train.train(tiny_config(tmp_path, max_iters=5, log_interval=3, exact_val=False), verbose=False)
    assert logged == [0, 3, 4]


def scheduled_lr(step: int, lr: float, min_lr: float, warmup: int, decay: int, schedule: str = "cosine",
                 cooldown: float = 0.3) -> float:
    """The README's schedule, written out again: linear warmup from lr / (warmup + 1), then cosine (or
    wsd: flat, then a linear cooldown over the last cooldown fraction) down to min_lr at `decay`."""
    import math

    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step >= decay:
        return min_lr
    if schedule == "wsd":
        start = max(warmup, decay * (1 - cooldown))
        return lr if step < start else lr + (step - start) / max(1.0, decay - start) * (min_lr - lr)
    return min_lr + 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, decay - warmup))) * (lr - min_lr)


@pytest.mark.parametrize("fields", [
    dict(warmup_iters=4, lr_decay_iters=4),  # the warmup ends where the decay ends
    dict(warmup_iters=0, lr_decay_iters=6),  # no warmup
    dict(warmup_iters=2, lr_decay_iters=5),  # a flat tail at min_lr after the decay
    dict(warmup_iters=2, lr_decay_iters=8, lr_schedule="wsd", cooldown_frac=1.0),
    dict(warmup_iters=2, lr_decay_iters=8, lr_schedule="wsd", cooldown_frac=0.0),
    dict(warmup_iters=2, lr_decay_iters=8, optimizer="muon", muon_lr=0.05),
])
def test_the_loop_applies_the_documented_learning_rate_at_every_step(tmp_path, monkeypatch, fields):
    """The learning rate each param group holds when the optimizer steps, step by step (not lr_at's
    return value): every group follows the schedule, scaled from its own peak (Muon's muon_lr)."""
    applied: list[list[float]] = []
    real = train.configure_optimizer

    def configure(model, cfg):
        opt = real(model, cfg)
        real_step = opt.step
        opt.step = lambda *a, **k: applied.append([g["lr"] for g in opt.param_groups]) or real_step(*a, **k)
        return opt

    monkeypatch.setattr(train, "configure_optimizer", configure)
    cfg = tiny_config(tmp_path, max_iters=8, learning_rate=0.01, min_lr=0.001, exact_val=False, tensorboard=False,
                      eval_interval=100, **fields)
    train.train(cfg, verbose=False)
    assert len(applied) == cfg.max_iters
    for step, lrs in enumerate(applied):
        want = scheduled_lr(step, 0.01, 0.001, cfg.warmup_iters, cfg.lr_decay_iters, cfg.lr_schedule,
                            cfg.cooldown_frac)
        peaks = [cfg.muon_lr] + [cfg.learning_rate] * (len(lrs) - 1) if cfg.optimizer == "muon" else [0.01] * len(lrs)
        assert lrs == pytest.approx([want * peak / 0.01 for peak in peaks], rel=1e-12), f"step {step}"
