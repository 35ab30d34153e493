"""Optimizers: torch's AdamW, and Muon for the blocks' matrices."""

import torch
from torch import Tensor, nn

from .config import TrainConfig
from .runtime import bf16_pays


def orthogonalize(G: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """~U V^T of G = U S V^T (singular values ~[0.7, 1.2]) by quintic Newton-Schulz; G: (..., rows, cols)."""
    X = G.to(dtype).reshape(-1, *G.shape[-2:])  # (n, rows, cols): baddbmm takes 3-D
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # singular values <= 1 to converge
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT  # wide side: X @ X^T is the smaller Gram matrix
    for _ in range(5):  # X <- 3.4445 X + (-4.7750 A + 2.0315 A^2) X, A = X X^T, fused: launches bound it on a GPU
        A = X @ X.mT
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=-4.7750, alpha=2.0315), X, beta=3.4445)
    return (X.mT if tall else X).reshape(G.shape).to(G.dtype)


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, orthogonalised (Keller Jordan's Muon), for 2-D weights."""

    def __init__(self, params: list[Tensor], lr: float, momentum: float, ns_dtype: torch.dtype) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum))
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """One update of every parameter with a gradient: momentum, then its orthogonalised direction times lr."""
        for group in self.param_groups:
            lr, beta = group["lr"], group["momentum"]
            by_shape: dict[torch.Size, list[Tensor]] = {}  # same shapes: one batched product
            for p in group["params"]:
                if p.grad is not None:
                    by_shape.setdefault(p.shape, []).append(p)
            for (rows, cols), params in by_shape.items():  # foreach: a few launches, not a few per matrix
                for p in params:
                    if "momentum" not in self.state[p]:  # not setdefault: it would allocate zeros every step
                        self.state[p]["momentum"] = torch.zeros_like(p)
                grads, moms = [p.grad for p in params], [self.state[p]["momentum"] for p in params]
                torch._foreach_lerp_(moms, grads, 1 - beta)
                updates = orthogonalize(torch.stack(torch._foreach_lerp(grads, moms, beta)), self.ns_dtype)  # Nesterov
                torch._foreach_add_(params, updates.unbind(), alpha=-lr * max(1.0, rows / cols) ** 0.5)  # tall: smaller


def configure_optimizers(model: nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW (decay on 2-D weights only), and Muon for the blocks' matrices if chosen; lr = peak lr."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    device = named[0][1].device
    muon = [p for n, p in named if cfg.optimizer == "muon" and p.dim() == 2 and n.startswith("blocks.")]
    rest = [p for _, p in named if not any(p is q for q in muon)]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    optimizers = [torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                                    fused=device.type in ("cpu", "cuda"))]
    if muon:
        ns_dtype = torch.bfloat16 if bf16_pays(device, 4 * cfg.n_embd, cfg.n_embd, min_work=0)[0] else torch.float32
        optimizers.insert(0, Muon(muon, lr=cfg.muon_lr, momentum=cfg.muon_momentum, ns_dtype=ns_dtype))
    return optimizers
