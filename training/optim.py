"""The optimizer and its learning-rate schedule."""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from .config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, decay, then flat at min_lr.

    Warmup starts at learning_rate / (warmup_iters + 1) rather than 0 so step 0 still learns
    (as nanoGPT does). "cosine" decays from the end of warmup to lr_decay_iters; "wsd" holds the
    peak and decays linearly over the last cooldown_frac of lr_decay_iters (warmup-stable-decay).
    """
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    if cfg.lr_schedule == "wsd":
        start = max(cfg.warmup_iters, cfg.lr_decay_iters * (1 - cfg.cooldown_frac))
        if step < start:
            return cfg.learning_rate
        progress = (step - start) / max(1.0, cfg.lr_decay_iters - start)
        return cfg.learning_rate + progress * (cfg.min_lr - cfg.learning_rate)
    progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress))  # 1 -> 0
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> float:
    """Apply the schedule to every param group (each scaled from its own base_lr); returns the
    AdamW learning rate of this step, the one that is logged."""
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * lr / cfg.learning_rate
    return lr


def configure_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str) -> torch.optim.Optimizer:
    """AdamW with weight decay on 2-D weights (matmuls, embeddings) only, never on biases or norms;
    or, with optimizer = "muon", Muon for the 2-D matrices inside the blocks and AdamW for the rest.

    The fused AdamW (one kernel for all parameters) is used where this PyTorch has it for the
    device; it computes the same update as the loop implementation.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.optimizer == "muon":
        from .muon import Muon

        hidden = [p for n, p in named if p.dim() == 2 and n.startswith("blocks.")]
        groups = [
            {"params": hidden, "use_muon": True, "lr": cfg.muon_lr, "base_lr": cfg.muon_lr,
             "momentum": cfg.muon_momentum, "weight_decay": 0.0},
            {"params": [p for n, p in named if p.dim() >= 2 and not n.startswith("blocks.")],
             "base_lr": cfg.learning_rate, "weight_decay": cfg.weight_decay},
            {"params": [p for _, p in named if p.dim() < 2], "base_lr": cfg.learning_rate, "weight_decay": 0.0},
        ]
        return Muon(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))
    groups = [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    for g in groups:
        g["base_lr"] = cfg.learning_rate
    fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                             **({"fused": True} if fused else {}))
