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

from .optim import ParamGroupOptimizer, adamw_update

# Coefficients of the quintic Newton-Schulz step, chosen (Jordan, 2024) to push every singular
# value of a normalised matrix quickly into a band around 1, rather than exactly to 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(G: Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximate U V^T for G = U S V^T with a few Newton-Schulz iterations (no SVD).

    The iteration only has to land the singular values near 1, so bfloat16 is precise enough (Muon's
    reference runs it so); Muon picks it where bf16 matmuls are fast.

    Args:
        G: (rows, cols) or a stack (n, rows, cols) of same-shape matrices, orthogonalised each.
        steps: iterations; 5 is enough for training.
        dtype: precision of the iteration.
    Returns:
        G's shape and dtype, singular values roughly in [0.7, 1.2].
    """
    a, b, c = NS_COEFFS
    X = G.to(dtype)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # singular values now <= 1: it converges
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT  # iterate on the wide side: X @ X^T is then the smaller Gram matrix
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return (X.mT if tall else X).to(G.dtype)


class Muon(ParamGroupOptimizer):
    """Muon for param groups with use_muon=True, AdamW for the others.

    Muon groups: lr, momentum, weight_decay. AdamW groups: lr, betas, eps, weight_decay.
    Every group needs base_lr, the lr the schedule multiplies (training.optim.set_lr sets lr from it).
    """

    def __init__(self, groups: list[dict], lr: float = 0.02, momentum: float = 0.95,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 ns_dtype: torch.dtype = torch.bfloat16) -> None:
        for g in groups:
            if g.get("use_muon") and any(p.dim() != 2 for p in g["params"]):
                raise ValueError("Muon groups take 2-D weight matrices only")
        super().__init__(groups, dict(lr=lr, momentum=momentum, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, use_muon=False))
        self.ns_dtype = ns_dtype  # the Newton-Schulz iteration's precision

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter with a gradient: Muon in use_muon groups, AdamW elsewhere."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not group["use_muon"]:
                adamw_update(params, group, self.state)
                continue
            lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
            updates = []
            for p in params:
                if p not in self.state:
                    self.state[p] = {"momentum": torch.zeros_like(p)}
                m = self.state[p]["momentum"]
                m.lerp_(p.grad, 1 - beta)  # m = beta m + (1 - beta) g
                updates.append(p.grad.lerp(m, beta))  # Nesterov: look one momentum step ahead
            # orthogonalise same-shape matrices as one batch: a few large matmuls, not many small ones
            by_shape: dict[tuple[int, ...], list[int]] = {}
            for i, u in enumerate(updates):
                by_shape.setdefault(tuple(u.shape), []).append(i)
            for indices in by_shape.values():
                ortho = orthogonalize(torch.stack([updates[i] for i in indices]), dtype=self.ns_dtype)
                for i, o in zip(indices, ortho, strict=True):
                    updates[i] = o
            for p, update in zip(params, updates, strict=True):
                # a tall matrix's orthogonalised update has smaller entries; rescale to match
                scale = max(1.0, p.size(0) / p.size(1)) ** 0.5
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr * scale)
