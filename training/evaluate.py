"""Loss estimates during training and the exact loss over a whole split at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor, nn

from data import eval_windows, get_batch, inputs_and_targets


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """model in eval mode (no dropout) for the block, then back in the mode it was in, even when the
    block raises: a failed evaluation must not leave a training model without its dropout."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@torch.no_grad()
def estimate_loss(
    model: nn.Module,
    splits: dict[str, np.ndarray | Tensor],
    batch_size: int,
    block_size: int,
    eval_iters: int,
    seed: int,
    device: torch.device | str,
    autocast: contextlib.AbstractContextManager | None = None,
    batches_per_forward: int = 1,
) -> dict[str, float]:
    """Mean loss over eval_iters random batches of each split.

    The batch generator is re-seeded on every call so successive estimates see the same windows:
    their differences then measure the model, not the draw. It is separate from the training
    generator, so evaluating never changes the batches training sees.

    batches_per_forward > 1 stacks that many of the same batches into one forward: the mean is the
    same (equal batch sizes), and on a CPU larger matmuls cut the time of an estimate by about half.
    A compiled model should keep 1, the training batch's shape, so that it is not compiled again.

    Args:
        model: maps (idx (B, T), targets (B, T)) to (logits, mean loss), as GPT does; run in eval mode.
        splits: name -> the split's token ids, (N,) numpy array or tensor (on any device).
        batch_size, block_size: the shape (B, T) of each batch.
        eval_iters: batches per split.
        seed: seeds the window draw, re-seeded on every call.
        device: where the batches go (the model's device).
        autocast: the forward's mixed-precision context, or None.
        batches_per_forward: batches stacked into one forward.
    Returns:
        name -> mean loss over that split's eval_iters batches.
    """
    out = {}
    with evaluating(model):
        for name, data in splits.items():
            out[name] = _split_estimate(model, data, batch_size, block_size, eval_iters, seed, device, autocast,
                                        batches_per_forward)
    return out


def _split_estimate(model: nn.Module, data: np.ndarray | Tensor, batch_size: int, block_size: int,
                    eval_iters: int, seed: int, device: torch.device | str,
                    autocast: contextlib.AbstractContextManager | None, batches_per_forward: int) -> float:
    gen = torch.Generator(device=data.device if isinstance(data, Tensor) else "cpu").manual_seed(seed)
    total = torch.zeros((), device=device)
    for first in range(0, eval_iters, batches_per_forward):
        group = [get_batch(data, batch_size, block_size, gen, device)
                 for _ in range(min(batches_per_forward, eval_iters - first))]
        x, y = (torch.cat(t) if len(group) > 1 else t[0] for t in zip(*group, strict=True))  # (n * B, T)
        with autocast or contextlib.nullcontext():
            _, loss = model(x, y)
        total += loss.float() * len(group)  # the mean of len(group) equal-sized batch means
    return (total / eval_iters).item()  # one sync per split


@torch.no_grad()
def exact_loss(
    model: nn.Module,
    data: np.ndarray | Tensor,
    block_size: int,
    batch_size: int,
    device: torch.device | str,
    autocast: contextlib.AbstractContextManager | None = None,
) -> float:
    """Mean cross-entropy over every target of a split exactly once, in order.

    The split is cut into consecutive windows of block_size (eval_windows); each window's targets
    are the next tokens, so every token after the first is predicted once, from the context that
    precedes it within its window. Losses are summed in float64 and divided by the target count.

    Args:
        model: maps idx (B, T) to (logits (B, T, V), _), as GPT does; run in eval mode.
        data: the split's token ids, (N,) numpy array or tensor.
        block_size: window length T.
        batch_size: windows per forward.
        device: where the windows go (the model's device).
        autocast: the forward's mixed-precision context, or None.
    Returns:
        the mean loss over the N - 1 targets.
    """
    with evaluating(model):
        total = _total_loss(model, data, block_size, batch_size, device, autocast)
    return (total / (len(data) - 1)).item()


def _total_loss(model: nn.Module, data: np.ndarray | Tensor, block_size: int, batch_size: int,
                device: torch.device | str, autocast: contextlib.AbstractContextManager | None) -> Tensor:
    windows = eval_windows(data, block_size)
    data_t = data if isinstance(data, Tensor) else torch.from_numpy(data.astype(np.int64))
    total = torch.zeros((), dtype=torch.float64, device=device)
    full = [s for s, n in windows if n == block_size]
    offsets = torch.arange(block_size + 1)
    for i in range(0, len(full), batch_size):
        starts = torch.tensor(full[i:i + batch_size])
        chunk = data_t[(starts[:, None] + offsets).to(data_t.device)].long().to(device)  # (b, T + 1)
        total += _sum_loss(model, chunk, autocast)
    for s, n in windows:
        if n < block_size:  # the one short window at the end
            chunk = data_t[s:s + n + 1].long().to(device)[None]  # (1, n + 1)
            total += _sum_loss(model, chunk, autocast)
    return total  # float64 scalar


def _sum_loss(model: nn.Module, chunk: Tensor, autocast) -> Tensor:
    x, y = inputs_and_targets(chunk)  # (b, T) each: targets are the next tokens
    with autocast or contextlib.nullcontext():
        logits, _ = model(x)
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum"
    ).double()
