"""Train a character-level GPT: python train.py [CONFIG.toml] [--field=value ...], or under torchrun (DDP).

`train` reads top to bottom: set-up, then per step lr -> eval/checkpoint -> forward/backward/step -> checks -> log,
then the exact val loss and the summary. `Run` holds what the steps share; each step's pieces are the functions below
it, in this file, which takes its batch from data/corpus.py and its forward from model/.
"""

import contextlib
import math
import os
import shutil
import sys
import time
import timeit
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

import training.checkpoint as checkpoint
import training.runtime as runtime
from data import SEPARATOR, CharTokenizer, check_split_sizes, get_batch, load_corpus
from model import GPT
from training import Stopped, TrainConfig, estimate_loss, exact_loss, parse_args, print_help, resolve_device
from training.config import parse_values
from training.distributed import Dist, close_distributed, init_distributed, launched_by_torchrun
from training.evaluate import evaluating
from training.faults import RunGuard, exit_code, signal_name
from training.log import RunLog, bpc, format_duration, step_ms
from training.optim import configure_optimizers
from training.visualize import prompt_attention, render_attention

CONFIGS = Path(__file__).resolve().parent / "configs"
LONG_RUN_SECONDS = 15 * 60  # a longer estimate without CUDA suggests the fast CPU recipe
EVAL_TOKENS_PER_FORWARD = 4096  # fastest inference batch on a CPU (RESULTS.md)
ATTENTION_CHARS = 32  # TensorBoard's attention maps: 32 x 32 cells stay readable
# user or machine errors: one line, exit status 1, no traceback
RUN_ERRORS = (ValueError, FloatingPointError, ConnectionError, ImportError, OSError)
NO_STEP = 2**62  # "no bad step yet": above any step, so a MIN over ranks keeps real ones


@dataclass
class Run:
    """What the steps of one run share (set up by `set_up`)."""

    cfg: TrainConfig
    dist: Dist
    guard: RunGuard
    log: RunLog
    tok: CharTokenizer
    model: GPT  # the plain module: saves and the exact val use it
    fwd: Any  # what trains: the model, compiled and/or wrapped in DDP
    optimizers: list[torch.optim.Optimizer]
    scaler: torch.amp.GradScaler
    batch_gen: torch.Generator
    splits: dict[str, Tensor]  # "train", "val": (N,) token ids on the device
    micro_steps: int  # this rank's micro-batches per optimizer step
    autocast: Any
    start: int  # the step it starts (or resumes) at
    saved: int | None  # the step ckpt.pt holds (None: none yet)
    facts: dict
    t_start: float
    compiled_before: float  # compile seconds at set-up: what earlier runs in this process compiled
    best_val: float
    history: list[dict]
    first_bad: Tensor  # () int64 on the device: the step of the first non-finite loss, NO_STEP before one
    bad_loss: Tensor  # () float32 on the device: that loss
    # the training clock (stopped for evals and saves) and this run's steps: (steps, clock seconds) at log steps
    train_seconds: float = 0.0
    mark: float = 0.0  # when the clock last started: set_up's end, then each pause's
    steps: int = 0
    marks: list[tuple[int, float]] = field(default_factory=list)


def train(cfg: TrainConfig, argv: list[str] | None = None, verbose: bool = True) -> dict:
    """Run cfg, one rank under torchrun; returns summary.json's dict. verbose=False: no output, so no summary.json or
    TensorBoard events either (config.json and checkpoints are written)."""
    t_start = time.perf_counter()
    dist = init_distributed(os.environ, cfg.device)
    # never into another run's folder, unless asked; rank 0, the one that writes, claims it
    out_dir, moved, fresh = checkpoint.run_folder(cfg, claim=dist.is_main)
    cfg, done = cfg.replace(out_dir=str(out_dir)), 0
    guard = RunGuard(out_dir / checkpoint.CKPT_NAME, dist.enabled, announce=verbose and dist.is_main)
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    run = None
    try:
        run = set_up(cfg, dist, guard, argv or [], verbose, t_start, moved)
        if dist.device.type != "cuda" and run.log.enabled:
            announce_duration(run, argv or [])
        run.mark = time.perf_counter()  # the training clock starts here, after the estimate's timing
        cfg = run.cfg  # with dtype and compile decided
        guard.arm()
        stop, done = None, run.start  # stopping signal; steps done
        for step in range(run.start, cfg.max_iters + 1):
            last_step = step == cfg.max_iters
            lr = set_lr(run.optimizers, step, cfg)
            if (step % cfg.eval_interval == 0 or last_step) and dist.is_main:
                stop = evaluate(run, step)
            if stop is not None or last_step:  # the eval's stop signal (a poll's breaks below), or the end
                break
            loss, grad_norm = train_step(run, step)
            if step == run.start:
                guard.arm()  # again: the first step compiled, and a compiler may have put in handlers of its own
            done = step + 1
            log_step = step % cfg.log_interval == 0 or step == cfg.max_iters - 1
            stop = check_step(run, sync=log_step)  # raises on a non-finite loss
            log_progress(run, step, loss, lr, grad_norm, log_step)
            if stop is not None:
                break
        return finish(run, done, stop)
    except (KeyboardInterrupt, Exception) as e:
        if fresh is not None and not done and dist.is_main:  # a retry then takes the same folder, not NAME-2, ...
            if run is not None and run.log.writer is not None:
                run.log.writer.close()  # else its thread writes the events file back into the folder, or fails
            if fresh:
                shutil.rmtree(out_dir, ignore_errors=True)
            else:  # the user's empty folder: empty again
                for path in [out_dir / "config.json", *out_dir.glob("events.out.tfevents.*")]:
                    path.unlink(missing_ok=True)
        kept = guard.kept(run.saved if run else None)
        if isinstance(e, KeyboardInterrupt):  # a second Ctrl-C: say what is on disk
            raise KeyboardInterrupt(kept) from None
        e.add_note(f"the run stopped at this error, saving nothing: {kept}")  # under a bug's traceback too
        raise
    finally:
        guard.disarm()
        close_distributed(dist)
        if deterministic != (torch.are_deterministic_algorithms_enabled(),
                             torch.is_deterministic_algorithms_warn_only_enabled()):  # its import: not under a Ctrl-C
            torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


def set_up(cfg: TrainConfig, dist: Dist, guard: RunGuard, argv: list[str], verbose: bool, t_start: float,
           moved: str | None) -> Run:
    """Everything that can fail before out_dir is written (corpus, sizes, resume, dtype and compile: a resume keeps
    its run's), then the model, optimizers, resumed state, config.json and the first lines."""
    device = dist.device
    micro_steps = dist.micro_steps(cfg.gradient_accumulation_steps)  # per rank, same global batch; or refused
    corpus = load_corpus(cfg.dataset, cfg.split, cfg.text_column, cfg.documents)
    check_split_sizes(corpus, cfg.block_size)
    tok = corpus.tokenizer
    if cfg.doc_mask and SEPARATOR not in tok.stoi:
        raise ValueError(f"doc_mask=true needs documents, and {corpus.name} is one text: give --documents=lines "
                         "(or paragraphs), a folder of files or an hf: dataset")
    model_cfg = cfg.model_config(tok.vocab_size, tok.stoi[SEPARATOR] if cfg.doc_mask else None)
    ckpt = checkpoint.checkpoint_to_resume(cfg, model_cfg, tok, device) if cfg.resume else None
    kept = ckpt["config"] if ckpt else {}  # a resume keeps its run's dtype and compile
    dtype, dtype_why = runtime.resolve_dtype(cfg.dtype, device, (cfg.batch_size * cfg.block_size, cfg.n_embd),
                                             kept.get("dtype"))
    cfg = cfg.replace(dtype=str(dtype).removeprefix("torch."))  # what ran
    use_compile, compile_why = runtime.resolve_compile(cfg.compile, device, cfg, cfg.max_iters, kept.get("compile"))
    cfg = cfg.replace(compile=str(use_compile).lower())
    if use_compile and device.type == "cpu":  # inductor's CPU embedding backward adds atomically, in any order
        torch.use_deterministic_algorithms(True, warn_only=True)  # read as it compiles; train() restores it
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    # data (int32: half of int64), model, optimizers, resumed state
    splits = {name: torch.from_numpy(getattr(corpus, name).astype(np.int32)).to(device) for name in ("train", "val")}
    torch.manual_seed(cfg.seed)
    batch_gen = torch.Generator(device=device).manual_seed(cfg.seed)
    model = checkpoint.model_from_checkpoint(ckpt, device, dropout=cfg.dropout, attn_backend=cfg.attn_backend)[0] \
        if ckpt else GPT(model_cfg).to(device)
    optimizers = configure_optimizers(model, cfg)
    start, best_val, history = checkpoint.restore(ckpt, optimizers, batch_gen, device)
    if not dist.is_main:  # a checkpoint holds rank 0's streams
        torch.manual_seed(dist.seed(cfg.seed, start))
        batch_gen.manual_seed(dist.seed(cfg.seed, start))
    fwd = dist.wrap(torch.compile(model) if use_compile else model)  # saves use `model`
    facts = {"config": cfg.to_dict(), "run": runtime.run_facts(argv), "device": str(device), "dtype": cfg.dtype,
             "compile": use_compile, "params": model.num_params(), "corpus": corpus.name, "world_size": dist.world_size}
    if dist.is_main:
        checkpoint.prepare_run_folder(cfg, facts)
    log = RunLog(cfg, model.flops_per_token(cfg.block_size), runtime.peak_flops(device, cfg.peak_tflops), start,
                 enabled=verbose and dist.is_main)
    log.line(f"{corpus.name}: {len(corpus.train):,} train / {len(corpus.val):,} val tokens, {tok.vocab_size} symbols "
             f"| {model.num_params() / 1e6:.2f}M params | {device} {cfg.dtype} ({dtype_why}) | "
             f"{'compiled' if use_compile else 'eager'} ({compile_why})"
             + (f" | resumed at step {start}" if ckpt else "")
             + (f" | {dist.world_size} processes" if dist.enabled else ""))
    if moved:
        log.line(f"note: {moved}")
    changed = [f"{k} {kept[k]} -> {v}" for k, v in cfg.to_dict().items()
               if k not in ("resume", "max_iters", "out_dir") and kept.get(k, v) != v]  # config.json keeps only the new
    if changed:
        log.line(f"note: resumed with {', '.join(changed)}")
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    autocast = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    run = Run(cfg, dist, guard, log, tok, model, fwd, optimizers, scaler, batch_gen, splits, micro_steps, autocast,
              start, start if ckpt else None, facts, t_start, runtime.compile_time(), best_val, history,
              first_bad=torch.tensor(NO_STEP, device=device), bad_loss=torch.zeros((), device=device))
    return run


def announce_duration(run: Run, argv: list[str]) -> None:
    """Without CUDA: the run's estimated duration here, and the CPU recipe's command for a GPU-sized one."""
    cfg = run.cfg
    seconds, forward = estimated_seconds(run)
    run.log.line(f"estimated duration on this machine: {format_duration(seconds)} (one forward of a "
                 f"{cfg.batch_size}x{cfg.block_size} batch: {forward:.2g} s)")  # .2g: 0.00043 s, not 0.00 s
    if seconds > LONG_RUN_SECONDS and not (argv and Path(argv[0]).name == "shakespeare_char_cpu_fast.toml"):
        fast = os.path.relpath(CONFIGS / "shakespeare_char_cpu_fast.toml")
        run.log.line(f"this is a GPU-sized run for this machine; for a run of minutes: python train.py {fast}")


@torch.no_grad()
def estimated_seconds(run: Run) -> tuple[float, float]:
    """(the run's seconds here, seconds per forward), timed on a zero batch (B, T)."""
    cfg = run.cfg
    x = torch.zeros(cfg.batch_size, cfg.block_size, dtype=torch.long, device=run.dist.device)
    with evaluating(run.model), run.autocast:
        run.model(x)  # warm-up
        n, seconds = timeit.Timer(lambda: run.model(x)).autorange()  # >= 0.2 s: not one lucky slice of a busy machine
    steps = cfg.max_iters - run.start
    # a step costs 3 forwards (backward ~ 2), an eval 2 * eval_iters
    forwards = 3 * steps * cfg.gradient_accumulation_steps + 2 * (steps // cfg.eval_interval + 1) * cfg.eval_iters
    forwards += cfg.exact_val * len(run.splits["val"]) / (cfg.batch_size * cfg.block_size)
    return seconds / n * forwards, seconds / n


def lr_at(step: int, cfg: TrainConfig) -> float:
    """lr of 0-based `step`: linear warmup, then cosine (or wsd) decay to min_lr at lr_decay_iters."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    if cfg.lr_schedule == "wsd":
        start = max(cfg.warmup_iters, cfg.lr_decay_iters * (1 - cfg.cooldown_frac))
        progress = max(0.0, step - start) / max(1.0, cfg.lr_decay_iters - start)  # 0 while stable
        return cfg.learning_rate + progress * (cfg.min_lr - cfg.learning_rate)
    progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def set_lr(optimizers: list[torch.optim.Optimizer], step: int, cfg: TrainConfig) -> float:
    """Set every group's lr, scaled by its optimizer's peak; returns AdamW's (the logged one)."""
    lr = lr_at(step, cfg)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = opt.defaults["lr"] * lr / cfg.learning_rate
    return lr


def evaluate(run: Run, step: int) -> int | None:
    """Estimate both losses, log them and a snapshot, save when val improves; the stop signal if one came."""
    cfg, device = run.cfg, run.dist.device
    group = 1 if cfg.compile == "true" else max(1, EVAL_TOKENS_PER_FORWARD // (cfg.batch_size * cfg.block_size))
    with paused(run):
        try:
            losses = estimate_loss(run.fwd, run.splits, cfg, device, autocast=run.autocast, batches_per_forward=group,
                                   stop=run.guard.stopping, show=run.log.enabled)
        except Stopped:  # the estimate is dropped
            return run.guard.signum
        if not (math.isfinite(losses["train"]) and math.isfinite(losses["val"])):
            check_finite(run)  # raises first if a train loss was non-finite
            raise not_finite(run, f"the loss estimate at step {step} is not finite ({losses}); stopped without saving")
        if run.history and run.history[-1]["step"] == step:  # the resumed step's, evaluated again
            run.history.pop()
        run.history.append(run.log.evaluation(step, losses, run.train_seconds, time.perf_counter() - run.t_start))
        snapshot(run, step)
        if losses["val"] < run.best_val or cfg.always_save_checkpoint:
            run.best_val = min(run.best_val, losses["val"])
            if step > run.start:  # not the state resumed from (a fresh run starts at 0)
                save(run, step)
    return None


def snapshot(run: Run, step: int) -> None:
    """TensorBoard's view of the model at an eval: a text sample (own generator), each layer's attention maps."""
    cfg, model, chars, writer, device = run.cfg, run.model, run.tok.chars, run.log.writer, run.dist.device
    if writer is None:
        return
    if cfg.sample_tokens > 0:
        start = next((chars.index(c) for c in (SEPARATOR, "\n") if c in chars), 0)  # a new document, or line
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        with evaluating(model):
            new = model.stream(torch.tensor([[start]], device=device), cfg.sample_tokens, generator=gen)
            text = (chars[start] + "".join(chars[int(t)] for t in new)).replace(SEPARATOR, "\n")
        writer.add_text("sample", "\n".join("    " + s for s in text.split("\n")), step)  # verbatim
    ids = run.splits["val"][:min(ATTENTION_CHARS, cfg.block_size)].tolist()
    for layer, weights in enumerate(prompt_attention(model, ids)):
        image = render_attention([weights], [chars[i] for i in ids], [layer])
        writer.add_image(f"maps/attention_layer_{layer}", image, step, dataformats="HWC")


def train_step(run: Run, step: int) -> tuple[Tensor, Tensor | None]:
    """One optimizer step over gradient_accumulation_steps micro-batches: (last micro-batch's loss (), grad norm ()
    or None without a clip), on the device."""
    cfg, scaler, micro_steps = run.cfg, run.scaler, run.micro_steps
    for micro in range(micro_steps):
        x, y = get_batch(run.splits["train"], cfg.batch_size, cfg.block_size, run.batch_gen, run.dist.device)
        sync = not run.dist.enabled or micro == micro_steps - 1  # DDP all-reduces in the last backward only
        with contextlib.nullcontext() if sync else run.fwd.no_sync():
            with run.autocast:
                _, loss = run.fwd(x, y)
            scaler.scale(loss / micro_steps).backward()
        # the first non-finite loss, kept on the device: no host read per step
        bad = ~torch.isfinite(loss.detach()) & (run.first_bad == NO_STEP)
        run.first_bad = torch.where(bad, step, run.first_bad)
        run.bad_loss = torch.where(bad, loss.detach().float(), run.bad_loss)
    grad_norm = None
    if cfg.grad_clip > 0:
        for opt in run.optimizers:
            scaler.unscale_(opt)  # clip the true gradients
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
    for opt in run.optimizers:
        scaler.step(opt)
        opt.zero_grad(set_to_none=True)
    scaler.update()
    return loss, grad_norm


def check_step(run: Run, sync: bool) -> int | None:
    """At a step's end: raise if a loss was non-finite, else the signal to stop for or None. It reads the device at
    `sync` steps only (and once a signal came); distributed, the ranks agree on both there."""
    signum = run.guard.signum
    if not run.dist.enabled:
        if sync or signum is not None:
            raise_if_bad(run, run.first_bad.item(), local=True)
        return signum
    if not sync:
        return None
    flags = torch.stack([run.first_bad, torch.tensor(-(signum or 0), device=run.first_bad.device)])
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)  # the first bad step, any signal
    first_bad, signum = flags.tolist()
    raise_if_bad(run, first_bad, local=first_bad == run.first_bad.item())
    return -signum or None


def raise_if_bad(run: Run, first_bad: int, local: bool) -> None:
    """FloatingPointError if step first_bad had a non-finite loss (local: this rank's, whose value it names)."""
    if first_bad != NO_STEP:
        what = f"loss is {run.bad_loss.item()}" if local else "loss is not finite (on another rank)"
        raise not_finite(run, f"{what} at step {first_bad}; stopped without saving anything from that step on")


def log_progress(run: Run, step: int, loss: Tensor, lr: float, grad_norm: Tensor | None, log: bool) -> None:
    """After each step: the bar and the lr; at log steps (the only host reads of loss and grad_norm, () tensors) the
    progress line and scalars."""
    out = run.log
    run.steps += 1
    out.bar.update()
    scalars = {"optim/lr": lr}  # every step: a sparse, smoothed lr draws humps the schedule lacks
    if log:
        loss_f, seconds = loss.item(), run.train_seconds + time.perf_counter() - run.mark
        run.marks.append((run.steps, seconds))
        tok_s, mfu = out.speed(run.steps, seconds)
        text = (f"loss {loss_f:.4f} ({bpc(loss_f):.3f} bpc) | lr {lr:.2e} | "
                f"{step_ms(run.marks[-2:])[-1]:.1f} ms/step | {tok_s:,.0f} tok/s")  # ms: since the last log step
        if out.interactive:
            out.bar.set_postfix_str(text, refresh=False)
        else:
            out.line(f"step {step:6d} | {text}")
        scalars |= {"loss/train": loss_f, "speed/tokens_per_second": tok_s}
        if mfu is not None:
            scalars["speed/mfu"] = mfu
        if grad_norm is not None:
            scalars["optim/grad_norm"] = grad_norm.item()
    out.scalars(step, scalars)  # to TensorBoard


@contextlib.contextmanager
def paused(run: Run) -> Iterator[None]:
    """The training clock stopped for the block (evals, saves)."""
    if run.dist.device.type == "cuda":
        torch.cuda.synchronize()  # queued step work is training time
    run.train_seconds += time.perf_counter() - run.mark
    try:
        yield
    finally:
        run.mark = time.perf_counter()


def save(run: Run, steps: int, **extra: str) -> None:
    """Checkpoint the state after `steps` steps (never a NaN one)."""
    check_finite(run)
    state = checkpoint.training_state(run.model, run.optimizers, run.cfg, run.tok, steps, run.best_val, run.batch_gen,
                                      run.history)
    checkpoint.save_checkpoint(run.guard.ckpt_path, {**state, **extra})
    run.saved = steps


def check_finite(run: Run) -> None:
    """Refuse to save after a non-finite loss or with non-finite weights."""
    raise_if_bad(run, run.first_bad.item(), local=True)
    if not torch.stack([torch.isfinite(p).all() for p in run.model.parameters()]).all():
        raise not_finite(run, "the model's weights are no longer finite; stopped without saving")


def not_finite(run: Run, what: str) -> FloatingPointError:
    """The error that stops a run at a non-finite value: what happened, what is on disk, what to try."""
    return FloatingPointError(f"{what}: {run.guard.kept(run.saved)}. Try a lower learning_rate or grad_clip > 0 "
                              "(in float16: dtype=bfloat16).")


def finish(run: Run, done: int, stop: int | None) -> dict:
    """The exact val loss (unless stopped), the save of a stopped run, the summary and its lines."""
    cfg, log, device, final_val = run.cfg, run.log, run.dist.device, None
    with paused(run):  # the clock stops: a stopped run's steps since its last eval count too
        if cfg.exact_val and stop is None and run.dist.is_main:
            try:
                windows = max(cfg.batch_size, EVAL_TOKENS_PER_FORWARD // cfg.block_size)
                final_val = exact_loss(run.model, run.splits["val"], cfg.block_size, windows, device,
                                       autocast=run.autocast, stop=run.guard.stopping, show=log.enabled)
                log.line(f"exact val loss over all {len(run.splits['val']) - 1:,} val targets: {final_val:.4f} "
                         f"({bpc(final_val):.3f} bpc)")
            except Stopped:
                stop = run.guard.signum
    run.guard.disarm()  # from here a Ctrl-C exits at once
    interrupted = None if stop is None else signal_name(stop)
    if interrupted and run.dist.is_main:
        save(run, done, interrupted=interrupted)
        log.line(f"interrupted by {interrupted} after {done} steps: saved {run.guard.ckpt_path} at step {done}; run "
                 "the same command with --resume to continue")
    summary = log.summary(run.facts, run.history, run.marks, run.steps, run.train_seconds, best_val_loss=run.best_val,
                          final_val_loss=final_val, steps=done, wall_seconds=time.perf_counter() - run.t_start,
                          compile_seconds=runtime.compile_time() - run.compiled_before,
                          interrupted=interrupted, checkpoint_step=run.saved)
    log.finish(summary, done, interrupted)
    if device.type == "cpu" and run.dist.is_main:
        runtime.record_speed(cfg, summary)
    return summary


def with_recipe(argv: list[str]) -> tuple[list[str], str | None]:
    """argv with this device's recipe prepended if it names no config, and a line saying which (or None)."""
    if argv and not argv[0].startswith("--"):
        return argv, None
    # the device alone: the overrides are checked against each other once on top of the recipe
    kind = resolve_device(TrainConfig(device=parse_values(argv).get("device", "auto")).device).type
    name, why = {"cuda": ("shakespeare_char_fast.toml", "the fast GPU recipe, for CUDA"),
                 "mps": ("shakespeare_char_cpu.toml", "nanoGPT's laptop recipe, for MPS")}.get(
        kind, ("shakespeare_char_cpu_fast.toml", "the fast CPU recipe: no CUDA GPU here"))
    on = ["--device=mps"] if kind == "mps" else []  # the laptop recipe names the CPU
    return [str(CONFIGS / name), *on, *argv], \
        f"no config given: training configs/{name}, {why} (pass a config to choose)"


def out_of_memory(e: BaseException) -> str | None:
    """For an allocation that failed (CUDA's OutOfMemoryError, the CPU allocator's RuntimeError): the way out."""
    text = str(e)
    if not (isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in text):
        return None
    at = text.lower().find("tried to allocate")  # both say what: "... tried to allocate N bytes. ..."
    return (f"out of memory ({text[at:].split('. ')[0] if at >= 0 else 'an allocation failed'}): make the run "
            "smaller: --batch_size (more --gradient_accumulation_steps keep the batch), --block_size, or the model")


def main(argv: list[str] | None = None) -> int:
    """Command line; returns exit status (0 done, 1 error, 128 + N stopped by signal N)."""
    argv = sys.argv[1:] if argv is None else argv
    runtime.reproducible_blas()
    if print_help(argv, TrainConfig):
        return 0
    quiet = launched_by_torchrun(os.environ) and os.environ.get("LOCAL_RANK") != "0"  # errors once per node
    try:
        argv, why = with_recipe(argv)
        cfg = parse_args(argv)
        if why and not quiet:
            print(why, flush=True)
        summary = train(cfg, argv)
    except (*RUN_ERRORS, RuntimeError) as e:
        said = str(e) if isinstance(e, RUN_ERRORS) else out_of_memory(e)
        if said is None:  # a RuntimeError that is a bug, not the machine's limit
            raise
        if not quiet:
            print(f"error: {said}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C in set-up, or a second one in the loop
        print(f"interrupted: exited at once without saving; {e or 'nothing was written'}", file=sys.stderr)
        return exit_code("SIGINT")
    return exit_code(summary["interrupted"]) if summary["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
