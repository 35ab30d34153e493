"""Our optimizers: AdamW equals torch.optim.AdamW update for update; state round-trips; Muon learns."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from model import GPT, GPTConfig
from training import TrainConfig, configure_optimizer, lr_at, set_lr
from training.muon import Muon, orthogonalize
from training.optim import AdamW


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=True))


def _train(model, opt, steps: int = 5) -> list[float]:
    losses = []
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(17, (4, 8), generator=g)
        _, loss = model(x, x)  # learnable: name the current token
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _groups(model):
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_matches_torch_adamw(fused):
    ours, ref = _model(), _model()
    opt = AdamW(_groups(ours), lr=3e-3, betas=(0.9, 0.99), fused=fused)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=3e-3, betas=(0.9, 0.99), fused=fused)
    assert _train(ours, opt) == _train(ref, ref_opt)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        if fused:
            assert torch.equal(a, b)  # the same kernel
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # the same math, another order of ops


def test_optimizer_state_round_trips_through_state_dict():
    model = _model()
    opt = configure_optimizer(model, TrainConfig(learning_rate=1e-3))
    _train(model, opt, 3)
    copy = _model()
    copy.load_state_dict(model.state_dict())
    opt2 = configure_optimizer(copy, TrainConfig(learning_rate=1e-3))
    opt2.load_state_dict(opt.state_dict())
    _train(model, opt, 2)
    _train(copy, opt2, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), copy.parameters(), strict=True))


def test_muon_orthogonalizes_and_trains():
    g = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(orthogonalize(g))
    assert s.min() > 0.5 and s.max() < 1.3  # every direction moves by about the same amount
    assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 2  # and the input was not already
    model = _model()
    opt = configure_optimizer(model, TrainConfig(optimizer="muon", learning_rate=3e-3))
    losses = _train(model, opt, 30)
    assert losses[-1] < losses[0] - 0.3


def test_training_never_imports_the_compiler_stack():
    """torch.optim's first use imports torch._dynamo (about 1 s, 60 MB): our optimizers avoid it."""
    code = ("import sys, torch; sys.path.insert(0, '.');"
            "from tests.test_optim import _model, _train; from training import TrainConfig, configure_optimizer;"
            "m = _model(); _train(m, configure_optimizer(m, TrainConfig()), 2);"
            "m = _model(); _train(m, configure_optimizer(m, TrainConfig(optimizer='muon')), 2);"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_grad_scaler_drives_our_optimizers_in_float16():
    """--dtype=float16 runs through torch.amp.GradScaler, which expects torch.optim's interface."""
    for name in ("adamw", "muon"):
        model = _model()
        opt = configure_optimizer(model, TrainConfig(optimizer=name, learning_rate=3e-3))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        before = [p.detach().clone() for p in model.parameters()]
        x = torch.randint(17, (4, 8), generator=torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=torch.float16):
            _, loss = model(x, x)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_adamw_decays_exactly_the_2d_weights_and_holds_each_parameter_once():
    """A parameter in two groups would be updated twice per step; a decayed bias or norm weight is
    pulled to 0. Neither changes a loss enough for a training test to notice."""
    model = _model()
    opt = configure_optimizer(model, TrainConfig(weight_decay=0.1))
    held = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(held) == sorted(id(p) for p in model.parameters())
    for g in opt.param_groups:
        dims = {p.dim() for p in g["params"]}
        assert dims in ({2}, {1})
        assert g["weight_decay"] == (0.1 if dims == {2} else 0.0)


def test_muon_takes_the_block_matrices_and_set_lr_scales_each_group_from_its_base_lr():
    model = _model()
    cfg = TrainConfig(optimizer="muon", learning_rate=1e-3, min_lr=1e-4, muon_lr=0.02, weight_decay=0.1,
                      warmup_iters=10, lr_decay_iters=100)
    opt = configure_optimizer(model, cfg)
    muon, *adamw = opt.param_groups
    assert muon["use_muon"] and muon["weight_decay"] == 0.0
    assert {id(p) for p in muon["params"]} == {id(p) for n, p in model.named_parameters()
                                                if p.dim() == 2 and n.startswith("blocks.")}
    held = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(held) == sorted(id(p) for p in model.parameters())
    lr = set_lr(opt, 50, cfg)  # mid-decay: each group at its own base_lr times the schedule's factor
    assert lr == lr_at(50, cfg)
    assert muon["lr"] == pytest.approx(0.02 * lr / 1e-3)
    assert all(g["lr"] == pytest.approx(lr) for g in adamw)


def test_muon_step_is_orthogonalised_nesterov_momentum_scaled_up_for_tall_matrices():
    """Three steps on a tall and a wide matrix against the rule written out: m = beta m + (1 - beta) g,
    u = (1 - beta) g + beta m, change = -lr sqrt(max(1, rows / cols)) orthogonalize(u). One step
    would not do: with m = 0 the momentum only rescales g, which orthogonalize cancels. The tolerance
    is for orthogonalize's bfloat16 arithmetic on inputs rounded differently."""
    g = torch.Generator().manual_seed(0)
    tall = torch.nn.Parameter(torch.randn(48, 16, generator=g))
    wide = torch.nn.Parameter(torch.randn(16, 48, generator=g))
    lr, beta = 0.1, 0.9
    opt = Muon([{"params": [tall, wide], "use_muon": True, "lr": lr, "momentum": beta, "weight_decay": 0.0}])
    momentum = {p: torch.zeros_like(p) for p in (tall, wide)}
    for _ in range(3):
        before = {p: p.detach().clone() for p in (tall, wide)}
        for p in (tall, wide):
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        for p in (tall, wide):
            momentum[p] = beta * momentum[p] + (1 - beta) * p.grad
            update = (1 - beta) * p.grad + beta * momentum[p]
            scale = math.sqrt(max(1, p.size(0) / p.size(1)))
            expected = -lr * scale * orthogonalize(update[None])[0]
            torch.testing.assert_close(p.detach() - before[p], expected, atol=0.03 * lr * scale, rtol=0)
