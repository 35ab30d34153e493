"""Tiny in-process training runs shared by the TensorBoard, resume and sampling tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training import TrainConfig

TEXT = (
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n"
    "It is the east, and Juliet is the sun.\n"
)


def write_corpus(folder: Path) -> Path:
    """A ~10 KB corpus: enough for block 16 windows in both splits."""
    path = folder / "corpus.txt"
    path.write_text(TEXT * 100, encoding="utf-8")
    return path


def tiny_config(folder: Path, **overrides: Any) -> TrainConfig:
    """A 2-layer, 2-head, 16-wide model on write_corpus(folder): a step takes milliseconds."""
    corpus = folder / "corpus.txt"
    if not corpus.exists():
        write_corpus(folder)
    fields: dict[str, Any] = dict(
        dataset=str(corpus), cache_dir=str(folder / "cache"), out_dir=str(folder / "out"), device="cpu",
        compile="false", n_layer=2, n_head=2, n_embd=16, block_size=16, dropout=0.0, batch_size=4,
        max_iters=6, learning_rate=1e-2, min_lr=1e-3, warmup_iters=2, lr_decay_iters=8,
        eval_interval=3, eval_iters=2, log_interval=1, sample_tokens=24,
    )
    fields.update(overrides)
    return TrainConfig(**fields)
