"""The optimizers (AdamW; Muon in muon.py) and the learning-rate schedule.

The optimizers are small classes of our own rather than torch.optim subclasses: the first use of a
torch.optim optimizer imports PyTorch's compiler stack (torch._dynamo), which costs about 1 s and
60 MB of resident memory on a CPU, a good part of a short run. AdamW runs PyTorch's own fused
kernel, the one torch.optim.AdamW(fused=True) calls, so the update is bit-identical to it
(tests/test_optim.py); where that kernel is missing (an older torch, an MPS device), an explicit
per-tensor loop does the same.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .config import TrainConfig
from .runtime import bf16_pays

# PyTorch's fused AdamW kernel exists for CUDA and (from torch 2.4) CPU tensors; elsewhere (MPS) the
# per-tensor loop below runs instead
FUSED_ADAMW = hasattr(torch, "_fused_adamw_")
FUSED_DEVICES = ("cpu", "cuda")


class ParamGroupOptimizer:
    """What every optimizer here shares: param groups, per-parameter state, zero_grad, and a
    state_dict in torch.optim's layout (parameters replaced by their index), so checkpoints hold
    plain tensors and numbers and load with weights_only=True."""

    def __init__(self, groups: list[dict], defaults: dict[str, Any]) -> None:
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[Tensor, dict[str, Any]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every parameter's gradient (set_to_none, the default and the cheaper) or zero it."""
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """{"state": {param index: {name: tensor or number}}, "param_groups": [... "params": [indices]]}."""
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [index.setdefault(id(p), len(index)) for p in g["params"]]})
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what state_dict returned, onto this optimizer's parameters (same groups, same order);
        raises ValueError when the group sizes differ."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("optimizer state does not match the model's parameters (group sizes differ)")
        params = [p for g in self.param_groups for p in g["params"]]
        for group, old in zip(self.param_groups, saved, strict=True):
            group.update({k: v for k, v in old.items() if k != "params"})
        # copies, never the saved tensors themselves: two optimizers must not share moments
        self.state = {params[int(i)]: {k: v.to(params[int(i)].device, copy=True) if isinstance(v, Tensor) else v
                                       for k, v in s.items()}
                      for i, s in state_dict["state"].items()}


class AdamW(ParamGroupOptimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW computes it."""

    def __init__(self, groups: list[dict], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, fused: bool | None = None) -> None:
        super().__init__(groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.fused = FUSED_ADAMW if fused is None else fused

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW update of every parameter that has a gradient, group by group."""
        for group in self.param_groups:
            adamw_update([p for p in group["params"] if p.grad is not None], group, self.state, self.fused)


def adamw_update(params: list[Tensor], group: dict, state: dict, fused: bool = FUSED_ADAMW) -> None:
    """One AdamW step for params (all on one device) with group's lr, betas, eps and weight_decay."""
    if not params:
        return
    for p in params:
        if p not in state:
            # float32 step on the parameter's device: the layout the fused kernel reads
            state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                        "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    steps = [state[p]["step"] for p in params]
    exp_avgs = [state[p]["exp_avg"] for p in params]
    exp_avg_sqs = [state[p]["exp_avg_sq"] for p in params]
    grads = [p.grad for p in params]
    (beta1, beta2), lr, eps, wd = group["betas"], group["lr"], group["eps"], group["weight_decay"]
    torch._foreach_add_(steps, 1)
    if fused and params[0].device.type in FUSED_DEVICES:
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
        return
    for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        t = t.item()
        p.mul_(1 - lr * wd)  # decoupled decay: shrink the weight, not the gradient
        m.lerp_(g, 1 - beta1)  # first moment: m = beta1 m + (1 - beta1) g
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)  # second moment
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)  # bias-corrected RMS of g
        p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))


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


def set_lr(optimizer: ParamGroupOptimizer, step: int, cfg: TrainConfig) -> float:
    """Apply the schedule to every param group (each scaled from its own base_lr); returns the
    AdamW learning rate of this step, the one that is logged."""
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * lr / cfg.learning_rate
    return lr


def configure_optimizer(model: nn.Module, cfg: TrainConfig) -> ParamGroupOptimizer:
    """AdamW with weight decay on 2-D weights (matmuls, embeddings) only, never on biases or norms;
    or, with optimizer = "muon", Muon for the 2-D matrices inside the blocks and AdamW for the rest.

    AdamW runs PyTorch's fused kernel (one kernel for all parameters of a group) on CPU and CUDA.
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
        # Newton-Schulz in bf16 where its matmuls are fast (a GPU, a CPU with AMX); on other CPUs bf16
        # matmuls are ~10x slower than float32 ones (benchmarks/RESULTS.md)
        device = hidden[0].device if hidden else torch.device("cpu")
        fast = bf16_pays(device, 4 * cfg.n_embd, cfg.n_embd, min_work=0)
        return Muon(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                    ns_dtype=torch.bfloat16 if fast else torch.float32)
    groups = [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    for g in groups:
        g["base_lr"] = cfg.learning_rate
    return AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))
