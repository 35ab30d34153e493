"""One logging path: progress line, TensorBoard (scalars, sample, attention, HParams), clock, summary.
TensorBoard tags are grouped loss/, maps/, optim/, speed/: its alphabetical order opens on the losses."""

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from data import SEPARATOR
from model import GPT

from .checkpoint import json_safe, write_json
from .config import TrainConfig
from .evaluate import evaluating
from .runtime import peak_memory_mb
from .visualize import prompt_attention, render_attention

# few columns: at 1400 px the table shows the metrics without scrolling (every field stays in the session's info)
HPARAMS = ("n_layer", "n_embd", "learning_rate")
METRICS = ("loss/val_exact", "loss/val")
ATTENTION_CHARS = 32  # attention prompt length: 32 x 32 cells stay readable


def bpc(loss: float) -> float:
    """Loss in nats -> bits per character."""
    return loss / math.log(2)


def format_duration(seconds: float) -> str:
    """3725 -> '62 min'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h" if seconds < 172800 else f"{seconds / 86400:.0f} days"


class RunLog:
    """Progress line (tqdm bar on a terminal), TensorBoard and training clock; silent unless enabled."""

    def __init__(self, cfg: TrainConfig, model: GPT, peak: float | None, initial: int, enabled: bool = True) -> None:
        self.cfg, self.enabled, self.peak = cfg, enabled, peak
        self.tokens_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size
        self.flops_per_token = model.flops_per_token(cfg.block_size)
        self.interactive = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=cfg.max_iters, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr,
                        disable=not self.interactive)
        self.train_seconds, self.steps, self.interval_ms, self.mfu = 0.0, 0, [], None
        self._mark, self._last, self._first = time.perf_counter(), (0, 0.0), None  # (steps, train seconds) at logs
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
            print(text, flush=True)

    @contextlib.contextmanager
    def paused(self, device: torch.device) -> Iterator[None]:
        """Training clock stopped for the block (evals, saves)."""
        if device.type == "cuda":
            torch.cuda.synchronize()  # queued step work is training time
        self.train_seconds += time.perf_counter() - self._mark
        try:
            yield
        finally:
            self._mark = time.perf_counter()

    def step_done(self, step: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor | None, log: bool) -> None:
        """After each step; at log steps (the only host reads) progress line and scalars."""
        self.steps += 1
        self.bar.update()
        self.scalars(step, {"optim/lr": lr})  # every step: a sparse, smoothed lr draws humps the schedule lacks
        if not log:
            return
        loss_f, elapsed = loss.item(), self.train_seconds + time.perf_counter() - self._mark
        tok_s = self.steps * self.tokens_per_step / max(elapsed, 1e-9)
        self.interval_ms.append(1000 * (elapsed - self._last[1]) / (self.steps - self._last[0]))
        self._first = self._first or (self.steps, elapsed)  # a compile's cost shows in the first interval
        self._last = (self.steps, elapsed)
        text = (f"loss {loss_f:.4f} ({bpc(loss_f):.3f} bpc) | lr {lr:.2e} | {self.interval_ms[-1]:.1f} ms/step | "
                f"{tok_s:,.0f} tok/s")
        if self.interactive:
            self.bar.set_postfix_str(text, refresh=False)
        else:
            self.line(f"step {step:6d} | {text}")
        scalars = {"loss/train": loss_f, "speed/tokens_per_second": tok_s}
        if self.peak is not None:
            self.mfu = scalars["speed/mfu"] = self.flops_per_token * tok_s / self.peak  # 0..1
        if grad_norm is not None:
            scalars["optim/grad_norm"] = grad_norm.item()
        self.scalars(step, scalars)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

    def evaluation(self, step: int, losses: dict[str, float], t_start: float) -> dict:
        """Log an eval's estimates; returns its history entry."""
        train, val = losses["train"], losses["val"]
        self.line(f"step {step}: train loss {train:.4f}, val loss {val:.4f} ({bpc(val):.3f} bpc)")
        self.scalars(step, {"loss/train_estimate": train, "loss/val": val, "loss/val_bpc": bpc(val)})
        return {"step": step, "train_loss": train, "val_loss": val, "train_seconds": self.train_seconds,
                "wall_seconds": time.perf_counter() - t_start}

    def snapshot(self, step: int, model: GPT, chars: list[str], val: np.ndarray) -> None:
        """Text sample (own generator) and attention maps to TensorBoard."""
        if self.writer is None:
            return
        device = model.tok_emb.weight.device
        if self.cfg.sample_tokens > 0:
            start = next((chars.index(c) for c in (SEPARATOR, "\n") if c in chars), 0)  # a new document, or line
            gen = torch.Generator(device=device).manual_seed(self.cfg.seed)
            with evaluating(model):
                new = model.stream(torch.tensor([[start]], device=device), self.cfg.sample_tokens, generator=gen)
                text = (chars[start] + "".join(chars[int(t)] for t in new)).replace(SEPARATOR, "\n")
            self.writer.add_text("sample", "\n".join("    " + s for s in text.split("\n")), step)  # verbatim
        ids = val[:min(ATTENTION_CHARS, self.cfg.block_size)].tolist()
        for layer, weights in enumerate(prompt_attention(model, ids)):
            image = render_attention([weights], [chars[i] for i in ids], [layer])
            self.writer.add_image(f"maps/attention_layer_{layer}", image, step, dataformats="HWC")

    def finish(self, summary: dict, final_step: int, interrupted: str | None) -> None:
        """The run in two lines (what it reached, where it is and how to sample it), summary.json, exact val
        scalars, HParams session end."""
        self.bar.close()  # first: no stale bar below the last lines
        self.interactive = False
        s, ckpt = summary, Path(self.cfg.out_dir) / "ckpt.pt"
        speed = f" ({s['ms_per_step_median']:.1f} ms/step, {s['tokens_per_second']:,.0f} tok/s)" \
            if s["ms_per_step_median"] and s["tokens_per_second"] else ""
        head = f"{'stopped' if interrupted else 'done'}: {s['steps']} steps in {format_duration(s['wall_seconds'])}"
        losses = [f"exact val loss {s['final_val_loss']:.4f} ({s['final_val_bpc']:.3f} bpc)"] \
            if s["final_val_loss"] is not None else []
        losses += [f"best val estimate {s['best_val_loss']:.4f}"] if math.isfinite(s["best_val_loss"]) else []
        self.line(" | ".join([head + speed, *losses]))
        self.line(f"checkpoint: {ckpt}; sample it: python sample.py --out_dir={self.cfg.out_dir}" if ckpt.exists()
                  else "no checkpoint was saved")
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

    def summary(self, facts: dict, history: list[dict], **figures: Any) -> dict:
        """figures plus bpc, run facts and this process's throughput."""
        seconds, final = self.train_seconds, figures["final_val_loss"]
        median = float(np.median(self.interval_ms)) if self.interval_ms else None
        return {**figures, "final_val_bpc": None if final is None else bpc(final),
                "last_val_estimate": history[-1]["val_loss"] if history else None,
                **{k: facts[k] for k in ("params", "device", "dtype", "world_size")},
                "peak_memory_mb": peak_memory_mb(torch.device(facts["device"])), "history": history,
                "steps_this_run": self.steps, "train_seconds": seconds, "mfu": self.mfu,
                "tokens_per_second": self.steps * self.tokens_per_step / seconds if seconds > 0 else None,
                "ms_per_step_median": median,
                "first_log_excess_s": self._first[1] - self._first[0] * median / 1000 if self._first else None}
