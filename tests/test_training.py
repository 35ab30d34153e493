"""The training loop's arithmetic, through train.train on tiny runs: the loss it optimises, gradient
accumulation and clipping, the learning rate it applies, mixed precision against float64, the config,
evaluation, optimizers, and what a GPU step must not do (read the host, break the compiled graph)."""

import dataclasses
import itertools
import json
import math
import re
import shlex
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import causality as C
import train
import training.runtime as runtime
from data import get_batch, load_corpus
from model import GPT, GPTConfig
from mutants import REAL, batcher, rule_leaks_one_step, substitute
from tiny import ARCHITECTURE, CPU_CONFIGS, ROOT, TEXT, ctrl_c_in_batch, tiny_config
from training import TrainConfig, configure_optimizers, estimate_loss, exact_loss, parse_args
from training.evaluate import evaluating
from training.log import RunLog, format_duration
from training.optim import Muon, orthogonalize

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Measured differences from float64 on this model (3 seeds): bf16 <= 3.2e-5 on a CPU, 6.5e-4 on an H200; fp16 <=
# 1e-5, 6.5e-5. A loss of half-precision logits (no float32 cast) misses by 3e-2 and 4e-3 on the CPU (the control).
TOL = {torch.bfloat16: 1.5e-3, torch.float16: 1e-4}
V, T, N = 65, 32, 64  # N windows of T tokens
QUICK = dict(exact_val=False, tensorboard=False, eval_interval=100)
RUNS = {"eager": [44.0], "compiled": [33.0], "cold_s": 55.0}  # a shape's runs' ms/step, and its cold compile's s
EAGER = lambda model, real=torch.compile: real(model, backend="eager") if torch.are_deterministic_algorithms_enabled() \
    else pytest.fail("compiled on a CPU without deterministic algorithms: inductor's atomic adds make runs differ")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_losses_under_autocast_match_float64(device, dtype):
    """One batch's loss, seeded estimates, exact val loss; the control: a loss of half-precision logits misses TOL."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=64)).eval().to(device)
    data = torch.from_numpy(np.random.default_rng(0).integers(0, V, N * T + 1)).to(device)
    X, Y, found = data[:-1].view(N, T), data[1:].view(N, T), {}
    splits, spec = {"train": data, "val": data.flip(0)}, TrainConfig(batch_size=8, block_size=T, eval_iters=4)
    for half in (False, True):  # float64 weights, then float32 weights under autocast
        amp = torch.autocast(device, dtype=dtype, enabled=half)
        with torch.no_grad(), amp:
            (_, loss), (logits, _) = model.to(torch.float32 if half else torch.float64)(X[:8], Y[:8]), model(X)
        exact = exact_loss(model, data, T, N, device, autocast=amp)
        estimates = estimate_loss(model, splits, spec, device, autocast=amp)
        found[half] = {"training loss": loss.item(), "exact val loss": exact,
                       "loss of all N windows": F.cross_entropy(logits.float().reshape(-1, V), Y.reshape(-1)).item(),
                       **{f"{k} estimate": v for k, v in estimates.items()}}
    assert loss.dtype == torch.float32, "the loss must come out of autocast in float32"
    for name, want in found[False].items():
        assert abs((got := found[True][name]) - want) < TOL[dtype], f"{dtype} {name} {got:.6f} vs float64 {want:.6f}"
    wrong = F.cross_entropy(logits.reshape(-1, V), Y.reshape(-1), reduction="sum").item() / Y.numel()  # no float32
    assert device != "cpu" or (logits.dtype == dtype and abs(wrong - found[False]["loss of all N windows"])
                               > TOL[dtype]), "positive control: a loss of half-precision logits passes TOL"


def recorded_steps(monkeypatch) -> list[dict]:
    """Per optimizer step: the global norm of the gradients the optimizers are given and every group's lr."""
    steps, real = [], train.configure_optimizers

    def configure(model, cfg):
        optimizers = real(model, cfg)
        groups, first_step = [g for opt in optimizers for g in opt.param_groups], optimizers[0].step

        def step(*args, **kwargs):  # the first optimizer steps first: every gradient is still there
            grads = [p.grad.float().norm() for g in groups for p in g["params"] if p.grad is not None]
            steps.append({"norm": torch.linalg.vector_norm(torch.stack(grads)).item(), "lr": [g["lr"] for g in groups]})
            return first_step(*args, **kwargs)
        optimizers[0].step = step
        return optimizers
    monkeypatch.setattr(train, "configure_optimizers", configure)
    return steps


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_float16_training_unscales_the_gradients_before_it_clips_them(tmp_path, monkeypatch, optimizer):
    """float16 scales its losses (small gradients would underflow) and unscales the gradients before the clip: its
    norms match float32's, steps get grad_clip."""
    steps, clipped, real_clip, scaling = recorded_steps(monkeypatch), [], torch.nn.utils.clip_grad_norm_, []

    class GradScaler(torch.amp.GradScaler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            scaling.append(self.is_enabled())
    monkeypatch.setattr(torch.amp, "GradScaler", GradScaler)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda *a, **k: clipped.append((norm := real_clip(*a, **k)).item()) or norm)
    for dtype in ("float32", "float16"):
        train.train(tiny_config(tmp_path, out_dir=str(tmp_path / dtype), dtype=dtype, max_iters=4, grad_clip=0.05,
                                optimizer=optimizer, **QUICK), verbose=False)
    assert [s["norm"] for s in steps] == pytest.approx([0.05] * 8, rel=1e-3), "steps skipped (overflows?) or unclipped"
    assert clipped[4:] == pytest.approx(clipped[:4], rel=0.05), "float16 clipped other norms than float32"
    assert scaling == [False, True]


def test_accumulated_micro_batches_give_the_gradient_of_the_whole_batch(tmp_path, monkeypatch):
    """Batch 4 x 2 micro-batches and 8 x 1 on the same rows: one gradient, their mean (loss / micro_steps). grad_clip=0
    is off: the gradient a clip it never reaches leaves."""
    steps = recorded_steps(monkeypatch)
    x, y = torch.randint(20, (2, 8, 16), generator=torch.Generator().manual_seed(0))
    batches = iter([(x[:4], y[:4]), (x[4:], y[4:]), (x, y)])
    monkeypatch.setattr(train, "get_batch", lambda *a, **k: next(batches))
    for batch, micro in ((4, 2), (8, 1)):
        cut = 0.0 if micro > 1 else 1e9
        train.train(tiny_config(tmp_path, out_dir=str(tmp_path / str(batch)), batch_size=batch, max_iters=1,
                                gradient_accumulation_steps=micro, grad_clip=cut, eval_iters=1, **QUICK), verbose=False)
    assert steps[0]["norm"] == pytest.approx(steps[1]["norm"], rel=1e-5)


def scheduled_lr(step: int, cfg: TrainConfig) -> float:
    """The README's schedule again: warmup from lr / (warmup + 1), cosine (wsd: flat, then linear) to min_lr, flat."""
    lr, low, warm, decay = cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.lr_decay_iters
    if step < warm:
        return lr * (step + 1) / (warm + 1)
    if step >= decay:
        return low
    if cfg.lr_schedule == "wsd":
        start = max(warm, decay * (1 - cfg.cooldown_frac))
        return lr if step < start else lr + (step - start) / max(1.0, decay - start) * (low - lr)
    return low + 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, decay - warm))) * (lr - low)


@pytest.mark.parametrize("fields", [dict(warmup_iters=4, lr_decay_iters=4), dict(warmup_iters=0, lr_decay_iters=6),
    dict(warmup_iters=2, lr_decay_iters=5), dict(warmup_iters=2, lr_decay_iters=8, optimizer="muon", muon_lr=0.05),
    *(dict(warmup_iters=2, lr_decay_iters=8, lr_schedule="wsd", cooldown_frac=frac) for frac in (1.0, 0.0))],
    ids=["warmup-ends-at-decay", "no-warmup", "flat-tail", "muon", "wsd-all-cooldown", "wsd-no-cooldown"])
def test_the_loop_applies_the_documented_learning_rate_at_every_step(tmp_path, monkeypatch, fields):
    """The lr every group holds when the optimizers step (not lr_at's): the schedule, from each group's own peak."""
    steps = recorded_steps(monkeypatch)
    cfg = tiny_config(tmp_path, max_iters=8, learning_rate=0.01, min_lr=0.001, **QUICK, **fields)
    train.train(cfg, verbose=False)
    assert len(steps) == cfg.max_iters
    peaks = ([cfg.muon_lr] if cfg.optimizer == "muon" else []) + [cfg.learning_rate] * 2
    for step, s in enumerate(steps):
        want = scheduled_lr(step, cfg)
        assert s["lr"] == pytest.approx([want * peak / cfg.learning_rate for peak in peaks], rel=1e-12), step


def test_the_loss_train_py_optimises_is_next_token_cross_entropy(tmp_path, monkeypatch):
    """Every training forward's y is the next tokens of x's windows in the corpus, and its loss their cross-entropy:
    the loss its step logs (progress line, TensorBoard)."""
    text = tmp_path / "unique_windows.txt"
    text.write_text("".join(np.random.default_rng(1).choice(list("abcdefghijklmnopqrst"), 3000)))
    records, logged, real = [], [], train.GPT.forward
    monkeypatch.setattr(train.RunLog, "scalars", lambda _, step, values: logged.extend(
        [values["loss/train"]] if "loss/train" in values else []))

    def forward(self, idx, targets=None, cache=None):
        logits, loss = real(self, idx, targets, cache)
        if self.training:
            records.append((idx, targets, logits.detach(), loss.detach()))
        return logits, loss
    monkeypatch.setattr(train.GPT, "forward", forward)
    train.train(tiny_config(tmp_path, dataset=str(text), block_size=8, max_iters=3, **QUICK), verbose=False)
    corpus = load_corpus(str(text)).train.astype(np.int64)
    assert len(records) == 3 and logged == [loss.item() for *_, loss in records]
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
    """On i.i.d. tokens (V = 32) 80 steps stay at ln V; with y = x or a mask leaking one step it falls far below."""
    if piece:
        substitute(monkeypatch, piece, replacement)
    cfg = tiny_config(tmp_path, dataset=str(random_corpus), n_embd=32, batch_size=16, max_iters=80,
                      lr_decay_iters=80, warmup_iters=10, eval_interval=80, eval_iters=20, tensorboard=False)
    summary = train.train(cfg, verbose=False)
    loss, floor = min(summary["last_val_estimate"], summary["final_val_loss"]), math.log(32)
    if piece is None and loss < floor - 0.05:
        pytest.fail(f"LEAK: on random tokens the val loss fell to {loss:.3f}, below ln 32 - 0.05 = {floor - 0.05:.3f}: "
                    "the model predicts unpredictable tokens, so its labels or its mask read the future", pytrace=False)
    assert piece is None or summary["last_val_estimate"] < floor - 1.0, "the positive control did not learn the leak"


@pytest.mark.mask
@pytest.mark.parametrize("config", [*CPU_CONFIGS, None], ids=lambda p: p.name if p else "compiled")
def test_an_edit_of_the_rule_reaches_the_training_of_every_shipped_cpu_config_and_compiled_training(
        config, random_corpus, tmp_path, monkeypatch):
    """Narrowing `visible` changes every loss of 3 steps of each CPU recipe and of a compiled run (dynamo retraces)."""
    if config:
        cfg = parse_args([str(config), f"--dataset={random_corpus}", "--dtype=float32", "--batch_size=2",
                          "--max_iters=3", "--eval_interval=3", "--eval_iters=2", "--tensorboard=false",
                          "--exact_val=false", "--warmup_iters=1", "--lr_decay_iters=3"])
    else:  # traced only (inductor's kernels take 30 s): EAGER checks the flag that keeps inductor's atomic adds out
        monkeypatch.setattr(torch, "compile", EAGER)
        cfg = tiny_config(tmp_path, compile="true", max_iters=3, eval_interval=3, exact_val=False, tensorboard=False)

    def losses(name: str) -> list[float]:  # the train and val loss of every eval
        history = train.train(cfg.replace(out_dir=str(tmp_path / name)), verbose=False)["history"]
        return [h[k] for h in history for k in ("train_loss", "val_loss")]
    clean = losses("clean")
    assert losses("again") == clean, "two identical runs differ: training is not reproducible"
    assert not torch.are_deterministic_algorithms_enabled(), "train() left deterministic algorithms on"
    substitute(monkeypatch, "visible", lambda q, k, *rest: REAL["visible"](q, k, *rest) & (k == q))
    if any(a == b for a, b in zip(clean, losses("own-key-only"), strict=True)):
        pytest.fail(f"{config.name} trains the same with model/attention.py:visible narrowed to each query's own key: "
                    "some path builds its mask without the rule" if config else "compiled training is the same with "
                    "model/attention.py:visible narrowed: the compiled graph kept the old rule", pytrace=False)


# --- the config --------------------------------------------------------------------------------------

def test_a_config_is_the_file_then_the_overrides_in_order(tmp_path):
    (path := tmp_path / "c.toml").write_text('n_layer = 3\nlearning_rate = 1\ndataset = "x.txt"\n')
    cfg = parse_args([str(path), "--n_layer=5", "--dropout", "0.1", "--bias", "--n_layer=4", "--min_lr=1", "--compile",
                      "--overwrite=1", "--exact_val=no"])  # a bare flag: a bool's true, or a choice's "true"
    assert (cfg.n_layer, cfg.dropout, cfg.bias, cfg.dataset, cfg.compile, cfg.overwrite, cfg.exact_val) == (
        4, 0.1, True, "x.txt", "true", True, False)
    assert parse_args(["--max_iters=50", "--lr_decay_iters=50"]).warmup_iters == 100  # ends in its warmup: no decay
    spaced = parse_args(["--compile", "auto", "--resume", "on", "--exact_val", "False"])  # a value after a bare flag
    assert (spaced.compile, spaced.resume, spaced.exact_val) == ("auto", True, False)
    assert parse_args(["--compile=False"]).compile == "false" == parse_args(["--compile", "0"]).compile  # nanoGPT's
    edges = parse_args(["--resume=yes", "--bias=1", f"--seed={2**62}", "--weight_decay=0"])  # yes, 1; range ends
    assert (edges.resume, edges.bias, edges.seed, edges.weight_decay) == (True, True, 2**62, 0.0)
    with pytest.raises(ValueError, match=re.escape("config field dtype='fp16' is not one of auto, float32")):
        parse_args(["--dtype", "fp16"])  # a choice without a bare value takes any next word, to refuse it
    for argv in (["--resume", str(path)], ["--max_iters=5", str(path)]):  # the file out of place
        with pytest.raises(ValueError, match=re.escape(f"unexpected argument {str(path)!r}: the config file comes "
                                                       "first, then the --field=value overrides")):
            parse_args(argv)
    assert cfg.learning_rate == 1.0 == cfg.min_lr and isinstance(cfg.learning_rate, float)  # TOML's 1; lr = min_lr: ok
    for key, kind in (("max_iters", "int"), ("learning_rate", "float")):  # TOML's true is no number (Python's is)
        path.write_text(f"{key} = true\n")
        with pytest.raises(ValueError, match=re.escape(f"config field {key} must be {kind}, got True")):
            parse_args([str(path)])
    for value in ("true", "false"):  # a choice named so: TOML's boolean is that choice
        path.write_text(f"compile = {value}\n")
        assert parse_args([str(path)]).compile == value


def test_every_architecture_field_of_a_run_reaches_its_model():
    """Each GPTConfig field a TrainConfig carries is passed on: a dropped one would train its default in silence."""
    changed = ARCHITECTURE | dict(dropout=0.1, attn_backend="sdpa")
    assert set(changed) == {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "doc_sep"}
    assert all(getattr(GPTConfig(vocab_size=7), name) != value for name, value in changed.items())  # not defaults
    assert TrainConfig(**changed).model_config(7, doc_sep=3) == GPTConfig(vocab_size=7, doc_sep=3, **changed)


@pytest.mark.parametrize("override, match", [
    ("--n_embd=100", "n_embd=100 must be divisible by n_head=6"), ("--max_iters=0", "max_iters must be >= 1"),
    ("--learning_rate=0", "learning_rate must be > 0"), ("--attn_backend=flash", "not one of manual, sdpa"),
    ("--learning_rate=nan", "learning_rate must be a finite number, got nan"),
    ("--beta2=1", "beta2 must be in [0, 1), got 1.0"),
    ("--min_lr=1", "min_lr=1.0 exceeds learning_rate=0.001; give --min_lr <= 0.001"),
    ("--n_layer=four", "n_layer: 'four' is not a valid int"), ("--split=train", "applies to hf: datasets only"),
    ("--bias=maybe", "config key bias: 'maybe' is not a valid bool (true or false)"),
    ("--text_column=body", "text_column='body' applies to hf: datasets only"),
    ("--device=tpu", "device must be one of auto, cpu, cuda, cuda:N, mps, got 'tpu'"),
    ("--device=cuda0", "device must be one of auto, cpu, cuda, cuda:N, mps, got 'cuda0'"),  # whole, not a prefix
    (f"--seed={2**62 + 1}", f"seed must be in [0, 2**62], got {2**62 + 1}"),  # rank and step seeds stay int64
    ("--dataset=", "dataset must be non-empty, got ''"), ("--out_dir=' '", "out_dir must be non-empty, got ' '"),
    ("--warmup_iters=10 --lr_decay_iters=0 --max_iters=50", "lr_decay_iters=0 ends the decay before warmup_iters=10"),
    ("--min_lr=0 --max_iters=60 --lr_decay_iters=50", "max_iters=60 runs past lr_decay_iters=50 at min_lr=0, where "
                                                       "steps change nothing; give --lr_decay_iters=60"),
    ("--resume --overwrite", "--resume continues the run in out_dir and --overwrite replaces it: give one of them"),
    ("--zzz=1", "unknown config key 'zzz'; python train.py --help lists them"),  # no guess, nor every key
    ("--warmup=5", "did you mean warmup_iters?"), ("--documents=words", "is not one of '', lines, paragraphs"),
    ("--init_from=resume", "unknown config key 'init_from'; did you mean resume?"),  # nanoGPT's name
    ("--lr=1", "unknown config key 'lr'; did you mean learning_rate? python train.py --help lists them")])
def test_an_invalid_value_is_refused_naming_the_field(override, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        parse_args(shlex.split(override))  # --out_dir=' ': a blank name is empty too


def test_the_shipped_configs_train_the_from_scratch_attention_and_keep_nanogpts_recipes():
    for path in (ROOT / "configs").glob("*.toml"):
        assert parse_args([str(path)]).attn_backend == "manual"
        assert "attn_backend" not in tomllib.loads(path.read_text())  # the field's default, said once
    gpu, cpu = (parse_args([str(ROOT / "configs" / f"{n}.toml")]) for n in ("shakespeare_char", "shakespeare_char_cpu"))
    assert (gpu.n_layer, gpu.n_head, gpu.n_embd, gpu.block_size, gpu.batch_size) == (6, 6, 384, 256, 64)
    assert (gpu.learning_rate, gpu.min_lr, gpu.warmup_iters, gpu.max_iters, gpu.beta2) == (1e-3, 1e-4, 100, 5000, 0.99)
    assert (cpu.n_layer, cpu.n_head, cpu.n_embd, cpu.block_size, cpu.batch_size) == (4, 4, 128, 64, 12)
    assert (cpu.max_iters, cpu.lr_decay_iters, cpu.eval_iters, cpu.dropout, gpu.dropout) == (2000, 2000, 20, 0.0, 0.2)


def test_a_corpus_of_40_000_symbols_trains_with_its_ids_past_int16_whole(tmp_path):
    """Ids up to 65,535 fit a token (tests/test_data.py); past 32,767 they reach the model's embedding unwrapped."""
    (tmp_path / "corpus.txt").write_text("".join(map(chr, range(0x100, 0x100 + 40_000))) * 2, encoding="utf-8")
    cfg = tiny_config(tmp_path, max_iters=2, eval_interval=2, eval_iters=1, batch_size=2, block_size=8,
                      exact_val=False, tensorboard=False)
    summary = train.train(cfg, verbose=False)
    assert summary["params"] > 40_000 * 16 and abs(summary["best_val_loss"] - math.log(40_000)) < 1, summary


# --- evaluation --------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", range(10))
def test_the_exact_val_loss_scores_every_target_for_every_split_length_modulo_block_size(extra):
    """2 full windows of block_size 10 and `extra` targets more (1: a last window of a single target)."""
    model = C.leak_test_model("manual")
    corpus = np.random.default_rng(extra).integers(0, model.config.vocab_size, 2 * 10 + extra + 1)
    C.require(C.check_exact_loss_is_next_token_cross_entropy(model, corpus.astype(np.uint16)))


def test_an_estimate_is_the_mean_batch_loss_however_its_batches_are_grouped_and_puts_the_mode_back():
    """The mean loss of eval_iters batches drawn as documented (seed + 1, for each split); 7 batches in groups of 3
    end in a group of 1 weighing as 1 batch; evaluations put the mode back, even failed."""
    model = C.leak_test_model("manual").float().train()
    data = dict.fromkeys(("train", "val"), torch.from_numpy(np.random.default_rng(0).integers(0, 13, 300)))
    spec = TrainConfig(batch_size=3, block_size=10, eval_iters=7)
    gen, B, T = torch.Generator().manual_seed(spec.seed + 1), spec.batch_size, spec.block_size
    with evaluating(model):
        by_hand = np.mean([model(*get_batch(data["val"], B, T, gen))[1].item() for _ in range(spec.eval_iters)])
    ests = [list(estimate_loss(model, data, spec, "cpu", batches_per_forward=n).values()) for n in (1, 3, 7)]
    assert ests == [pytest.approx([by_hand] * 2, rel=1e-6)] * 3
    for mode in (True, False):
        model.train(mode)
        estimate_loss(model, data, spec.replace(eval_iters=1), "cpu")
        assert model.training == mode, f"an estimate left a model in {'train' if mode else 'eval'} mode otherwise"
        exact_loss(model, data["val"], 10, 4, "cpu")
        assert model.training == mode, f"exact_loss left a model in {'train' if mode else 'eval'} mode otherwise"
    with pytest.raises(RuntimeError), evaluating(model.train()):
        raise RuntimeError
    assert model.training


def test_every_eval_of_a_run_reads_the_same_batches_so_its_estimates_compare(tmp_path):
    """Estimates at steps 0, 1 and 2 of a run whose lr moves no weight are equal: every eval draws the same batches."""
    cfg = tiny_config(tmp_path, max_iters=2, learning_rate=1e-30, min_lr=0.0, **QUICK | {"eval_interval": 1})
    history = train.train(cfg, verbose=False)["history"]
    assert len(history) == 3 and len({(h["train_loss"], h["val_loss"]) for h in history}) == 1, history


# --- optimizers ----------------------------------------------------------------------------------------

def test_adamw_decays_only_2d_weights_and_muon_takes_the_block_matrices_each_parameter_once(monkeypatch):
    """Each parameter in one optimizer's group; Muon orthogonalises in bf16 where bf16 matmuls pay, else float32."""
    model = C.leak_test_model("manual").float()
    for pays, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr("training.optim.bf16_pays", lambda *a, pays=pays, **k: (pays, ""))
        assert configure_optimizers(model, TrainConfig(optimizer="muon"))[0].ns_dtype == dtype
    muon = configure_optimizers(model, TrainConfig(optimizer="muon", muon_lr=0.03, muon_momentum=0.7))[0].defaults
    assert (muon["lr"], muon["momentum"]) == (0.03, 0.7)  # its own settings, not AdamW's
    for optimizer in ("adamw", "muon"):
        optimizers = configure_optimizers(model, TrainConfig(optimizer=optimizer, weight_decay=0.1, beta1=0.8,
                                                             beta2=0.95))
        assert optimizers[-1].defaults["betas"] == (0.8, 0.95)
        held = [id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]]
        assert sorted(held) == sorted(id(p) for p in model.parameters())
        assert [g["weight_decay"] for g in optimizers[-1].param_groups] == [0.1, 0.0]  # the last is AdamW
        assert {p.dim() for p in optimizers[-1].param_groups[1]["params"]} == {1}
        assert optimizer == "adamw" or {id(p) for p in optimizers[0].param_groups[0]["params"]} == \
            {id(p) for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")}


def test_muon_steps_by_orthogonalised_nesterov_momentum_scaled_up_for_tall_matrices():
    """Three steps against the rule written out: m = beta m + (1 - beta) g, u = (1 - beta) g + beta m,
    change = -lr sqrt(max(1, rows / cols)) orthogonalize(u) (with m = 0 one step would only rescale g)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((48, 16), (48, 16), (16, 48))]
    lr, beta = 0.1, 0.9
    opt, momentum = Muon(params, lr=1.0, momentum=beta, ns_dtype=torch.float32), [torch.zeros_like(p) for p in params]
    opt.param_groups[0]["lr"] = lr  # as set_lr schedules it: a step takes its group's lr, not the peak
    for _ in range(3):
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        for i, p in enumerate(params):
            momentum[i] = beta * momentum[i] + (1 - beta) * p.grad
            u, scale = (1 - beta) * p.grad + beta * momentum[i], math.sqrt(max(1, p.size(0) / p.size(1)))
            want = -lr * scale * orthogonalize(u[None], dtype=torch.float32)[0]
            torch.testing.assert_close(p.detach() - before[i], want, atol=1e-5, rtol=0)
    G = torch.randn(64, 32, generator=g) * torch.logspace(0, -2, 32)  # singular values 8.5 .. 0.05
    s = torch.linalg.svdvals(orthogonalize(G, dtype=torch.float32))
    assert 0.6 < s.min() and s.max() < 1.3  # all near 1: five iterations lift even the smallest


# --- devices: the dtype rule, and what a GPU step must not do -----------------------------------------

@pytest.mark.parametrize("speedup, matmul, expected", [(3.0, (12 * 64, 128), torch.bfloat16),
    (3.0, (2 ** 10, 2 ** 6 - 1), torch.float32), (3.0, (2 ** 10, 2 ** 6), torch.bfloat16), (1.5, (12 * 64, 128),
    torch.bfloat16), (1.4, (12 * 64, 128), torch.float32), (0.09, (12 * 64, 128), torch.float32)],
    ids=["amx-laptop-recipe", "too-small", "just-large-enough", "gain-just-enough", "too-little-gain", "avx2-only"])
def test_auto_dtype_is_bf16_where_cpu_matmuls_are_fast_and_large(monkeypatch, tmp_path, speedup, matmul, expected):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(runtime, "cpu_bf16_speedup", lambda rows, width: speedup)
    assert runtime.resolve_dtype("auto", torch.device("cpu"), matmul)[0] == expected
    assert runtime.resolve_dtype("float32", torch.device("cpu"), matmul)[0] == torch.float32  # an explicit choice
    for supported, dtype in ((True, torch.bfloat16), (False, torch.float32)):  # CUDA: bf16 where the GPU has it
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda s=supported: s)
        assert runtime.resolve_dtype("auto", torch.device("cuda"), matmul)[0] == dtype


def test_the_bf16_probe_is_measured_once_per_machine_and_shape_and_then_remembered(monkeypatch, tmp_path):
    """Kept on disk so a resume never flips it (timings swing 0.02x-20x); the real probe leaves the global RNG be."""
    state = torch.get_rng_state()
    ratios = {runtime.cpu_bf16_speedup(rows, width) for rows, width in ((64, 32), (256, 64))}
    assert all(r > 0 for r in ratios) and len(ratios) == 2 and torch.equal(torch.get_rng_state(), state)
    monkeypatch.setattr(runtime.timeit, "timeit", lambda fn, number: 2.0 if fn().dtype == torch.float32 else 1.0)
    assert runtime.cpu_bf16_speedup(64, 32) == 2.0  # float32's time over bf16's
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured, cpu = [], torch.device("cpu")
    monkeypatch.setattr(runtime, "cpu_bf16_speedup", lambda rows, width: measured.append(rows) or 3.0)
    first = runtime.resolve_dtype("auto", cpu, (768, 128))
    monkeypatch.setattr(runtime, "cpu_bf16_speedup", lambda rows, width: measured.append(rows) or 0.5)
    assert runtime.resolve_dtype("auto", cpu, (768, 128)) == first and first[0] == torch.bfloat16 and measured == [768]
    assert "3.00x" in first[1] and str(tmp_path / "gpt-char" / "probes.json") in first[1]
    assert runtime.resolve_dtype("auto", cpu, (1536, 128))[0] == torch.float32 and measured == [768, 1536]  # new shape
    monkeypatch.setattr(torch, "get_num_threads", lambda: 99)  # another thread count times differently: measured anew
    assert runtime.resolve_dtype("auto", cpu, (768, 128))[0] == torch.float32 and measured == [768, 1536, 768]
    read = Path.read_text  # VMs name a Zen 1 and a Zen 3 alike: the family tells them apart
    for family in (23, 25, 23):
        info = f"processor\t: 0\nmodel name\t: Test EPYC\ncpu family\t: {family}\nmodel\t\t: 1\n\nprocessor\t: 1\n"
        monkeypatch.setattr(Path, "read_text", lambda p, *a, i=info: i if str(p) == "/proc/cpuinfo" else read(p, *a))
        runtime.resolve_dtype("auto", cpu, (768, 128))
    assert measured == [768, 1536, 768, 768, 768], measured


@pytest.mark.parametrize("kept, warm, steps, want", [(None, 0, 10**5, 0), (RUNS, 0, 10**5, 1), (RUNS, 0, 2000, 0),
    (RUNS, 1, 2000, 1), ({**RUNS, "warm_s": 20.0}, 1, 2000, 0), ({**RUNS, "warm_s": 1.0}, 0, 2000, 0),
    ({"eager": [40.0], "compiled": [41.0], "cold_s": 1.0}, 1, 10**6, 0),
    ({"eager": [44.0], "compiled": [33.0], "warm_s": 1.0}, 0, 2000, 0),
    ({"eager": [93.2, 91.2, 90.3], "compiled": [97.7, 86.1], "cold_s": 63.0, "warm_s": 3.7}, 1, 2000, 0),
    ({"eager": [93.2, 91.2, 90.3], "compiled": [97.7, 60.0, 96.0], "cold_s": 63.0, "warm_s": 3.7}, 1, 2000, 0)],
    ids=["never-measured", "pays", "cold-too-dear", "warm-cache-unmeasured", "warm-compile-too-dear",
         "cache-wiped-so-cold-too-dear", "no-gain", "cold-never-measured", "one-lucky-run",  # a Zen 1 EPYC's figures
         "one-very-lucky-run"])  # its mean would compile: 2000 steps "save" 14 s against twice a 3.7 s compile
def test_auto_compile_on_a_cpu_follows_measured_runs_of_the_shape(monkeypatch, tmp_path, kept, warm, steps, want):
    for name in ("XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR"):  # probes.json; inductor's cache and the markers
        monkeypatch.setenv(name, str(tmp_path))
    cfg, cpu = TrainConfig(), torch.device("cpu")
    runtime.remembered(runtime.speed_key(cfg), update=lambda _: kept)
    if warm:
        runtime.compiled_here(cfg).touch()
    use, why = runtime.resolve_compile("auto", cpu, cfg, steps)
    assert use == want and why.startswith("auto: ") and ("warm" in why) == bool(warm and kept), why
    if kept == RUNS and not warm:  # which figure is which, what the steps save, what compiling costs
        assert why == f"auto: compiled 33 vs eager 44 ms/step here (1 and 1 runs), {steps} steps save " \
            f"{steps * 11 / 1000:.0f} s, a cold compile took 55 s", why
    assert runtime.resolve_compile("false", cpu, cfg, steps, kept="true") == (False, "as configured")  # not a resume's
    assert runtime.resolve_compile("auto", cpu, cfg, steps, kept="false") == (False, runtime.KEPT)  # a resume's own
    others = dict(n_layer=2, n_head=4, n_embd=192, block_size=128, batch_size=8, gradient_accumulation_steps=2,
                  dtype="bfloat16", attn_backend="sdpa", pos_emb="rope", qk_norm=True, attn_window=8, doc_mask=True,
                  optimizer="muon", dropout=0.1, bias=True)  # each changes a step's work: not measured
    for name, value in others.items():
        assert not runtime.resolve_compile("auto", cpu, cfg.replace(**{name: value}), steps)[0], name
    assert runtime.resolve_compile("auto", torch.device("cuda"), cfg, steps)[0] is True
    assert runtime.resolve_compile("auto", torch.device("mps"), cfg, steps) == (False, "auto: mps")


def test_a_cpu_run_remembers_its_speed_and_a_resumed_run_keeps_its_compile_choice(monkeypatch, tmp_path):
    """A CPU run of >= 20 steps (in this run) records its ms/step (eager, compiled: the last RECENT runs' of each) and
    its compile's seconds (marked warm for that torch only); a run that auto compiled resumes compiled."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    shapes = set()  # what the compiled model is given: one batch shape, so one graph (an eval's too)
    monkeypatch.setattr(torch, "compile", lambda m: (m.register_forward_pre_hook(lambda _, a: shapes.add(a[0].shape)),
                                                     EAGER(m))[1])
    cfg = tiny_config(tmp_path, max_iters=20, eval_interval=8, exact_val=False, tensorboard=False)
    runs = [train.train(cfg.replace(out_dir=str(tmp_path / f"{choice}{i}"), compile=choice), verbose=False)
            for i, choice in enumerate(("false", "true", "true"))]  # the second compile finds inductor's cache: warm
    assert shapes == {(cfg.batch_size, cfg.block_size)}, shapes
    kept = runtime.remembered(key := runtime.speed_key(cfg.replace(dtype="float32")))[0]
    assert kept.keys() == {"eager", "compiled", "cold_s", "warm_s"} and kept["warm_s"] >= 0 < kept["cold_s"], kept
    assert (kept["eager"], kept["compiled"]) == ([runs[0]["ms_per_step_median"]],
                                                 [runs[1]["ms_per_step_median"], runs[2]["ms_per_step_median"]])
    for ms in range(1, runtime.RECENT + 1):  # only the last RECENT of a kind are weighed
        runtime.record_speed(cfg.replace(dtype="float32", compile="false"), runs[0] | {"ms_per_step_median": ms})
    assert runtime.remembered(key)[0]["eager"] == list(range(1, runtime.RECENT + 1))
    kept = runtime.remembered(key)[0]
    for odd in ({"interrupted": "SIGINT"}, {"steps_this_run": 2}):  # stopped (a busy machine?); a resume's few steps
        runtime.record_speed(cfg.replace(dtype="float32", compile="false"), runs[0] | {"ms_per_step_median": 1e3} | odd)
        assert runtime.remembered(key)[0] == kept, f"the speed of a run with {odd} was kept"
    with monkeypatch.context() as patch:  # another torch's compile starts cold
        marker = runtime.compiled_here(cfg)
        patch.setattr(torch, "__version__", "0.0-another")
        assert runtime.compiled_here(cfg) != marker
    runtime.remembered(key, update=lambda k: k | {"compiled": 1e9})  # compiling loses here: only a kept choice compiles
    real, auto = runtime.resolve_compile, cfg.replace(out_dir=str(tmp_path / "auto"), compile="auto")
    for says, run in ((True, auto.replace(max_iters=8)), (False, auto.replace(resume=True))):
        # what the measured speeds say, faked (compile, then not); what a resume keeps, real
        monkeypatch.setattr(runtime, "resolve_compile", lambda *a, says=says: real(*a) if a[4] not in (None, "auto")
                            else (says, ""))
        summary = train.train(run, verbose=False)
    assert summary["steps_this_run"] == 12 and json.loads((tmp_path / "auto" / "config.json").read_text())["compile"]


def test_the_summarys_speed_figures_are_those_of_its_progress_lines(tmp_path, capsys, monkeypatch):
    """The median ms/step (what compile='auto' weighs, with compile_seconds: this run's, not what earlier runs in
    the process compiled) and the last line's MFU; the tokens of 9 steps count each one's 2 micro-batches of 4 x 16, and
    a resumed run's figures its own steps only.
    MFU's peaks: of the GPUs named, not their variants."""
    monkeypatch.setattr(runtime, "compile_time", itertools.count(100.0, 63.0).__next__)  # this process's so far
    cfg = tiny_config(tmp_path, max_iters=9, log_interval=2, peak_tflops=1.0, gradient_accumulation_steps=2, **QUICK)
    summary, out = train.train(cfg), capsys.readouterr().out
    lines = re.findall(r"step +(\d+) \|.*\| ([\d.]+) ms/step \| ([\d,]+) tok/s", out)
    steps, ms, tok_s = zip(*[(int(s), float(m), float(t.replace(",", ""))) for s, m, t in lines], strict=True)
    assert steps == (0, 2, 4, 6, 8) and summary["steps_this_run"] == 9 == summary["checkpoint_step"]
    per_step = np.repeat(ms, [1, 2, 2, 2, 2])  # each line's figure, once per step since the last line
    assert summary["ms_per_step_median"] == pytest.approx(np.median(per_step), abs=0.05)
    assert summary["compile_seconds"] == 63
    rss, status = summary["peak_memory_mb"]["cpu_rss_mb"], Path("/proc/self/status")  # peak RSS: Linux says it too
    hwm = int(re.search(r"VmHWM:\s+(\d+) kB", status.read_text())[1]) / 1024 if status.exists() else rss
    assert 50 < rss and rss == pytest.approx(hwm, rel=0.5)  # MB of a process with torch loaded, not KiB or GB
    flops = GPT(cfg.model_config(len(set(TEXT)))).flops_per_token(cfg.block_size)
    assert summary["mfu"] == pytest.approx(flops * tok_s[-1] / 1e12, rel=1e-3)
    assert summary["tokens_per_second"] * summary["train_seconds"] == pytest.approx(9 * 2 * 4 * 16)
    s = summary  # the end: what the run reached (no exact val here); and a run of seconds is not told to switch recipes
    assert f"\ndone: 9 steps in {format_duration(s['wall_seconds'])}, 63 s of it compiling " \
        f"({s['ms_per_step_median']:.1f} ms/step median, {s['tokens_per_second']:,.0f} tok/s over the run) | " \
        f"best val estimate {s['best_val_loss']:.4f}\n" in out
    assert "GPU-sized" not in out and s["last_val_estimate"] == s["history"][-1]["val_loss"]
    for h in s["history"]:  # each eval's line: its own two estimates, each in its place
        assert f"step {h['step']}: train loss {h['train_loss']:.4f}, val loss {h['val_loss']:.4f} (" in out, h
    resumed, out = train.train(cfg.replace(resume=True, max_iters=13)), capsys.readouterr().out  # 4 steps of its own
    tok_s = [float(t.replace(",", "")) for t in re.findall(r"step +\d+ \|.*\| ([\d,]+) tok/s", out)]
    assert resumed["mfu"] == pytest.approx(flops * tok_s[-1] / 1e12, rel=1e-3), "a resumed run's speed counts old steps"
    assert resumed["tokens_per_second"] * resumed["train_seconds"] == pytest.approx(4 * 2 * 4 * 16)
    for name, peak in [("H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", None), ("H200 NVL", None), ("T4", None),
                       ("NVIDIA A100-SXM4-80GB", 312e12)]:  # data sheets' dense bf16
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert runtime.peak_flops(torch.device("cuda")) == peak, name
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a rank > 0 on a terminal: no bar, no lines, no files
    (rank_dir := tmp_path / "rank1").mkdir()  # ranks share out_dir: rank 0's summary.json is the only one
    log, marks = RunLog(cfg.replace(out_dir=str(rank_dir)), 1, None, 0, False), [(1, .01), (3, .014), (5, .03)]
    assert not log.interactive and log.bar.disable
    bar = RunLog(cfg.replace(tensorboard=False), 1, None, 5).bar  # on a terminal, a resumed run's: from its step
    assert (bar.n, bar.total, bar.disable) == (5, cfg.max_iters, False)
    bar.close()
    capsys.readouterr()
    facts = {"params": 1, "device": "cpu", "dtype": "float32", "world_size": 1}
    ended = log.summary(facts, [], marks, 5, .03, final_val_loss=None, best_val_loss=math.inf, steps=5,
                        wall_seconds=1.0, compile_seconds=0.0, checkpoint_step=None)
    assert ended["ms_per_step_median"] == pytest.approx(8)  # of 10, 2 and 8 ms a step
    marks = [(1, 0.6), (501, 0.6 + 500 * .004)]  # step 0 compiling: 600 ms, then 4 ms each (log_interval=500)
    assert log.summary(facts, [], marks, 501, marks[-1][1], final_val_loss=None)["ms_per_step_median"] == \
        pytest.approx(4)  # not 302, halfway
    log.finish(ended, 5, None)
    assert not any(rank_dir.iterdir()) and capsys.readouterr() == ("", "")
    assert [format_duration(s) for s in (89, 90, 3725, 5400, 172799, 172800)] == ["89 s", "2 min", "62 min", "2 h",
                                                                                "48 h", "2 days"]


def test_the_duration_estimate_is_one_forwards_time_by_the_forwards_the_run_then_makes(tmp_path, monkeypatch):
    """Forwards of a (B, T) batch, counted as the run makes them: a training forward with its backward as 3, an eval's
    or the exact val's as 1. A fresh run, then one resumed from its step 3 (only the steps left count)."""
    tokens, estimates, forward, estimate = [], [], GPT.forward, train.estimated_seconds
    monkeypatch.setattr(GPT, "forward", lambda self, idx, *a, **k: tokens.append(
        idx.numel() * (3 if torch.is_grad_enabled() else 1)) or forward(self, idx, *a, **k))
    monkeypatch.setattr(train.timeit, "Timer", lambda fn: type("Timer", (), {"autorange": lambda _: (4, 2.0)})())
    monkeypatch.setattr(train, "estimated_seconds", lambda run: estimates.append((estimate(run), len(tokens))) or
                        estimates[-1][0])
    for iters, resume in ((3, False), (6, True)):
        tokens.clear()
        cfg = tiny_config(tmp_path, max_iters=iters, resume=resume, gradient_accumulation_steps=2, tensorboard=False,
                          exact_val=True)
        train.train(cfg, verbose=True)
        (seconds, per_forward), warm_up = estimates[-1]
        assert per_forward == 0.5 and warm_up == 1  # 2.0 s over 4 timed forwards, after one untimed
        made = sum(tokens[warm_up:]) / (cfg.batch_size * cfg.block_size)
        assert seconds / per_forward == pytest.approx(made, abs=0.05), (iters, made)  # the exact val's last target


def test_the_training_clock_counts_a_stopped_runs_last_steps_but_not_the_duration_estimate(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "estimated_seconds", lambda run: time.sleep(2) or (1.0, 0.1))
    monkeypatch.setattr(train, "get_batch", lambda *a, real=train.get_batch, **k: time.sleep(0.05) or real(*a, **k))
    summary = ctrl_c_in_batch(9, tiny_config(tmp_path, max_iters=50, **QUICK | {"eval_interval": 4}))  # evals: 0, 4, 8
    assert summary["steps"] == 9 and 0.4 < summary["train_seconds"] < 2, summary["train_seconds"]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_training_steps_between_log_steps_never_read_a_tensor_on_the_host(tmp_path, monkeypatch, optimizer):
    """A GPU host read waits for all queued work: of 12 steps logged every 4th, only log and eval steps may read
    (additive_mask's check of a CPU mask excepted: GPU masks skip it), and log steps do (the recording works)."""
    current, reads, real_set_lr = {"step": None}, {}, train.set_lr
    monkeypatch.setattr(train, "set_lr", lambda optimizers, step, cfg: current.update(step=step) or
                        real_set_lr(optimizers, step, cfg))  # set_lr is called first thing in every step

    def recording(name: str, real):
        def read(self, *args, **kwargs):
            if current["step"] is not None and sys._getframe(1).f_code.co_name != "additive_mask":
                reads.setdefault(current["step"], []).append(name)
            return real(self, *args, **kwargs)
        return read
    for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, recording(name, getattr(torch.Tensor, name)))
    train.train(tiny_config(tmp_path, optimizer=optimizer, max_iters=12, log_interval=4, gradient_accumulation_steps=2,
                            grad_clip=1.0, **QUICK), verbose=False)
    quiet = {step: names for step, names in reads.items() if step not in {0, 4, 8, 11, 12}}
    assert not quiet and {4, 8, 11} <= reads.keys(), reads


def test_the_training_forward_compiles_to_one_graph_with_dropout_and_dynamic_shapes():
    """No graph break (a host read, a data-dependent branch) splits a compiled step: fullgraph=True would raise."""
    torch.manual_seed(0)
    model = C.leak_test_model("manual", pos_emb="rope", qk_norm=True, dropout=0.1).float().train()
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)
    for batch in (2, 3):
        x = torch.randint(13, (batch, 10))
        _, loss = compiled(x, x)
        loss.backward()
        assert torch.isfinite(loss)
