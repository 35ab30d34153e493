"""The same causality and backend-equivalence checks on every device this machine has.

On a CPU-only machine (CI) they run on the CPU; on a machine with CUDA they also run on the GPU
(benchmarks/gpu_check.sh runs this file there), where the fused attention kernels differ.
"""

from __future__ import annotations

import sys

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
    C.require(*C.model_checks(model, x))


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


@pytest.mark.parametrize("speedup, matmul, expected", [
    (3.0, (12 * 64, 128), torch.bfloat16),  # the laptop recipe on an AMX CPU: 1.31x faster per step there
    (3.0, (2 ** 10, 2 ** 6), torch.bfloat16),
    (3.0, (2 ** 10, 2 ** 6 - 1), torch.float32),  # small matmuls: the casts cost more than bf16 saves
    (3.0, (8 * 32, 32), torch.float32),  # configs/debug.toml: 0.70x in bf16 on an AMX CPU
    (1.6, (12 * 64, 128), torch.bfloat16),
    (1.4, (12 * 64, 128), torch.float32),  # not enough to pay for the casts and the float32 softmax
    (0.09, (12 * 64, 128), torch.float32),  # no native bf16 (an AVX2 CPU): its matmuls ~10x slower
    (3.0, None, torch.float32),  # size unknown
])
def test_auto_dtype_on_a_cpu_is_bfloat16_only_where_its_matmuls_are_fast_and_large(monkeypatch, speedup, matmul,
                                                                                    expected):
    import training.runtime
    from training import resolve_dtype

    monkeypatch.setattr(training.runtime, "cpu_bf16_speedup", lambda rows, width: speedup)
    assert resolve_dtype("auto", torch.device("cpu"), matmul) == expected
    assert resolve_dtype("float32", torch.device("cpu"), matmul) == torch.float32  # an explicit choice stands
    assert resolve_dtype("bfloat16", torch.device("cpu"), (1, 1)) == torch.bfloat16


def test_the_bf16_speed_probe_times_real_matmuls():
    """cpu_bf16_speedup is a measurement, not a table: a positive ratio that differs between shapes. It
    draws its matrices from a generator of its own: a run must not draw other dropout masks or batches
    depending on whether the probe ran in this process before."""
    from training.runtime import cpu_bf16_speedup

    cpu_bf16_speedup.cache_clear()
    state = torch.get_rng_state()
    ratios = {cpu_bf16_speedup(rows, width) for rows, width in ((64, 32), (256, 64))}
    assert all(r > 0 for r in ratios) and len(ratios) == 2
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("causal", [True, False])
def test_cpu_bfloat16_attention_is_float32_attention_rounded(causal):
    """On a CPU, fused_attention computes bfloat16 inputs in float32 (the bf16 CPU kernel's backward
    is ~9x slower): the output and the gradients must be float32 sdpa's, rounded to bfloat16, also
    under autocast (which would otherwise cast the float32 inputs straight back)."""
    import torch.nn.functional as F

    from model.attention import additive_mask, causal_mask, fused_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8).bfloat16().requires_grad_() for _ in range(3))
    allowed = causal_mask(16, 16) if causal else torch.rand(16, 16) > 0.3
    allowed[:, 0] = True
    mask = additive_mask(allowed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_attention(q, k, v, mask, 0.0)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask)
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


# Every way Python code can pull a tensor's value onto the host. On a GPU each one waits for the
# device to finish all queued work (a synchronisation), so the loop may use them on log and eval
# steps only. On a CPU nothing waits, but the same calls show where a GPU would.
HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


# On a CPU, additive_mask reads its (CPU) mask on the host by design, once per forward: it checks that
# every query row keeps a key, free there; with a GPU mask that check is skipped (tested below).
HOST_READ_CASES = [("cpu", "sdpa"), ("cpu", "manual")] + ([("cuda", "sdpa"), ("cuda", "manual")]
                                                          if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device, backend", HOST_READ_CASES)
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_training_steps_between_log_steps_never_read_a_tensor_on_the_host(tmp_path, monkeypatch, device,
                                                                         backend, optimizer):
    """Issue 4's "no synchronisation per step; .item() only at log steps", checked step by step.

    12 steps, logged every 4th, evaluated at 0 and 12, with clipping and 2 micro-batches: steps 1-3,
    5-7 and 9-10 must not read a tensor on the host (each host read is recorded with the step it
    happened in), while log steps must (so the recording is known to work). On CUDA the same steps
    also run under torch.cuda.set_sync_debug_mode("error"), which raises on any synchronising call,
    including those inside PyTorch that the recording cannot see.
    """
    from tiny_runs import tiny_config

    import train

    current = {"step": None}
    reads: dict[int, list[str]] = {}
    log_steps = {0, 4, 8, 11, 12}  # eval at 0 and 12 (the last), log every 4 and at max_iters - 1
    real_set_lr = train.set_lr

    def set_lr(optimizer, step, cfg):  # called first thing in every step of the loop
        current["step"] = step
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default" if step in log_steps else "error")
        return real_set_lr(optimizer, step, cfg)

    def recording(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            by_mask_check = sys._getframe(1).f_code.co_name == "additive_mask" and self.device.type == "cpu"
            if current["step"] is not None and not by_mask_check:
                reads.setdefault(current["step"], []).append(name)
            return real(self, *args, **kwargs)
        return read

    monkeypatch.setattr(train, "set_lr", set_lr)
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, recording(name))
    cfg = tiny_config(tmp_path, device=device, attn_backend=backend, optimizer=optimizer, max_iters=12, log_interval=4,
                      eval_interval=100, gradient_accumulation_steps=2, grad_clip=1.0, tensorboard=False,
                      exact_val=False)
    try:
        train.train(cfg, verbose=False)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    quiet = {step: names for step, names in reads.items() if step not in log_steps}
    assert not quiet, f"host reads on steps that are not log steps: {quiet}"
    assert {4, 8, 11} <= reads.keys(), f"the log steps read nothing: the recording is broken ({reads})"


def test_the_mask_check_reads_only_masks_on_the_cpu():
    """attention() refuses a CPU mask with an empty query row, but does not read a mask held on another
    device (a host read there waits for the device; on a GPU that was once per layer of every forward).
    The meta device stands in for a GPU: any host read of a meta tensor raises."""
    from model.attention import attention

    q = k = v = torch.zeros(1, 1, 2, 4)
    empty_row = torch.tensor([[True, False], [False, False]])
    with pytest.raises(ValueError, match="may read no key"):
        attention(q, k, v, empty_row)
    out, weights = attention(q.to("meta"), k.to("meta"), v.to("meta"), empty_row.to("meta"))
    assert out.device.type == "meta" and out.shape == (1, 1, 2, 4) and weights.shape == (1, 1, 2, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["manual", "sdpa"])
@pytest.mark.parametrize("pos_emb, qk_norm", [("learned", False), ("rope", True)])
def test_the_training_forward_compiles_to_one_graph(device, backend, pos_emb, qk_norm):
    """train.py compiles the model on a GPU; a graph break (a host read, a data-dependent branch) would
    silently split every step into pieces with Python between them. fullgraph=True turns any break
    into an error. backend="eager" traces with TorchDynamo but generates no kernels, so this takes
    about a second; the traced model must still compute the same logits."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=16, attn_backend=backend,
                          pos_emb=pos_emb, qk_norm=qk_norm)).to(device)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randint(20, (2, 16), device=device)
    logits, loss = compiled(x, x)
    loss.backward()
    assert torch.equal(logits, model(x)[0])
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["manual", "sdpa"])
def test_training_with_dropout_compiles_with_dynamic_shapes(device, backend):
    """A second batch size makes torch.compile retrace with symbolic shapes. The manual attention's
    dropout draw once broke there (torch.rand with generator=None takes concrete sizes only), so a
    compiled run with dropout failed as soon as a shape changed; dynamic=True traces symbolically
    from the start."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=1, n_head=2, n_embd=16, attn_backend=backend,
                          dropout=0.1)).to(device).train()
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)
    for batch in (2, 3):
        x = torch.randint(20, (batch, 16), device=device)
        _, loss = compiled(x, x)
        loss.backward()
        assert torch.isfinite(loss)
