"""Train a character-level GPT: python train.py [CONFIG.toml] [--field=value ...], or under torchrun (DDP).

`train` reads top to bottom: checks, set-up, then per step lr -> eval/checkpoint -> forward/backward/step -> log.
"""

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

import training.checkpoint as checkpoint
from data import SEPARATOR, check_split_sizes, get_batch, load_corpus
from model import GPT
from training import Stopped, estimate_loss, exact_loss, help_text, parse_args, set_lr
from training.distributed import close_distributed, init_distributed, launched_by_torchrun
from training.faults import RunGuard, exit_code, signal_name
from training.log import RunLog, bpc, estimated_seconds, format_duration
from training.optim import configure_optimizers
from training.runtime import (
    autocast_context,
    peak_flops,
    record_speed,
    reproducible_blas,
    resolve_compile,
    resolve_device,
    resolve_dtype,
    run_facts,
)

CONFIGS = Path(__file__).resolve().parent / "configs"
LONG_RUN_SECONDS = 15 * 60  # a longer estimate without CUDA suggests the fast CPU recipe
EVAL_TOKENS_PER_FORWARD = 4096  # fastest inference batch on a CPU (RESULTS.md)
# user or machine errors: one line, exit status 1, no traceback
RUN_ERRORS = (ValueError, FloatingPointError, ConnectionError, ImportError, OSError)


def train(cfg, argv: list[str] | None = None, verbose: bool = True) -> dict:
    """Run cfg (a TrainConfig), one rank under torchrun; returns summary.json's dict. verbose=False: no output."""
    t_start = time.perf_counter()
    out_dir, moved = checkpoint.run_folder(cfg)  # never into another run's folder, unless asked
    cfg = cfg.replace(out_dir=str(out_dir))
    dist = init_distributed(os.environ, cfg.device)
    device = dist.device
    ckpt_path = out_dir / checkpoint.CKPT_NAME
    guard = RunGuard(device, ckpt_path, dist.enabled, announce=verbose and dist.is_main)
    try:
        # --- checks that can fail, before writing to out_dir ---
        micro_steps = dist.micro_steps(cfg.gradient_accumulation_steps)  # per rank, same global batch
        corpus = load_corpus(cfg.dataset, cfg.split, cfg.text_column, cfg.documents)
        check_split_sizes(corpus, cfg.block_size)
        tok = corpus.tokenizer
        if cfg.doc_mask and SEPARATOR not in tok.stoi:
            raise ValueError(f"doc_mask=true needs documents, and {corpus.name} is one text: give --documents=lines "
                             "(or paragraphs), a folder of files or an hf: dataset")
        model_cfg = cfg.model_config(tok.vocab_size, tok.stoi[SEPARATOR] if cfg.doc_mask else None)
        ckpt = checkpoint.checkpoint_to_resume(cfg, model_cfg, tok, device) if cfg.resume else None
        kept = {k: ckpt["config"].get(k, "auto") for k in ("dtype", "compile")} if ckpt else {}  # a resume keeps them
        if kept.get("dtype", "auto") != "auto" and cfg.dtype == "auto":
            dtype, dtype_why = getattr(torch, kept["dtype"]), "the run's own, from its checkpoint"
        else:
            dtype, dtype_why = resolve_dtype(cfg.dtype, device, (cfg.batch_size * cfg.block_size, cfg.n_embd))
        cfg = cfg.replace(dtype=str(dtype).removeprefix("torch."))  # what ran
        if kept.get("compile", "auto") != "auto" and cfg.compile == "auto":
            use_compile, compile_why = kept["compile"] == "true", "the run's own, from its checkpoint"
        else:
            steps = cfg.max_iters - (ckpt["step"] if ckpt else 0)
            use_compile, compile_why = resolve_compile(cfg.compile, device, cfg, steps)
        cfg = cfg.replace(compile=str(use_compile).lower())
        guard.float16, autocast = dtype == torch.float16, autocast_context(device, dtype)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        # --- data (int32: half of int64), model, optimizers, resumed state ---
        train_data, val_data = (torch.from_numpy(s.astype(np.int32)).to(device) for s in (corpus.train, corpus.val))
        torch.manual_seed(cfg.seed)
        batch_gen = torch.Generator(device=device).manual_seed(cfg.seed)
        model = checkpoint.model_from_checkpoint(ckpt, device, dropout=cfg.dropout, attn_backend=cfg.attn_backend)[0] \
            if ckpt else GPT(model_cfg).to(device)
        optimizers = configure_optimizers(model, cfg)
        scaler = torch.amp.GradScaler(device.type, enabled=guard.float16)
        start, best_val, history = checkpoint.restore(ckpt, optimizers, batch_gen, device)
        if not dist.is_main:  # a checkpoint holds rank 0's streams
            torch.manual_seed(dist.seed(cfg.seed, start))
            batch_gen.manual_seed(dist.seed(cfg.seed, start))
        fwd = torch.compile(model) if use_compile else model  # saves use `model`
        ddp_fwd = dist.wrap(fwd)
        facts = {"config": cfg.to_dict(), "run": run_facts(argv or []), "device": str(device),
                 "dtype": str(dtype).removeprefix("torch."), "compile": use_compile, "params": model.num_params(),
                 "corpus": corpus.name, "world_size": dist.world_size}
        if dist.is_main:
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"out_dir={cfg.out_dir}: cannot create it as a directory ({e.strerror}); give "
                                 "another --out_dir") from None
            checkpoint.remove_partial_saves(out_dir)
            if cfg.overwrite and not cfg.resume:  # the old run's curves would mix with this one's
                for old in [*out_dir.glob("events.out.tfevents.*"), out_dir / "summary.json"]:
                    old.unlink(missing_ok=True)
            checkpoint.write_json(out_dir / "config.json", facts)
        log = RunLog(cfg, model, peak_flops(device, cfg.peak_tflops), start, enabled=verbose and dist.is_main)
        log.line(f"{corpus.name}: {len(corpus.train):,} train / {len(corpus.val):,} val tokens, {tok.vocab_size} "
                 f"symbols | {model.num_params() / 1e6:.2f}M params | {device} {facts['dtype']} ({dtype_why}) | "
                 f"{'compiled' if use_compile else 'eager'} ({compile_why})"
                 + (f" | resumed at step {start}" if ckpt else "")
                 + (f" | {dist.world_size} processes" if dist.enabled else ""))
        if moved:
            log.line(f"note: {moved}")
        if device.type != "cuda" and verbose and dist.is_main:
            seconds, forward = estimated_seconds(model, cfg, start, len(val_data), device, autocast)
            log.line(f"estimated duration on this machine: {format_duration(seconds)} (one forward of a "
                     f"{cfg.batch_size}x{cfg.block_size} batch: {forward:.2f} s)")
            if seconds > LONG_RUN_SECONDS and not (argv and Path(argv[0]).name == "shakespeare_char_cpu_fast.toml"):
                fast = os.path.relpath(CONFIGS / "shakespeare_char_cpu_fast.toml")
                log.line(f"this is a GPU-sized run for this machine; for a run of minutes: python train.py {fast}")
        splits = {"train": train_data, "val": val_data}
        group = 1 if use_compile else max(1, EVAL_TOKENS_PER_FORWARD // (cfg.batch_size * cfg.block_size))

        def save(steps: int, **extra: str) -> None:  # never a NaN state
            guard.check_before_save(model)
            state = checkpoint.training_state(model, optimizers, cfg, tok, steps, best_val, batch_gen, history)
            checkpoint.save_checkpoint(ckpt_path, {**state, **extra})

        guard.arm()
        # --- the loop ---
        stop, done = None, start  # stopping signal; steps done
        for step in range(start, cfg.max_iters + 1):
            last_step = step == cfg.max_iters
            lr = set_lr(optimizers, step, cfg)
            if (step % cfg.eval_interval == 0 or last_step) and dist.is_main:
                with log.paused(device):
                    try:
                        losses = estimate_loss(fwd, splits, cfg.batch_size, cfg.block_size, cfg.eval_iters,
                                               cfg.seed + 1, device, autocast, group, guard.stopping, verbose)
                    except Stopped:  # the estimate is dropped
                        stop = guard.signum
                        break
                    if not (math.isfinite(losses["train"]) and math.isfinite(losses["val"])):
                        guard.check_before_save(model)  # raises first if a train loss was non-finite
                        raise FloatingPointError(f"the loss estimate at step {step} is not finite ({losses}); "
                                                 f"stopped without saving: {guard.kept()}")
                    history.append(log.evaluation(step, losses, t_start))
                    log.snapshot(step, model, tok.chars, corpus.val)
                    if losses["val"] < best_val or cfg.always_save_checkpoint:
                        best_val = min(best_val, losses["val"])
                        if step > start or (step > 0 and ckpt is None):  # not the state resumed from
                            save(step)
            if last_step:
                break
            for micro in range(micro_steps):
                x, y = get_batch(train_data, cfg.batch_size, cfg.block_size, batch_gen, device)
                with dist.sync_gradients(ddp_fwd, last_micro_step=micro == micro_steps - 1):
                    with autocast:
                        _, loss = ddp_fwd(x, y)
                    scaler.scale(loss / micro_steps).backward()
                guard.observe(loss, step)  # device-side: no host read
            grad_norm = None
            if cfg.grad_clip > 0:
                for opt in optimizers:
                    scaler.unscale_(opt)  # clip the true gradients
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            for opt in optimizers:
                scaler.step(opt)
                opt.zero_grad(set_to_none=True)
            scaler.update()
            done = step + 1
            log_step = step % cfg.log_interval == 0 or step == cfg.max_iters - 1
            stop = guard.poll(sync=log_step)  # raises on a non-finite loss
            log.step_done(step, loss, lr, grad_norm, log_step)
            if stop is not None:
                break
        # --- exact val loss (unless stopped), summary ---
        final_val = None
        if cfg.exact_val and stop is None and dist.is_main:
            try:
                with log.paused(device):
                    windows = max(cfg.batch_size, EVAL_TOKENS_PER_FORWARD // cfg.block_size)
                    final_val = exact_loss(model, val_data, cfg.block_size, windows, device, autocast, guard.stopping,
                                           verbose)
                log.line(f"exact val loss over all {len(val_data) - 1:,} val targets: {final_val:.4f} "
                         f"({bpc(final_val):.3f} bpc)")
            except Stopped:
                stop = guard.signum
        guard.disarm()  # from here a Ctrl-C exits at once
        interrupted = None if stop is None else signal_name(stop)
        if interrupted and dist.is_main:
            save(done, interrupted=interrupted)
            log.line(f"interrupted by {interrupted} after {done} steps: saved {ckpt_path} at step {done}; run the "
                     "same command with --resume to continue")
        summary = log.summary(facts, history, best_val_loss=best_val, final_val_loss=final_val, steps=done,
                              wall_seconds=time.perf_counter() - t_start, interrupted=interrupted)
        log.finish(summary, done, interrupted)
        if device.type == "cpu" and dist.is_main:
            record_speed(cfg, summary)
        return summary
    except KeyboardInterrupt:  # a second Ctrl-C: say what is on disk
        raise KeyboardInterrupt(guard.kept()) from None
    finally:
        guard.disarm()
        close_distributed(dist)


def with_recipe(argv: list[str]) -> tuple[list[str], str | None]:
    """argv with this device's recipe prepended if it names no config, and a line saying which (or None)."""
    if argv and not argv[0].startswith("--"):
        return argv, None
    only_device = argparse.ArgumentParser(add_help=False)
    only_device.add_argument("--device", default="auto")  # --device=x and --device x
    kind = resolve_device(only_device.parse_known_args(argv)[0].device).type
    name, why = {"cuda": ("shakespeare_char.toml", "the baby GPT, for CUDA"),
                 "mps": ("shakespeare_char_cpu.toml", "nanoGPT's laptop recipe, for MPS")}.get(
        kind, ("shakespeare_char_cpu_fast.toml", "the fast CPU recipe: no CUDA GPU here"))
    return [str(CONFIGS / name), *argv], f"no config given: training configs/{name}, {why} (pass a config to choose)"


def main(argv: list[str] | None = None) -> int:
    """Command line; returns exit status (0 done, 1 error, 128 + N stopped by signal N)."""
    argv = sys.argv[1:] if argv is None else argv
    reproducible_blas()
    if "-h" in argv or "--help" in argv:
        try:
            print(help_text(), flush=True)
        except BrokenPipeError:  # `python train.py --help | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    quiet = launched_by_torchrun(os.environ) and os.environ.get("LOCAL_RANK") != "0"  # errors once per node
    try:
        argv, why = with_recipe(argv)
        cfg = parse_args(argv)
        if why and not quiet:
            print(why, flush=True)
        summary = train(cfg, argv)
    except RUN_ERRORS as e:
        if not quiet:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C in set-up, or a second one in the loop
        print(f"interrupted: exited at once without saving; {e or 'nothing was written'}", file=sys.stderr)
        return exit_code("SIGINT")
    return exit_code(summary["interrupted"]) if summary["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
