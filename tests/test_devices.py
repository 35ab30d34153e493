"""The same causality and backend-equivalence checks on every device this machine has.

On a CPU-only machine (CI) they run on the CPU; on a machine with CUDA they also run on the GPU
(benchmarks/gpu_check.sh runs this file there), where the fused attention kernels differ.
"""

from __future__ import annotations

import pytest
import torch

import causality as C
from model import GPT, GPTConfig

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["manual", "sdpa"])
def test_causality_checks_pass_on_device(device, backend):
    model = C.leak_test_model(backend).to(device)
    x = C.random_tokens(4, model.config.block_size, model.config.vocab_size).to(device)
    failed = [str(c) for c in C.model_checks(model, x) if not c.ok]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_manual_and_sdpa_give_the_same_logits_on_device(device, dtype, tol):
    torch.manual_seed(0)
    cfg = dict(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64)
    manual = GPT(GPTConfig(**cfg, attn_backend="manual")).to(device).eval()
    fused = GPT(GPTConfig(**cfg, attn_backend="sdpa")).to(device).eval()
    fused.load_state_dict(manual.state_dict())
    x = torch.randint(65, (4, 64), device=device)
    with torch.no_grad(), torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
        a, _ = manual(x)
        b, _ = fused(x)
    err = (a.float() - b.float()).abs().max().item()
    assert err < tol, f"manual vs sdpa differ by {err} on {device} in {dtype}"


@pytest.mark.parametrize("has_amx, work, expected", [
    (True, 12 * 64 * 128, torch.bfloat16),  # the laptop recipe: 1.31x faster in bf16 there
    (True, 2 ** 16, torch.bfloat16),
    (True, 2 ** 16 - 1, torch.float32),  # small matmuls: the casts cost more than AMX saves
    (True, 8 * 32 * 32, torch.float32),  # configs/debug.toml: 0.70x in bf16
    (True, None, torch.bfloat16),  # size unknown: counted as large enough
    (False, 12 * 64 * 128, torch.float32),  # no AMX: bf16 is no faster on any size
])
def test_auto_dtype_on_a_cpu_is_bfloat16_only_with_amx_and_large_enough_matmuls(monkeypatch, has_amx, work,
                                                                                 expected):
    from training import resolve_dtype

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: has_amx, raising=False)
    assert resolve_dtype("auto", torch.device("cpu"), work) == expected
    assert resolve_dtype("float32", torch.device("cpu"), work) == torch.float32  # an explicit choice stands
    assert resolve_dtype("bfloat16", torch.device("cpu"), 1) == torch.bfloat16
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert resolve_dtype("auto", torch.device("cpu"), work) == torch.float32  # a torch without the probe


@pytest.mark.parametrize("is_causal", [True, False])
def test_cpu_bfloat16_attention_is_float32_attention_rounded(is_causal):
    """On a CPU, fused_attention computes bfloat16 inputs in float32 (the bf16 CPU kernel's backward
    is ~9x slower): the output and the gradients must be float32 sdpa's, rounded to bfloat16, also
    under autocast (which would otherwise cast the float32 inputs straight back)."""
    import torch.nn.functional as F

    from model.attention import fused_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8).bfloat16().requires_grad_() for _ in range(3))
    allowed = None if is_causal else torch.rand(16, 16) > 0.3
    if allowed is not None:
        allowed[:, 0] = True
    kwargs = {"is_causal": True} if is_causal else {"attn_mask": allowed}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_attention(q, k, v, **kwargs)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, **kwargs)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.bfloat16())
    g = torch.randn_like(ref)
    out.backward(g.bfloat16())
    ref.backward(g.bfloat16().float())
    for t, r in zip((q, k, v), ref_in, strict=True):
        assert t.grad.dtype == torch.bfloat16
        assert torch.equal(t.grad, r.grad.bfloat16())


@pytest.mark.parametrize("backend", ["manual", "sdpa"])
def test_cpu_bfloat16_training_follows_float32_training(tmp_path, backend):
    """What dtype=auto picks on an AMX CPU must learn what float32 learns: the same 80 steps, same
    seed, end within 0.05 of each other in exact val loss (measured: 0.008), both far below where
    they started (3.47 -> 1.72). The attention numbers themselves are checked exactly above."""
    from tiny_runs import tiny_config

    import train

    finals = {}
    for dtype in ("float32", "bfloat16"):
        cfg = tiny_config(tmp_path, out_dir=str(tmp_path / dtype), dtype=dtype, attn_backend=backend, max_iters=80,
                          lr_decay_iters=80, eval_interval=80, tensorboard=False)
        summary = train.train(cfg, verbose=False)
        assert summary["dtype"] == dtype
        finals[dtype] = (summary["history"][0]["val_loss"], summary["final_val_loss"])
    (start32, end32), (start16, end16) = finals["float32"], finals["bfloat16"]
    assert end32 < start32 - 1.5 and end16 < start16 - 1.5, finals
    assert abs(end16 - end32) < 0.05, finals
