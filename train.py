"""Train a character-level GPT.

    python train.py [CONFIG.toml] [--field=value ...]     (python train.py --help lists the fields)

One function, `_train`, reads top to bottom: checks and set-up, then per step lr -> eval/checkpoint ->
forward/backward/update -> log, then the exact validation loss and summary.json. `train` wraps it
with what must be undone however it ends: the torchrun process group and the signal handlers.

    torchrun --nproc_per_node=N train.py CONFIG [--field=value ...]     (DistributedDataParallel)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from data import Corpus, check_split_sizes, get_batch, load_corpus, write_atomic
from model import GPT
from training import (
    CKPT_NAME,
    TrainConfig,
    autocast_context,
    check_resumable,
    configure_optimizer,
    discard_stdout,
    estimate_loss,
    exact_loss,
    help_text,
    load_checkpoint,
    model_from_checkpoint,
    parse_args,
    peak_flops,
    peak_memory_mb,
    remove_partial_saves,
    resolve_dtype,
    run_facts,
    save_checkpoint,
    set_lr,
)
from training.distributed import Dist, close_distributed, init_distributed, launched_by_torchrun
from training.faults import RunGuard, exit_code, signal_name
from training.monitor import RunLog, resolve_prompts
from training.optim import ParamGroupOptimizer

# Inference-only forwards (loss estimates, the exact val loss) take ~4k tokens at a time: fewer calls
# than the training batch, while tensors stay small enough to be reused rather than freshly mapped
# (measured fastest on a CPU; benchmarks/RESULTS.md).
EVAL_TOKENS_PER_FORWARD = 4096


def train(cfg: TrainConfig, argv: list[str] | None = None, verbose: bool = True) -> dict:
    """Run one training job as cfg describes; returns the summary also written to summary.json.

    Under torchrun this process is one rank of a DistributedDataParallel job (training/distributed.py);
    a plain run never creates a process group. SIGINT/SIGTERM handlers are installed for the loop
    only, and the previous ones are back when this returns (training/faults.py).

    Args:
        cfg: the run's configuration.
        argv: the command line it came from, recorded in config.json (None: not from a command line).
        verbose: print progress and write TensorBoard events (False: a silent run, as in tests).
    """
    dist = init_distributed(os.environ, cfg.device)
    guard = RunGuard(dist.device, Path(cfg.out_dir) / CKPT_NAME, dist.enabled, announce=verbose and dist.is_main)
    try:
        return _train(cfg, argv, verbose, dist, guard)
    finally:
        guard.disarm()
        close_distributed(dist)


def _train(cfg: TrainConfig, argv: list[str] | None, verbose: bool, dist: Dist, guard: RunGuard) -> dict:
    t_start = time.perf_counter()
    device = dist.device
    micro_steps = dist.micro_steps(cfg.gradient_accumulation_steps)  # per rank; the global batch stays
    dtype = resolve_dtype(cfg.dtype, device, matmul=(cfg.batch_size * cfg.block_size, cfg.n_embd))
    guard.float16 = dtype == torch.float16
    autocast = autocast_context(device, dtype)
    use_compile = cfg.compile == "true" or (cfg.compile == "auto" and device.type == "cuda")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls where autocast leaves float32
        torch.backends.cudnn.allow_tf32 = True
    out_dir = Path(cfg.out_dir)
    ckpt_path = out_dir / CKPT_NAME

    # --- every check that can fail, before anything is written to out_dir ---------------------
    if cfg.resume and not ckpt_path.exists():
        missing = "" if out_dir.is_dir() else f" (the directory {out_dir} does not exist)"
        raise ValueError(f"--resume: no checkpoint at {ckpt_path} to continue from{missing}; without --resume "
                         "the run starts afresh there")
    ckpt = load_checkpoint(ckpt_path, map_location=device) if cfg.resume else None
    with dist.rank_zero_first():  # rank 0 fills the encoded cache; the other ranks then read it
        corpus = load_corpus(cfg.dataset, cfg.cache_dir, cfg.split or None, cfg.text_column or None)
    check_split_sizes(corpus, cfg.block_size)
    if cfg.tensorboard:
        resolve_prompts(cfg, corpus)  # their characters must be in the vocabulary: checked now, not at step 0
    if ckpt is not None:
        check_resumable(ckpt, cfg.model_config(corpus.tokenizer.vocab_size), corpus.tokenizer)
        if ckpt["step"] > cfg.max_iters:
            raise ValueError(f"--resume: {ckpt_path} is at step {ckpt['step']}, past max_iters={cfg.max_iters}; "
                             f"give --max_iters > {ckpt['step']} to train on")
        # a finished run has nothing left to do; resuming it would only overwrite its summary.json with
        # a run of 0 steps. (One interrupted after its last step, or killed before its summary was
        # written, still has its final eval to do: that resume goes ahead.)
        if (ckpt["step"] == cfg.max_iters and not ckpt.get("interrupted")
                and (out_dir / "summary.json").exists()):
            raise ValueError(f"--resume: {ckpt_path} is at step {ckpt['step']} = max_iters: the run is finished "
                             f"and its figures are in {out_dir / 'summary.json'}; give --max_iters > "
                             f"{ckpt['step']} to train on")

    # --- data: encoded once, cached; both splits live on the training device (int32: half the
    # memory of int64; get_batch widens each batch to int64) -----------------------------------
    train_data = torch.from_numpy(corpus.train.astype(np.int32)).to(device)
    val_data = torch.from_numpy(corpus.val.astype(np.int32)).to(device)
    vocab_size = corpus.tokenizer.vocab_size

    # --- model, optimizer, and (on --resume) the state to continue from ----------------------
    torch.manual_seed(cfg.seed)
    batch_gen = torch.Generator(device=device).manual_seed(cfg.seed)
    if ckpt is not None:
        model, _ = model_from_checkpoint(ckpt, device, dropout=cfg.dropout, attn_backend=cfg.attn_backend)
    else:
        model = GPT(cfg.model_config(vocab_size)).to(device)
    optimizer = configure_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    start_step, best_val, history = 0, math.inf, []  # history: one entry per eval
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        start_step, best_val = ckpt["step"], ckpt["best_val_loss"]
        # the evals before the resumed step (checkpoints from before this field have none)
        history = [h for h in ckpt.get("history", []) if h["step"] < start_step]
        torch.set_rng_state(ckpt["rng"]["torch"].cpu())
        batch_gen.set_state(ckpt["rng"]["batch"].cpu())
        if device.type == "cuda" and "cuda" in ckpt["rng"]:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"].cpu(), device)
    if not dist.is_main:  # a checkpoint holds rank 0's streams: the others draw their own batches and dropout
        torch.manual_seed(dist.seed(cfg.seed, start_step))
        batch_gen.manual_seed(dist.seed(cfg.seed, start_step))
    fwd = torch.compile(model) if use_compile else model  # checkpoints always come from `model`
    ddp_fwd = dist.wrap(fwd)  # under torchrun: DDP, which averages the gradients across ranks

    facts = {"config": cfg.to_dict(), "run": run_facts(argv or []), "device": str(device),
             "dtype": str(dtype).removeprefix("torch."), "compile": use_compile,
             "params": model.num_params(), "vocab_size": vocab_size, "corpus": corpus.name,
             "world_size": dist.world_size}
    if dist.is_main:  # only rank 0 writes files
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file of that name, or a place the user cannot write
            raise ValueError(f"out_dir={cfg.out_dir}: cannot create it as a directory ({e.strerror}); "
                             "give another --out_dir") from None
        for written in (ckpt_path, out_dir / "config.json", out_dir / "summary.json"):
            remove_partial_saves(written)  # temporary files of writes that a killed run left behind
        write_atomic(out_dir / "config.json", json.dumps(facts, indent=2).encode())
    log = RunLog(out_dir, cfg.max_iters, start_step, cfg.tensorboard, enabled=verbose and dist.is_main)
    log.line(f"config: {json.dumps(cfg.to_dict())}")
    if ckpt is None and ckpt_path.exists():  # nothing of this run is saved before the loop
        log.line(f"note: {ckpt_path} is from an earlier run; this fresh run replaces it at its first save "
                 "(--resume continues it instead)")
    log.line(f"{corpus.name}: {len(corpus.train):,} train / {len(corpus.val):,} val tokens, "
             f"{vocab_size} symbols | {model.num_params() / 1e6:.2f}M params | {device} {facts['dtype']}"
             f"{' compiled' if use_compile else ''}" + (f" | resumed at step {start_step}" if ckpt else "")
             + (f" | {dist.world_size} processes" if dist.enabled else ""))

    # --- the loop ------------------------------------------------------------------------------
    tokens_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size
    flops_per_token, peak = model.flops_per_token(cfg.block_size), peak_flops(device, cfg.peak_tflops)
    splits = {"train": train_data, "val": val_data}
    # batches per eval forward: ~4k tokens at a time, except compiled (one shape, no recompile)
    eval_group = 1 if use_compile else max(1, EVAL_TOKENS_PER_FORWARD // (cfg.batch_size * cfg.block_size))
    train_seconds, steps_done, last_val, mfu = 0.0, 0, math.nan, None
    interval_ms, last_log = [], (0, 0.0)  # ms/step per log interval
    t_mark = time.perf_counter()
    guard.arm()  # from here SIGINT/SIGTERM stop the run at the end of a step
    stop_signal = None
    for step in range(start_step, cfg.max_iters + 1):
        last_step = step == cfg.max_iters
        lr = set_lr(optimizer, step, cfg)

        # a resumed run evaluates its first step again: the same weights and eval seed give the same
        # numbers, and TensorBoard, purged from start_step on, gets that step's points back
        if (step % cfg.eval_interval == 0 or last_step) and dist.is_main:
            if device.type == "cuda":
                torch.cuda.synchronize()
            train_seconds += time.perf_counter() - t_mark
            losses = estimate_loss(fwd, splits, cfg.batch_size, cfg.block_size, cfg.eval_iters,
                                   cfg.seed + 1, device, autocast, eval_group)
            if not (math.isfinite(losses["train"]) and math.isfinite(losses["val"])):
                guard.check_before_save(model)  # names the first non-finite training loss, if there was one
                raise FloatingPointError(f"the loss estimate at step {step} is not finite (train {losses['train']}, "
                                         f"val {losses['val']}); stopped without saving: {guard.kept()}")
            last_val = losses["val"]
            history.append({"step": step, "train_loss": losses["train"], "val_loss": losses["val"],
                            "train_seconds": train_seconds, "wall_seconds": time.perf_counter() - t_start})
            log.line(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            log.scalars(step, {"train/loss_estimate": losses["train"], "val/loss": losses["val"]})
            log.snapshot(step, model, corpus, cfg)  # text sample and attention maps, from `model`
            if losses["val"] < best_val or cfg.always_save_checkpoint:
                best_val = min(best_val, losses["val"])
                if step > start_step or (step > 0 and ckpt is None):  # never rewrite the state resumed from
                    guard.check_before_save(model)  # never a model from a non-finite loss on
                    save_checkpoint(ckpt_path, _checkpoint_state(model, optimizer, cfg, corpus, step, best_val,
                                                                 batch_gen, device, history))
            t_mark = time.perf_counter()
        if last_step:
            break

        for micro in range(micro_steps):
            x, y = get_batch(train_data, cfg.batch_size, cfg.block_size, batch_gen, device)
            with dist.sync_gradients(ddp_fwd, last_micro_step=micro == micro_steps - 1):
                with autocast:
                    _, loss = ddp_fwd(x, y)
                scaler.scale(loss / micro_steps).backward()
            guard.observe(loss, step)  # device-side: no sync
        if cfg.grad_clip > 0:
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        steps_done += 1
        log.advance()

        log_step = step % cfg.log_interval == 0 or step == cfg.max_iters - 1
        stop_signal = guard.poll(step, sync=log_step)  # raises on a non-finite loss since the last check
        if log_step:
            loss_f = loss.item()  # host syncs (here, in guard.poll, grad_norm) happen on log steps only
            elapsed = train_seconds + time.perf_counter() - t_mark
            tok_s = steps_done * tokens_per_step / max(elapsed, 1e-9)
            interval_ms.append(1000 * (elapsed - last_log[1]) / (steps_done - last_log[0]))
            last_log = (steps_done, elapsed)
            log.progress(step, loss_f, lr, interval_ms[-1], tok_s)
            scalars = {"train/loss": loss_f, "lr": lr, "tokens_per_second": tok_s}
            if peak is not None:
                mfu = flops_per_token * tok_s / peak  # model FLOPs utilisation, 0..1
                scalars["mfu"] = mfu
            if cfg.grad_clip > 0:
                scalars["grad_norm"] = grad_norm.item()
            log.scalars(step, scalars)
        if stop_signal is not None:
            break
    guard.disarm()  # past the loop signals act as usual: a Ctrl-C during the saves below exits at once

    # --- stopped by a signal: save the state --resume continues from, skip the exact val ------
    interrupted = signal_name(stop_signal) if stop_signal is not None else None
    if interrupted and dist.is_main:
        train_seconds += time.perf_counter() - t_mark
        guard.check_before_save(model)
        save_checkpoint(ckpt_path, {**_checkpoint_state(model, optimizer, cfg, corpus, step + 1, best_val,
                                                        batch_gen, device, history), "interrupted": interrupted})
        log.line(f"interrupted by {interrupted} after step {step}: saved {ckpt_path} at step {step + 1}; "
                 "run the same command with --resume to continue")

    # --- the exact val loss over the whole split, and the summary -----------------------------
    eval_batch = max(cfg.batch_size, EVAL_TOKENS_PER_FORWARD // cfg.block_size)  # windows per forward
    final_val = exact_loss(model, val_data, cfg.block_size, eval_batch, device, autocast) \
        if cfg.exact_val and not interrupted and dist.is_main else None
    if final_val is not None:
        log.line(f"exact val loss over all {len(val_data) - 1:,} val targets: {final_val:.4f}")
        log.scalars(cfg.max_iters, {"val/loss_exact": final_val})
    summary = {
        "best_val_loss": best_val,
        "final_val_loss": final_val,
        "last_val_estimate": last_val,
        "steps": step + 1 if interrupted else cfg.max_iters,
        "steps_this_run": steps_done,
        "train_seconds": train_seconds,
        "tokens_per_second": steps_done * tokens_per_step / train_seconds if train_seconds > 0 else None,
        "ms_per_step_median": float(np.median(interval_ms)) if interval_ms else None,
        "mfu": mfu,
        "wall_seconds": time.perf_counter() - t_start,
        "params": model.num_params(),
        "device": str(device),
        "dtype": facts["dtype"],  # what dtype=auto resolved to on this machine
        "peak_memory_mb": peak_memory_mb(device),
        "world_size": dist.world_size,
        "interrupted": interrupted,  # the signal that stopped the run early, or None
        "history": history,
    }
    if dist.is_main:
        # never a torn file; NaN/inf (no eval ran, say) as null, so that strict JSON readers accept it
        write_atomic(out_dir / "summary.json", json.dumps(_json_safe(summary), indent=2).encode())
    log.line("summary: " + json.dumps(_json_safe({k: v for k, v in summary.items() if k != "history"})))
    log.hparams(step if interrupted else cfg.max_iters, cfg.to_dict())
    log.close()
    return summary


def _json_safe(value: object) -> object:
    """value with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _rng_state(batch_gen: torch.Generator, device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "batch": batch_gen.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _checkpoint_state(model: GPT, optimizer: ParamGroupOptimizer, cfg: TrainConfig, corpus: Corpus, step: int,
                      best_val: float, batch_gen: torch.Generator, device: torch.device,
                      history: list[dict]) -> dict:
    """What --resume needs to continue from `step` (the number of optimizer steps taken), and the
    evals so far, so that a resumed run's summary.json lists them all."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "model_config": model.config.to_dict(), "config": cfg.to_dict(),
            "vocab": corpus.tokenizer.to_dict(), "step": step, "best_val_loss": best_val,
            "rng": _rng_state(batch_gen, device), "history": list(history)}


# What a run can meet that is the user's or the machine's doing (a bad value, a missing file or package,
# a full disk, a non-finite loss, an unreachable rendezvous): one line and exit status 1, no traceback.
RUN_ERRORS = (ValueError, FloatingPointError, ConnectionError, ImportError, OSError)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: returns the exit status (0 done, 1 an error, 128 + N stopped by signal N)."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        try:
            print(help_text(), flush=True)
        except BrokenPipeError:  # `python train.py --help | head`: the reader went away
            discard_stdout()
        return 0
    try:
        cfg, _ = parse_args(argv)
    except ValueError as e:
        # under torchrun every rank parses the same argv: say it once per node (RANK alone is often set
        # by cluster tools outside torchrun, so only torchrun's full set of variables counts)
        if not launched_by_torchrun(os.environ) or os.environ.get("LOCAL_RANK") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        summary = train(cfg, argv)
    except RUN_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a Ctrl-C during set-up, or a second one during the loop
        print("interrupted: exited at once without saving; the last checkpoint is as it was", file=sys.stderr)
        return exit_code("SIGINT")
    return exit_code(summary["interrupted"]) if summary["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
