"""The training loop's arithmetic, through train.train on tiny runs: the loss it optimises, gradient
accumulation and clipping, the learning rate it applies, mixed precision against float64, the config,
evaluation, optimizers, and what a GPU step must not do (read the host, break the compiled graph)."""

from __future__ import annotations

import json
import math
import sys
import tomllib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import causality as C
import train
from model import GPT, GPTConfig
from mutants import REAL, batcher, rule_leaks_one_step, substitute
from tiny import ROOT, tiny_config
from training import TrainConfig, configure_optimizers, estimate_loss, exact_loss, lr_at, parse_args, set_lr
from training.evaluate import evaluating
from training.optim import Muon, orthogonalize
from training.runtime import cpu_bf16_speedup, resolve_dtype

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
    spec = TrainConfig(batch_size=8, block_size=T, eval_iters=4)
    est_ref = estimate_loss(model, splits, spec, device)
    exact_ref = exact_loss(model, data, T, N, device)
    model.float()
    with torch.no_grad(), autocast(device, dtype):
        _, loss = model(x, y)
    est = estimate_loss(model, splits, spec, device, autocast(device, dtype))
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


def recorded_steps(monkeypatch) -> list[dict]:
    """Per optimizer step: the global norm of the gradients the optimizers are given and every group's lr."""
    steps: list[dict] = []
    real = train.configure_optimizers

    def configure(model, cfg):
        optimizers = real(model, cfg)
        groups = [g for opt in optimizers for g in opt.param_groups]
        first_step = optimizers[0].step

        def step(*args, **kwargs):  # the first optimizer steps first: every gradient is still there
            grads = [p.grad.float().norm() for g in groups for p in g["params"] if p.grad is not None]
            steps.append({"norm": torch.linalg.vector_norm(torch.stack(grads)).item(), "lr": [g["lr"] for g in groups]})
            return first_step(*args, **kwargs)

        optimizers[0].step = step
        return optimizers

    monkeypatch.setattr(train, "configure_optimizers", configure)
    return steps


QUICK = dict(exact_val=False, tensorboard=False, eval_interval=100)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_float16_training_unscales_the_gradients_before_it_clips_them(tmp_path, monkeypatch, optimizer):
    """float16 turns the GradScaler on; clipping must see the true gradients of every optimizer, unscaled first:
    the norms it measures match float32's, and the optimizers get norms of exactly grad_clip. A clip before the
    unscale (or after unscaling one optimizer's) measures 65536x the norm."""
    steps, clipped = recorded_steps(monkeypatch), []
    real_clip = torch.nn.utils.clip_grad_norm_

    def clip(*args, **kwargs):
        norm = real_clip(*args, **kwargs)
        clipped.append(norm.item())
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    for dtype in ("float32", "float16"):
        train.train(tiny_config(tmp_path, out_dir=str(tmp_path / dtype), dtype=dtype, max_iters=4, grad_clip=0.05,
                                optimizer=optimizer, **QUICK), verbose=False)
    assert len(steps) == 8, "the scaler skipped steps (an overflow at its initial scale?)"
    assert [s["norm"] for s in steps] == pytest.approx([0.05] * 8, rel=1e-3)
    assert clipped[4:] == pytest.approx(clipped[:4], rel=0.05), "float16 clipped other norms than float32"


def test_accumulated_micro_batches_give_the_gradient_of_the_whole_batch(tmp_path, monkeypatch):
    """Batch 4 x 2 micro-batches and batch 8 x 1 on the same 8 rows: the same gradient (their mean). Without
    loss / micro_steps it would be twice that, and grad_clip in effect halved."""
    steps = recorded_steps(monkeypatch)
    x, y = torch.randint(20, (2, 8, 16), generator=torch.Generator().manual_seed(0))
    batches = iter([(x[:4], y[:4]), (x[4:], y[4:]), (x, y)])
    monkeypatch.setattr(train, "get_batch", lambda *a, **k: next(batches))
    common = dict(max_iters=1, grad_clip=0.0, eval_iters=1, **QUICK)
    train.train(tiny_config(tmp_path, out_dir=str(tmp_path / "a"), batch_size=4, gradient_accumulation_steps=2,
                            **common), verbose=False)
    train.train(tiny_config(tmp_path, out_dir=str(tmp_path / "b"), batch_size=8, **common), verbose=False)
    assert steps[0]["norm"] == pytest.approx(steps[1]["norm"], rel=1e-5)


def scheduled_lr(step: int, cfg: TrainConfig) -> float:
    """The README's schedule, written out again: linear warmup from lr / (warmup + 1), then cosine (or wsd:
    flat, then linear over the last cooldown fraction) down to min_lr at lr_decay_iters, flat after."""
    lr, low, warm, decay = cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.lr_decay_iters
    if step < warm:
        return lr * (step + 1) / (warm + 1)
    if step >= decay:
        return low
    if cfg.lr_schedule == "wsd":
        start = max(warm, decay * (1 - cfg.cooldown_frac))
        return lr if step < start else lr + (step - start) / max(1.0, decay - start) * (low - lr)
    return low + 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, decay - warm))) * (lr - low)


@pytest.mark.parametrize("fields", [
    dict(warmup_iters=4, lr_decay_iters=4), dict(warmup_iters=0, lr_decay_iters=6),
    dict(warmup_iters=2, lr_decay_iters=5),
    dict(warmup_iters=2, lr_decay_iters=8, lr_schedule="wsd", cooldown_frac=1.0),
    dict(warmup_iters=2, lr_decay_iters=8, lr_schedule="wsd", cooldown_frac=0.0),
    dict(warmup_iters=2, lr_decay_iters=8, optimizer="muon", muon_lr=0.05)],
    ids=["warmup-ends-at-decay", "no-warmup", "flat-tail", "wsd-all-cooldown", "wsd-no-cooldown", "muon"])
def test_the_loop_applies_the_documented_learning_rate_at_every_step(tmp_path, monkeypatch, fields):
    """The lr every param group holds when the optimizers step (not lr_at's value): the schedule, scaled
    from each group's own peak (Muon's muon_lr)."""
    steps = recorded_steps(monkeypatch)
    cfg = tiny_config(tmp_path, max_iters=8, learning_rate=0.01, min_lr=0.001, **QUICK, **fields)
    train.train(cfg, verbose=False)
    assert len(steps) == cfg.max_iters
    peaks = ([cfg.muon_lr] if cfg.optimizer == "muon" else []) + [cfg.learning_rate] * 2
    for step, s in enumerate(steps):
        want = scheduled_lr(step, cfg)
        assert s["lr"] == pytest.approx([want * peak / cfg.learning_rate for peak in peaks], rel=1e-12), step
    with pytest.raises(ValueError, match="lr_decay_iters=0 ends the decay before warmup_iters=10 ends"):
        TrainConfig(warmup_iters=10, lr_decay_iters=0, max_iters=50)


def test_the_loss_train_py_optimises_is_next_token_cross_entropy(tmp_path, monkeypatch):
    """Every (x, y, loss) of the training forwards, redone by hand from the corpus: y is the next tokens
    of x's windows (located in the corpus: each window occurs once) and the loss their cross-entropy."""
    text = tmp_path / "unique_windows.txt"
    text.write_text("".join(np.random.default_rng(1).choice(list("abcdefghijklmnopqrst"), 3000)))
    records, real = [], train.GPT.forward

    def forward(self, idx, targets=None, cache=None):
        logits, loss = real(self, idx, targets, cache)
        if self.training:
            records.append((idx, targets, logits.detach(), loss.detach()))
        return logits, loss

    monkeypatch.setattr(train.GPT, "forward", forward)
    train.train(tiny_config(tmp_path, dataset=str(text), block_size=8, max_iters=3, **QUICK), verbose=False)
    from data import load_corpus

    corpus = load_corpus(str(text)).train.astype(np.int64)
    assert len(records) == 3
    for x, y, logits, loss in records:
        nxt = torch.tensor(np.stack([corpus[i + 1:i + 9] for i in C.find_offsets(corpus, x)]))
        assert torch.equal(y, nxt)
        torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, logits.size(-1)), nxt.reshape(-1)))


@pytest.fixture(scope="module")
def random_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("random") / "random.txt"
    path.write_text("".join(np.random.default_rng(0).choice(list("abcdefghijklmnopqrstuvwxyzABCDEF"), 60_000)))
    return path


@pytest.mark.mask
@pytest.mark.parametrize("piece, replacement", [(None, None), ("get_batch", batcher(0)),
                                                ("visible", rule_leaks_one_step)],
                         ids=["no-bug", "targets-equal-inputs", "mask-leaks-one-step"])
def test_random_tokens_stay_unpredictable_unless_the_labels_or_the_mask_leak(piece, replacement, random_corpus,
                                                                              tmp_path, monkeypatch):
    """On i.i.d. tokens (V = 32) nothing is predictable: 80 steps stay at ln V, while y = x or a one-step
    leak falls far below it."""
    if piece:
        substitute(monkeypatch, piece, replacement)
    cfg = tiny_config(tmp_path, dataset=str(random_corpus), n_embd=32, batch_size=16, max_iters=80,
                      lr_decay_iters=80, warmup_iters=10, eval_interval=80, eval_iters=20, tensorboard=False)
    summary = train.train(cfg, verbose=False)
    loss, floor = min(summary["last_val_estimate"], summary["final_val_loss"]), math.log(32)
    if piece is None:
        if loss < floor - 0.05:
            pytest.fail(f"LEAK: on random tokens the val loss fell to {loss:.3f}, below ln 32 - 0.05 = "
                        f"{floor - 0.05:.3f}: the model predicts unpredictable tokens, so its labels or its mask "
                        "read the future", pytrace=False)
    else:
        assert summary["last_val_estimate"] < floor - 1.0, "the positive control did not learn the leak"


CPU_CONFIGS = [p for p in sorted((ROOT / "configs").glob("*.toml")) if 'device = "cpu"' in p.read_text()]


@pytest.mark.mask
@pytest.mark.parametrize("config", CPU_CONFIGS, ids=lambda p: p.name)
def test_an_edit_of_the_rule_reaches_the_training_of_every_shipped_cpu_config(config, random_corpus, tmp_path,
                                                                              monkeypatch):
    """Every recipe trains on the from-scratch attention and builds its mask from `visible`, so narrowing the
    rule (whatever it is now) to each query's own key changes what a CPU recipe learns in its first steps (3
    steps of its own model and optimizer, batch 2); two unedited runs agree to the bit."""
    cfg = parse_args([str(config), f"--dataset={random_corpus}", "--dtype=float32", "--batch_size=2", "--max_iters=3",
                      "--eval_interval=3", "--eval_iters=2", "--tensorboard=false", "--exact_val=false",
                      "--warmup_iters=1", "--lr_decay_iters=3"])

    def losses(name: str) -> list[tuple[float, float]]:
        history = train.train(cfg.replace(out_dir=str(tmp_path / name)), verbose=False)["history"]
        return [(h["train_loss"], h["val_loss"]) for h in history]

    clean = losses("clean")
    assert losses("again") == clean, "two identical runs differ: training is not reproducible"
    substitute(monkeypatch, "visible", lambda q, k, *rest: REAL["visible"](q, k, *rest) & (k == q))
    if any(a == b for a, b in zip(clean, losses("own-key-only"), strict=True)):
        pytest.fail(f"{config.name} trains the same with model/attention.py:visible narrowed to each query's own "
                    "key: some path builds its mask without the rule", pytrace=False)


# --- the config --------------------------------------------------------------------------------------

def test_a_config_is_the_file_then_the_overrides_in_order(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('n_layer = 3\nlearning_rate = 1\ndataset = "x.txt"\n')
    cfg = parse_args([str(path), "--n_layer=5", "--dropout", "0.1", "--bias", "--n_layer=4"])
    assert (cfg.n_layer, cfg.dropout, cfg.bias, cfg.dataset) == (4, 0.1, True, "x.txt")
    assert cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)  # TOML's 1 for a float


@pytest.mark.parametrize("override, match", [
    ("--n_embd=100", "n_embd=100 must be divisible by n_head=6"), ("--max_iters=0", "max_iters must be >= 1"),
    ("--learning_rate=-1", "learning_rate must be > 0"), ("--attn_backend=flash", "not one of manual, sdpa"),
    ("--dropout=1", "dropout must be in"), ("--min_lr=1", "min_lr=1.0 exceeds learning_rate"),
    ("--n_layer=four", "n_layer: 'four' is not a valid int"), ("--split=train", "applies to hf: datasets only"),
    ("--device=tpu", "device='tpu' is not one of")])
def test_an_invalid_value_is_refused_naming_the_field(override, match):
    with pytest.raises(ValueError, match=match):
        parse_args([override])


def test_the_shipped_configs_train_the_from_scratch_attention_and_keep_nanogpts_recipes():
    for path in (ROOT / "configs").glob("*.toml"):
        assert parse_args([str(path)]).attn_backend == "manual"
        assert "attn_backend" not in tomllib.loads(path.read_text())  # the field's default, said once
    gpu, cpu = (parse_args([str(ROOT / "configs" / f"{n}.toml")]) for n in ("shakespeare_char", "shakespeare_char_cpu"))
    assert (gpu.n_layer, gpu.n_head, gpu.n_embd, gpu.block_size, gpu.batch_size) == (6, 6, 384, 256, 64)
    assert gpu.dropout == 0.2
    assert (gpu.learning_rate, gpu.min_lr, gpu.warmup_iters, gpu.max_iters, gpu.beta2) == (1e-3, 1e-4, 100, 5000, 0.99)
    assert (cpu.n_layer, cpu.n_head, cpu.n_embd, cpu.block_size, cpu.batch_size) == (4, 4, 128, 64, 12)
    assert (cpu.max_iters, cpu.lr_decay_iters, cpu.dropout, cpu.eval_iters) == (2000, 2000, 0.0, 20)


# --- evaluation --------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", range(10))
def test_the_exact_val_loss_scores_every_target_for_every_split_length_modulo_block_size(extra):
    """2 full windows of block_size 10 and `extra` targets more (1: a last window of a single target)."""
    model = C.leak_test_model("manual")
    corpus = np.random.default_rng(extra).integers(0, model.config.vocab_size, 2 * 10 + extra + 1)
    C.require(C.check_exact_loss_is_next_token_cross_entropy(model, corpus.astype(np.uint16)))


def test_an_estimate_is_the_same_however_its_batches_are_grouped_and_puts_the_mode_back():
    """7 batches in groups of 3 end with a group of 1, which must weigh as one batch; both evaluations leave the
    model in the mode they found it in, train or eval, even when they fail."""
    model = C.leak_test_model("manual").float().train()
    data = {"val": torch.from_numpy(np.random.default_rng(0).integers(0, 13, 300))}
    spec = TrainConfig(batch_size=3, block_size=10, eval_iters=7)
    ests = [estimate_loss(model, data, spec, "cpu", batches_per_forward=n)["val"] for n in (1, 3, 7)]
    assert ests == pytest.approx([ests[0]] * 3, rel=1e-6)
    for mode in (True, False):
        model.train(mode)
        estimate_loss(model, data, spec.replace(eval_iters=1), "cpu")
        assert model.training == mode, f"an estimate left a model in {'train' if mode else 'eval'} mode otherwise"
        exact_loss(model, data["val"], 10, 4, "cpu")
        assert model.training == mode, f"exact_loss left a model in {'train' if mode else 'eval'} mode otherwise"
    model.train()
    with pytest.raises(RuntimeError), evaluating(model):
        raise RuntimeError
    assert model.training


def test_every_eval_of_a_run_reads_the_same_batches_so_its_estimates_compare(tmp_path):
    """With a learning rate too small to move a float32 weight, the estimates at steps 0, 1 and 2 are equal
    only if each eval draws the same batches (its own generator, seeded once per run)."""
    cfg = tiny_config(tmp_path, max_iters=2, eval_interval=1, learning_rate=1e-30, min_lr=0.0, dropout=0.0,
                      exact_val=False, tensorboard=False)
    history = train.train(cfg, verbose=False)["history"]
    assert len(history) == 3 and len({(h["train_loss"], h["val_loss"]) for h in history}) == 1, history


# --- optimizers ----------------------------------------------------------------------------------------

def test_adamw_decays_only_2d_weights_and_muon_takes_the_block_matrices_each_parameter_once():
    model = C.leak_test_model("manual").float()
    for optimizer in ("adamw", "muon"):
        cfg = TrainConfig(optimizer=optimizer, weight_decay=0.1, muon_lr=0.02)
        optimizers = configure_optimizers(model, cfg)
        held = [id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]]
        assert sorted(held) == sorted(id(p) for p in model.parameters())
        adamw = optimizers[-1]
        assert [g["weight_decay"] for g in adamw.param_groups] == [0.1, 0.0]
        assert {p.dim() for p in adamw.param_groups[1]["params"]} == {1}
        if optimizer == "muon":
            assert {id(p) for p in optimizers[0].param_groups[0]["params"]} == \
                {id(p) for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")}
            lr = set_lr(optimizers, 50, cfg)
            assert lr == lr_at(50, cfg) and optimizers[0].param_groups[0]["lr"] == pytest.approx(0.02 * lr / 1e-3)


def test_muon_steps_by_orthogonalised_nesterov_momentum_scaled_up_for_tall_matrices():
    """Three steps against the rule written out: m = beta m + (1 - beta) g, u = (1 - beta) g + beta m,
    change = -lr sqrt(max(1, rows / cols)) orthogonalize(u) (with m = 0 one step would only rescale g)."""
    g = torch.Generator().manual_seed(0)
    tall, wide = (torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((48, 16), (16, 48)))
    lr, beta = 0.1, 0.9
    opt = Muon([tall, wide], lr=lr, momentum=beta, ns_dtype=torch.float32)
    momentum = {p: torch.zeros_like(p) for p in (tall, wide)}
    for _ in range(3):
        before = {p: p.detach().clone() for p in (tall, wide)}
        for p in (tall, wide):
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        for p in (tall, wide):
            momentum[p] = beta * momentum[p] + (1 - beta) * p.grad
            scale = math.sqrt(max(1, p.size(0) / p.size(1)))
            u = (1 - beta) * p.grad + beta * momentum[p]
            want = -lr * scale * orthogonalize(u[None], dtype=torch.float32)[0]
            torch.testing.assert_close(p.detach() - before[p], want, atol=1e-5, rtol=0)
    s = torch.linalg.svdvals(orthogonalize(torch.randn(64, 32, generator=g), dtype=torch.float32))
    assert 0.6 < s.min() and s.max() < 1.3  # singular values near 1


# --- devices: the dtype rule, and what a GPU step must not do -----------------------------------------

@pytest.mark.parametrize("speedup, matmul, expected", [
    (3.0, (12 * 64, 128), torch.bfloat16), (3.0, (2 ** 10, 2 ** 6 - 1), torch.float32),
    (1.4, (12 * 64, 128), torch.float32), (0.09, (12 * 64, 128), torch.float32)],
    ids=["amx-laptop-recipe", "too-small", "too-little-gain", "avx2-only"])
def test_auto_dtype_on_a_cpu_is_bfloat16_only_where_its_matmuls_are_fast_and_large(monkeypatch, tmp_path, speedup,
                                                                                    matmul, expected):
    import training.runtime

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(training.runtime, "cpu_bf16_speedup", lambda rows, width: speedup)
    assert resolve_dtype("auto", torch.device("cpu"), matmul)[0] == expected
    assert resolve_dtype("float32", torch.device("cpu"), matmul)[0] == torch.float32  # an explicit choice stands


def test_the_bf16_probe_is_measured_once_per_machine_and_shape_and_then_remembered(monkeypatch, tmp_path):
    """Timings on a loaded machine swing from 0.02x to 20x: the choice is made once, kept on disk (in
    XDG_CACHE_HOME), and read back at every later start, so it never flips between a run and its resume."""
    import training.runtime

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []
    monkeypatch.setattr(training.runtime, "cpu_bf16_speedup", lambda rows, width: measured.append(rows) or 3.0)
    cpu = torch.device("cpu")
    first = resolve_dtype("auto", cpu, (768, 128))
    monkeypatch.setattr(training.runtime, "cpu_bf16_speedup", lambda rows, width: measured.append(rows) or 0.5)
    assert resolve_dtype("auto", cpu, (768, 128)) == first and first[0] == torch.bfloat16 and measured == [768]
    assert "3.00x" in first[1] and str(tmp_path / "gpt-char" / "probes.json") in first[1]
    assert resolve_dtype("auto", cpu, (1536, 128))[0] == torch.float32 and measured == [768, 1536]  # another shape


def test_the_bf16_probe_times_real_matmuls_without_touching_the_global_rng():
    state = torch.get_rng_state()
    ratios = {cpu_bf16_speedup(rows, width) for rows, width in ((64, 32), (256, 64))}
    assert all(r > 0 for r in ratios) and len(ratios) == 2 and torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("kept, steps, want", [
    (None, 2000, False), ({"eager": 44.0, "compiled": 33.0, "compile_s": 4.0}, 2000, True),
    ({"eager": 44.0, "compiled": 33.0, "compile_s": 4.0}, 300, False),
    ({"eager": 44.0, "compiled": 33.0, "compile_s": 55.0}, 2000, False),
    ({"eager": 40.0, "compiled": 41.0, "compile_s": 1.0}, 10 ** 6, False)],
    ids=["never-measured", "pays", "too-short-for-its-compile", "cold-compile-too-dear", "no-gain"])
def test_auto_compile_on_a_cpu_follows_this_machines_own_measured_runs_of_the_shape(monkeypatch, tmp_path, kept, steps,
                                                                                   want):
    """Compile where this machine's remembered eager and compiled runs of the same shape say the steps saved exceed
    twice what compiling took; an explicit choice stands; CUDA compiles."""
    import training.runtime as runtime

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg, cpu = TrainConfig(), torch.device("cpu")
    if kept:
        runtime.remembered(runtime.speed_key(cfg), update=lambda _: kept)
    use, why = runtime.resolve_compile("auto", cpu, cfg, steps)
    assert use == want and why.startswith("auto: "), why
    assert runtime.resolve_compile("false", cpu, cfg, steps)[0] is False
    assert runtime.resolve_compile("auto", torch.device("cuda"), cfg, steps)[0] is True


def test_a_cpu_run_remembers_its_speed_and_a_resumed_run_keeps_its_compile_choice(monkeypatch, tmp_path):
    """A finished CPU run of >= 20 steps records its median ms/step (eager or compiled, with the compile's extra
    seconds); a run that auto compiled resumes compiled, whatever the remembered speeds say by then."""
    import training.runtime as runtime

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model: real_compile(model, backend="eager"))  # traced, not built
    cfg = tiny_config(tmp_path, max_iters=24, eval_interval=8, exact_val=False, tensorboard=False)
    train.train(cfg.replace(out_dir=str(tmp_path / "eager"), compile="false"), verbose=False)
    train.train(cfg.replace(out_dir=str(tmp_path / "compiled"), compile="true"), verbose=False)
    kept = runtime.remembered(runtime.speed_key(cfg.replace(dtype="float32")))[0]
    assert kept.keys() == {"eager", "compiled", "compile_s"} and kept["eager"] > 0 and kept["compiled"] > 0
    real = train.resolve_compile  # what the measured speeds say, faked; what a resume keeps, real
    monkeypatch.setattr(train, "resolve_compile", lambda *a: real(*a) if a[4] not in (None, "auto") else (True, ""))
    auto = cfg.replace(out_dir=str(tmp_path / "auto"), compile="auto")
    train.train(auto.replace(max_iters=8), verbose=False)
    monkeypatch.setattr(train, "resolve_compile", lambda *a: real(*a) if a[4] not in (None, "auto") else (False, ""))
    resumed = train.train(auto.replace(resume=True), verbose=False)
    assert resumed["steps_this_run"] == 16 and json.loads((tmp_path / "auto" / "config.json").read_text())["compile"]


@pytest.mark.mask
def test_an_edit_of_the_rule_reaches_compiled_training_too(tmp_path, monkeypatch):
    """torch.compile traces `visible` into its graph; narrowing the rule must retrace it (dynamo guards the global),
    so a compiled run learns otherwise; two unedited compiled runs agree (traced by the eager backend: the graph,
    not inductor's kernels, is in question)."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model: real_compile(model, backend="eager"))
    cfg = tiny_config(tmp_path, compile="true", max_iters=3, eval_interval=3, exact_val=False, tensorboard=False)

    def losses(name: str) -> list[float]:
        return [h["val_loss"] for h in train.train(cfg.replace(out_dir=str(tmp_path / name)), verbose=False)["history"]]

    clean = losses("clean")
    assert losses("again") == clean
    substitute(monkeypatch, "visible", lambda q, k, *rest: REAL["visible"](q, k, *rest) & (k == q))
    if losses("own-key-only")[-1] == clean[-1]:
        pytest.fail("compiled training is the same with model/attention.py:visible narrowed: the compiled graph kept "
                    "the old rule", pytrace=False)


HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_training_steps_between_log_steps_never_read_a_tensor_on_the_host(tmp_path, monkeypatch, optimizer):
    """On a GPU a host read waits for all queued work; the loop may read only at log and eval steps. 12 steps,
    logged every 4th, with clipping and 2 micro-batches: steps 1-3, 5-7 and 9-10 read nothing (additive_mask's
    check of a CPU mask excepted: it is skipped for GPU masks), log steps do (the recording works)."""
    current, reads, real_set_lr = {"step": None}, {}, train.set_lr

    def set_lr(optimizers, step, cfg):  # called first thing in every step
        current["step"] = step
        return real_set_lr(optimizers, step, cfg)

    def recording(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if current["step"] is not None and sys._getframe(1).f_code.co_name != "additive_mask":
                reads.setdefault(current["step"], []).append(name)
            return real(self, *args, **kwargs)
        return read

    monkeypatch.setattr(train, "set_lr", set_lr)
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, recording(name))
    train.train(tiny_config(tmp_path, optimizer=optimizer, max_iters=12, log_interval=4, gradient_accumulation_steps=2,
                            grad_clip=1.0, **QUICK), verbose=False)
    quiet = {step: names for step, names in reads.items() if step not in {0, 4, 8, 11, 12}}
    assert not quiet and {4, 8, 11} <= reads.keys(), reads


def test_the_training_forward_compiles_to_one_graph_with_dropout_and_dynamic_shapes():
    """A graph break (a host read, a data-dependent branch) would split every compiled step; fullgraph=True
    makes one an error. backend="eager" traces without generating kernels."""
    torch.manual_seed(0)
    model = C.leak_test_model("manual", pos_emb="rope", qk_norm=True, dropout=0.1).float().train()
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)
    for batch in (2, 3):
        x = torch.randint(13, (batch, 10))
        _, loss = compiled(x, x)
        loss.backward()
        assert torch.isfinite(loss)
