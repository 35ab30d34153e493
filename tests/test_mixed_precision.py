"""Under bf16 and fp16 autocast (on the CPU here; gpu_check.sh runs this file on CUDA too) the loss, the
loss estimates, the exact val loss and clipping with the GradScaler agree with a float64 / float32
reference within stated tolerances, and each tolerance is tight enough to see a dropped cast."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_runs import tiny_config

import train
from model import GPT, GPTConfig
from training import estimate_loss, exact_loss

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Measured differences from float64 on this model (3 seeds): bf16 <= 3.2e-5, fp16 <= 1e-5. A loss taken
# from half-precision logits (the float32 cast dropped) misses by 3e-2 and 5e-3 (the control below).
TOL = {torch.bfloat16: 5e-4, torch.float16: 1e-4}
V, T, N = 65, 32, 64  # N windows of T tokens


@pytest.fixture(scope="module")
def model_and_data():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=64)).eval()
    return model, torch.from_numpy(np.random.default_rng(0).integers(0, V, N * T + 1))


def autocast(device: str, dtype: torch.dtype):
    return torch.autocast(device_type=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_losses_under_autocast_match_float64(model_and_data, device, dtype):
    """The training loss of one batch, the seeded estimates of both splits and the exact val loss."""
    model, data = model_and_data
    data = data.to(device)
    x, y = data[:-1].view(N, T)[:8], data[1:].view(N, T)[:8]
    splits = {"train": data, "val": data.flip(0)}
    model.to(device).double()
    with torch.no_grad():
        loss_ref = model(x, y)[1].item()
    est_ref = estimate_loss(model, splits, 8, T, 4, 0, device)
    exact_ref = exact_loss(model, data, T, N, device)
    model.float()
    with torch.no_grad(), autocast(device, dtype):
        _, loss = model(x, y)
    est = estimate_loss(model, splits, 8, T, 4, 0, device, autocast(device, dtype))
    exact = exact_loss(model, data, T, N, device, autocast(device, dtype))
    model.cpu()
    assert loss.dtype == torch.float32, "the loss must come out of autocast in float32"
    for name, got, want in [("training loss", loss.item(), loss_ref), ("exact val loss", exact, exact_ref),
                            *((f"{k} estimate", est[k], est_ref[k]) for k in splits)]:
        assert abs(got - want) < TOL[dtype], f"{dtype} {name} {got:.6f} vs float64 {want:.6f}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_tolerance_sees_a_loss_taken_from_half_precision_logits(model_and_data, dtype):
    """Positive control: the exact loss's sum over one forward of N windows, taken on the half-precision
    logits themselves (the cast to float32 dropped), misses the float64 loss by far more than TOL."""
    model, data = model_and_data
    x, y = data[:-1].view(N, T), data[1:].view(N, T)
    with torch.no_grad():
        ref = F.cross_entropy(model.double()(x)[0].reshape(-1, V), y.reshape(-1)).item()
        with autocast("cpu", dtype):
            logits, _ = model.float()(x)
    wrong = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="sum").item() / y.numel()
    assert logits.dtype == dtype and abs(wrong - ref) > 10 * TOL[dtype]


def record_gradient_norms(monkeypatch) -> list[float]:
    """The global norm of the gradients each optimizer step is given, in order."""
    norms: list[float] = []
    real = train.configure_optimizer

    def configure(model, cfg):
        opt = real(model, cfg)
        real_step = opt.step

        def step(*args, **kwargs):
            grads = [p.grad.float().norm() for g in opt.param_groups for p in g["params"] if p.grad is not None]
            norms.append(torch.linalg.vector_norm(torch.stack(grads)).item())
            return real_step(*args, **kwargs)

        opt.step = step
        return opt

    monkeypatch.setattr(train, "configure_optimizer", configure)
    return norms


@pytest.mark.parametrize("grad_clip", [0.0, 0.05])
def test_float16_training_unscales_the_gradients_before_clipping_and_stepping(tmp_path, monkeypatch, grad_clip):
    """float16 turns the GradScaler on: the optimizer must see the true gradients, unscaled before the
    clip, so their norms are float32's (within 2 %) without clipping, and exactly grad_clip with it. A
    clip before the unscale would hand the optimizer grad_clip / scale (~1e-6)."""
    norms = record_gradient_norms(monkeypatch)
    common = dict(max_iters=4, grad_clip=grad_clip, exact_val=False, tensorboard=False, eval_interval=100)
    for dtype in ("float32", "float16"):
        train.train(tiny_config(tmp_path, out_dir=str(tmp_path / dtype), dtype=dtype, **common), verbose=False)
    fp32, fp16 = norms[:4], norms[4:]
    assert len(fp16) == 4, "the scaler skipped steps (an overflow at its initial scale?)"
    if grad_clip:
        assert fp16 == pytest.approx([grad_clip] * 4, rel=1e-3)
    else:
        assert fp16 == pytest.approx(fp32, rel=2e-2)
