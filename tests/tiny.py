"""Tiny corpora and configs in temp dirs, shared by the tests (which never download or read ../shared)."""

import dataclasses
import itertools
import signal
from pathlib import Path
from typing import Any

import pytest

import train
from model import GPTConfig
from training import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
CPU_CONFIGS = [p for p in sorted((ROOT / "configs").glob("*.toml")) if 'device = "cpu"' in p.read_text()]  # recipes
cli_args = lambda cfg: [f"--{k}={v}" for k, v in cfg.to_dict().items()]  # every field: none falls back to a recipe
# every GPTConfig field a resume must match (not dropout, attn_backend; doc_sep: a run on documents), each set away
# from both GPTConfig's default and tiny_config's
ARCHITECTURE = dict(n_layer=1, n_head=1, n_embd=32, block_size=8, bias=True, pos_emb="rope", qk_norm=True,
                    attn_window=4)
assert set(ARCHITECTURE) == {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "doc_sep", "dropout",
                                                                               "attn_backend"}


def tiny_config(folder: Path, **overrides: Any) -> TrainConfig:
    """A 2-layer, 2-head, 16-wide model on a ~10 KB corpus written into folder: a step takes milliseconds."""
    corpus = folder / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(TEXT * 100, encoding="utf-8")
    fields: dict[str, Any] = dict(
        dataset=str(corpus), out_dir=str(folder / "out"), device="cpu", compile="false", n_layer=2, n_head=2,
        n_embd=16, block_size=16, dropout=0.0, batch_size=4, max_iters=6, learning_rate=1e-2, min_lr=1e-3,
        warmup_iters=2, lr_decay_iters=8, eval_interval=3, eval_iters=2, log_interval=1, sample_tokens=24)
    return TrainConfig(**{**fields, **overrides})


def ctrl_c_in_batch(batch: int, cfg: TrainConfig, before=lambda: None, **kwargs) -> dict:
    """train.train(cfg, **kwargs), Ctrl-C raised in its batch-th get_batch after before()."""
    calls, get_batch = itertools.count(1), train.get_batch

    def batch_then_ctrl_c(*args, **kw):
        if next(calls) == batch:
            before()
            signal.raise_signal(signal.SIGINT)
        return get_batch(*args, **kw)
    previous = signal.signal(signal.SIGINT, lambda *_: None)  # unarmed guard: the run fails, not the session
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(train, "get_batch", batch_then_ctrl_c)
            return train.train(cfg, **kwargs)
    finally:
        signal.signal(signal.SIGINT, previous)
