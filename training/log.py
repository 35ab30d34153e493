"""One output path: lines above the progress bar, TensorBoard (scalars, HParams), summary.json.
TensorBoard tags are grouped loss/, maps/, optim/, speed/: its alphabetical order opens on the losses."""

import contextlib
import itertools
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .checkpoint import json_safe, write_json
from .config import TrainConfig
from .runtime import peak_memory_mb

# few columns: at 1400 px the table shows the metrics without scrolling (every field stays in the session's info)
HPARAMS = ("n_layer", "n_embd", "learning_rate")
METRICS = ("loss/val_exact", "loss/val")
SAMPLE_PY = Path(__file__).resolve().parent.parent / "sample.py"


def bpc(loss: float) -> float:
    """Loss in nats -> bits per character."""
    return loss / math.log(2)


def step_ms(marks: list[tuple[int, float]]) -> list[float]:
    """Milliseconds per step between consecutive marks (steps, seconds), the first from (0, 0)."""
    return [1000 * (e - e0) / (n - n0) for (n0, e0), (n, e) in itertools.pairwise([(0, 0.0), *marks])]


def format_duration(seconds: float) -> str:
    """3725 -> '62 min'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h" if seconds < 172800 else f"{seconds / 86400:.0f} days"


class RunLog:
    """Lines above a tqdm bar (on a terminal; train.py steps it), TensorBoard; silent unless enabled."""

    def __init__(self, cfg: TrainConfig, flops_per_token: float, peak: float | None, initial: int,
                 enabled: bool = True) -> None:
        """peak: the device's FLOP/s (None: no MFU); initial: the step the bar starts at."""
        self.cfg, self.enabled, self.flops_per_token, self.peak = cfg, enabled, flops_per_token, peak
        self.tokens_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size
        self.interactive = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=cfg.max_iters, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr,
                        disable=not self.interactive)
        self.writer = None
        if enabled and cfg.tensorboard:
            from tensorboard.plugins.hparams import summary_v2 as hp
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=cfg.out_dir, purge_step=initial)  # a resume replaces what it replays
            self.writer.file_writer.add_summary(hp.hparams_config_pb(
                hparams=[hp.HParam(n) for n in HPARAMS], metrics=[hp.Metric(m) for m in METRICS]))
            self.writer.file_writer.add_summary(hp.hparams_pb(json_safe(cfg.to_dict()),
                                                              trial_id=Path(cfg.out_dir).name))

    def line(self, text: str) -> None:
        """Print text above the bar."""
        if self.interactive:
            self.bar.write(text, file=sys.stderr)
        elif self.enabled:
            with contextlib.suppress(BrokenPipeError):  # a reader gone (| head): its SIGPIPE stops the run, saving
                print(text, flush=True)

    def speed(self, steps: int, seconds: float) -> tuple[float, float | None]:
        """Tokens/s of `steps` steps in `seconds`, and its MFU (0..1; None without a peak)."""
        tok_s = steps * self.tokens_per_step / max(seconds, 1e-9)
        return tok_s, None if self.peak is None else self.flops_per_token * tok_s / self.peak

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Each value at step, under its name, to TensorBoard (if on)."""
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

    def evaluation(self, step: int, losses: dict[str, float], train_seconds: float, wall_seconds: float) -> dict:
        """Log an eval's estimates; returns its history entry."""
        train, val = losses["train"], losses["val"]
        self.line(f"step {step}: train loss {train:.4f}, val loss {val:.4f} ({bpc(val):.3f} bpc)")
        self.scalars(step, {"loss/train_estimate": train, "loss/val": val, "loss/val_bpc": bpc(val)})
        return {"step": step, "train_loss": train, "val_loss": val, "train_seconds": train_seconds,
                "wall_seconds": wall_seconds}

    def finish(self, summary: dict, final_step: int, interrupted: str | None) -> None:
        """The run in two lines (what it reached, where it is and how to sample it), summary.json, exact val
        scalars, HParams session end."""
        self.bar.close()  # first: no stale bar below the last lines
        self.interactive = False
        s, ckpt = summary, Path(self.cfg.out_dir) / "ckpt.pt"
        speed = f" ({s['ms_per_step_median']:.1f} ms/step median, {s['tokens_per_second']:,.0f} tok/s over the run)" \
            if s["ms_per_step_median"] and s["tokens_per_second"] else ""
        ran = f", {s['steps_this_run']} of them" if s["steps_this_run"] != s["steps"] else ""  # resumed: this run's
        took = format_duration(s["wall_seconds"])
        head = f"{'stopped' if interrupted else 'done'}: {s['steps']} steps{ran} in {took}"
        head += f", {format_duration(s['compile_seconds'])} of it compiling" if s["compile_seconds"] >= 1 else ""
        losses = [f"exact val loss {s['final_val_loss']:.4f} ({s['final_val_bpc']:.3f} bpc)"] \
            if s["final_val_loss"] is not None else []
        losses += [f"best val estimate {s['best_val_loss']:.4f}"] if math.isfinite(s["best_val_loss"]) else []
        self.line(" | ".join([head + speed, *losses]))
        saved = s["checkpoint_step"]
        older = f" (step {saved}, where the val estimate was best; the last step's weights were not saved: " \
            "--always_save_checkpoint keeps them)" if saved is not None and saved != s["steps"] else ""
        self.line(f"checkpoint: {ckpt}{older}; sample it: python {os.path.relpath(SAMPLE_PY)} "
                  f"--out_dir={self.cfg.out_dir}"
                  if saved is not None else "no checkpoint was saved: the val estimate never improved on step 0's "
                  "(--always_save_checkpoint saves at every eval)")
        if self.enabled:
            write_json(Path(self.cfg.out_dir) / "summary.json", summary)
        if self.writer is not None:
            if summary["final_val_loss"] is not None:
                self.scalars(final_step, {"loss/val_exact": summary["final_val_loss"],
                                          "loss/val_bpc_exact": summary["final_val_bpc"]})
            if not interrupted:  # session end
                from torch.utils.tensorboard.summary import hparams

                self.writer.file_writer.add_summary(hparams({}, {})[2], final_step)
            self.writer.close()

    def summary(self, facts: dict, history: list[dict], marks: list[tuple[int, float]], steps_this_run: int,
                seconds: float, **figures: Any) -> dict:
        """figures plus bpc, run facts and this process's throughput: steps_this_run in `seconds` of training, marks
        = (steps, training seconds) at each log step."""
        final = figures["final_val_loss"]
        # each step weighs as one: step 0's interval (its compile) is one step, not one of a few progress lines
        median = float(np.median(np.repeat(step_ms(marks), np.diff([0, *(n for n, _ in marks)])))) if marks else None
        mfu = self.speed(*marks[-1])[1] if marks else None  # the last progress line's
        return {**figures, "final_val_bpc": None if final is None else bpc(final),
                "last_val_estimate": history[-1]["val_loss"] if history else None,
                **{k: facts[k] for k in ("params", "device", "dtype", "world_size")},
                "peak_memory_mb": peak_memory_mb(torch.device(facts["device"])), "history": history,
                "steps_this_run": steps_this_run, "train_seconds": seconds, "mfu": mfu,
                "tokens_per_second": steps_this_run * self.tokens_per_step / seconds if seconds > 0 else None,
                "ms_per_step_median": median}
