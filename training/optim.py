"""The optimizers (torch's AdamW; Muon for the blocks' matrices) and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .config import TrainConfig
from .runtime import bf16_pays

# Coefficients of the quintic Newton-Schulz step (Jordan, 2024): they push every singular value of a
# normalised matrix quickly into a band around 1, rather than exactly to 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(G: Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximately U V^T for G = U S V^T, G (rows, cols) or a stack (n, rows, cols), by Newton-Schulz.

    The singular values need only land near 1 (roughly [0.7, 1.2]), so bfloat16 is precise enough.
    Returns G's shape and dtype.
    """
    a, b, c = NS_COEFFS
    X = G.to(dtype)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # singular values <= 1: it converges
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT  # iterate on the wide side: X @ X^T is then the smaller Gram matrix
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return (X.mT if tall else X).to(G.dtype)


class Muon(torch.optim.Optimizer):
    """Momentum whose update is orthogonalised (Keller Jordan's Muon), for 2-D weight matrices.

    Adam scales each coordinate by its own history; Muon replaces the (Nesterov) momentum M by the
    nearest semi-orthogonal matrix, so every direction the matrix can move in moves by the same amount.
    """

    def __init__(self, params: list[Tensor], lr: float = 0.02, momentum: float = 0.95,
                 weight_decay: float = 0.0, ns_dtype: torch.dtype = torch.bfloat16) -> None:
        if any(p.dim() != 2 for p in params):
            raise ValueError("Muon takes 2-D weight matrices only")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """One update of every parameter that has a gradient."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            updates = []
            for p in params:
                m = self.state[p].setdefault("momentum", torch.zeros_like(p))
                m.lerp_(p.grad, 1 - group["momentum"])
                updates.append(p.grad.lerp(m, group["momentum"]))  # Nesterov: one momentum step ahead
            by_shape: dict[tuple[int, ...], list[int]] = {}  # same-shape matrices as one batched product
            for i, u in enumerate(updates):
                by_shape.setdefault(tuple(u.shape), []).append(i)
            for indices in by_shape.values():
                ortho = orthogonalize(torch.stack([updates[i] for i in indices]), dtype=self.ns_dtype)
                for i, o in zip(indices, ortho, strict=True):
                    updates[i] = o
            for p, u in zip(params, updates, strict=True):
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(u, alpha=-group["lr"] * max(1.0, p.size(0) / p.size(1)) ** 0.5)  # tall: smaller entries


def configure_optimizers(model: nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW with weight decay on 2-D weights only (never biases or norms); with optimizer = "muon", the
    2-D matrices inside the blocks go to Muon instead. Every group records its peak lr as base_lr."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    device = named[0][1].device
    muon = [p for n, p in named if cfg.optimizer == "muon" and p.dim() == 2 and n.startswith("blocks.")]
    rest = [(n, p) for n, p in named if not any(p is q for q in muon)]
    groups = [{"params": [p for _, p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW([{**g, "base_lr": cfg.learning_rate} for g in groups], lr=cfg.learning_rate,
                              betas=(cfg.beta1, cfg.beta2), fused=device.type in ("cpu", "cuda"))
    if not muon:
        return [adamw]
    # Newton-Schulz in bf16 only where its matmuls are fast: on an AVX2-only CPU bf16 made the fast
    # recipe's optimizer step 98 ms instead of 8.6 (benchmarks/RESULTS.md)
    fast = bf16_pays(device, 4 * cfg.n_embd, cfg.n_embd, min_work=0)
    opt = Muon(muon, lr=cfg.muon_lr, momentum=cfg.muon_momentum, ns_dtype=torch.bfloat16 if fast else torch.float32)
    opt.param_groups[0]["base_lr"] = cfg.muon_lr
    return [opt, adamw]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warmup from learning_rate /
    (warmup_iters + 1) (so step 0 learns, as in nanoGPT), then cosine to min_lr at lr_decay_iters, or
    wsd: the peak held until the last cooldown_frac of lr_decay_iters, then linear to min_lr; flat after."""
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
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def set_lr(optimizers: list[torch.optim.Optimizer], step: int, cfg: TrainConfig) -> float:
    """Apply the schedule to every group, scaled from its base_lr; returns AdamW's lr (the logged one)."""
    lr = lr_at(step, cfg)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * lr / cfg.learning_rate
    return lr
