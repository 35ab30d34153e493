"""Loss estimates during training and the exact loss over a whole split at the end."""

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from data import eval_windows, get_batch, inputs_and_targets


class Stopped(Exception):
    """A stop signal arrived mid-evaluation; the evaluation is dropped."""


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """model in eval mode for the block, then its previous mode, even if it raises."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def _bar(total: int, desc: str, show: bool) -> tqdm:
    # terminal only, after 2 s: quick evals stay silent
    return tqdm(total=total, desc=desc, unit="fwd", delay=2, leave=False, file=sys.stderr,
                disable=None if show else True)


@torch.no_grad()
def estimate_loss(model: nn.Module, splits: dict[str, Tensor], cfg: Any, device: torch.device | str, *,
                  autocast: contextlib.AbstractContextManager | None = None, batches_per_forward: int = 1,
                  stop: Callable[[], bool] = lambda: False, show: bool = False) -> dict[str, float]:
    """Mean loss over cfg.eval_iters batches (cfg.batch_size, cfg.block_size) of each split (N,), drawn from a
    generator seeded cfg.seed + 1 at every call (every eval reads the same windows; training's draw untouched);
    raises Stopped if stop() before a forward."""
    out = {}
    n = cfg.eval_iters
    with evaluating(model), _bar(len(splits) * -(-n // batches_per_forward), "estimate", show) as bar:
        for name, data in splits.items():
            gen = torch.Generator(device=data.device).manual_seed(cfg.seed + 1)
            total = torch.zeros((), device=device)
            for first in range(0, n, batches_per_forward):
                if stop():
                    raise Stopped
                group = [get_batch(data, cfg.batch_size, cfg.block_size, gen, device)
                         for _ in range(min(batches_per_forward, n - first))]
                x, y = (torch.cat(t) for t in zip(*group, strict=True))  # (len(group) * B, T)
                with autocast or contextlib.nullcontext():
                    _, loss = model(x, y)
                total += loss.float() * len(group)  # len(group) equal-sized batch means
                bar.update()
            out[name] = (total / n).item()  # one sync per split
    return out


@torch.no_grad()
def exact_loss(model: nn.Module, data: Tensor, block_size: int, batch_size: int, device: torch.device | str, *,
               autocast: contextlib.AbstractContextManager | None = None, stop: Callable[[], bool] = lambda: False,
               show: bool = False) -> float:
    """Mean cross-entropy over each target of a split (N,) once, in its eval_windows window."""
    windows = eval_windows(data, block_size)
    full = torch.tensor([s for s, n in windows if n == block_size], dtype=torch.long)
    chunks = [data[(s[:, None] + torch.arange(block_size + 1)).to(data.device)] for s in full.split(batch_size)]
    chunks += [data[s:s + n + 1][None] for s, n in windows if n < block_size]  # (b, T + 1), last shorter
    total = torch.zeros((), dtype=torch.float64, device=device)
    with evaluating(model), _bar(len(chunks), "exact val", show) as bar:
        for chunk in chunks:
            if stop():
                raise Stopped
            x, y = inputs_and_targets(chunk.long().to(device))  # (b, T) each
            with autocast or contextlib.nullcontext():
                logits, _ = model(x)
            total += F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1),
                                     reduction="sum").double()
            bar.update()
    return (total / (len(data) - 1)).item()
