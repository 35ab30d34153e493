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
