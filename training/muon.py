"""Muon: momentum whose update is orthogonalised, for the 2-D weight matrices inside the blocks.

Adam scales each coordinate by its own history; Muon instead replaces the momentum matrix M by the
nearest semi-orthogonal matrix (U V^T of M = U S V^T), so every direction the matrix can move in
moves by the same amount. For the hidden matrices of small transformers this trains in markedly
fewer steps (Keller Jordan's modded-nanogpt speedruns). Embeddings, the LM head and the norm gains
are not hidden matrices; they keep AdamW, in the same optimizer object so that train.py, the
checkpoint and --resume see one optimizer.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Coefficients of the quintic Newton-Schulz step, chosen (Jordan, 2024) to push every singular
# value of a normalised matrix quickly into a band around 1, rather than exactly to 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(G: Tensor, steps: int = 5) -> Tensor:
    """Approximate U V^T for G = U S V^T with a few Newton-Schulz iterations (no SVD).

    Args:
        G: (rows, cols) matrix.
        steps: iterations; 5 is enough for training.
    Returns:
        (rows, cols), singular values roughly in [0.7, 1.2].
    """
    a, b, c = NS_COEFFS
    X = G / (G.norm() + 1e-7)  # singular values now <= 1, where the iteration converges
    tall = X.size(0) > X.size(1)
    if tall:
        X = X.T  # iterate on the wide side: X @ X.T is then the smaller Gram matrix
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


class Muon(torch.optim.Optimizer):
    """Muon for param groups with use_muon=True, AdamW for the others.

    Muon groups: lr, momentum, weight_decay. AdamW groups: lr, betas, eps, weight_decay.
    Every group may carry base_lr, the lr the schedule multiplies (train.py sets lr from it).
    """

    def __init__(self, groups: list[dict], lr: float = 0.02, momentum: float = 0.95,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        for g in groups:
            if g.get("use_muon") and any(p.dim() != 2 for p in g["params"]):
                raise ValueError("Muon groups take 2-D weight matrices only")
        super().__init__(groups, dict(lr=lr, momentum=momentum, betas=betas, eps=eps,
                                      weight_decay=weight_decay, use_muon=False))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["use_muon"]:
                    if not state:
                        state["momentum"] = torch.zeros_like(p)
                    m = state["momentum"]
                    m.lerp_(p.grad, 1 - group["momentum"])  # m = beta m + (1 - beta) g
                    g = p.grad.lerp(m, group["momentum"])  # Nesterov: look one momentum step ahead
                    update = orthogonalize(g.float()).to(p.dtype)
                    # a tall matrix's orthogonalised update has smaller entries; rescale to match
                    scale = max(1.0, p.size(0) / p.size(1)) ** 0.5
                    p.mul_(1 - lr * wd)
                    p.add_(update, alpha=-lr * scale)
                else:
                    if not state:
                        state["step"] = 0  # a Python int: reading a tensor step would sync a GPU
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    state["step"] += 1
                    t = state["step"]
                    b1, b2 = group["betas"]
                    state["exp_avg"].lerp_(p.grad, 1 - b1)
                    state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    denom = (state["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                    p.mul_(1 - lr * wd)
                    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1 ** t))
        return None
