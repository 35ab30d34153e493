"""Checkpoints: written atomically, read with weights_only=True, holding only plain data.

One module for train.py (save, resume) and sample.py (load a model to sample from).
A checkpoint is a dict of tensors, numbers, strings, lists and dicts:
    format    "gpt-char-ckpt/1", so a file that is not ours is recognised
    model     state_dict of the uncompiled, unwrapped module (no "_orig_mod." prefixes)
    model_config, config, vocab   plain dicts (GPTConfig, TrainConfig, CharTokenizer)
    optimizer, step, best_val_loss, rng, tb_step   what --resume needs to continue the same run
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from data import CharTokenizer
from model import GPT, GPTConfig

FORMAT = "gpt-char-ckpt/1"
CKPT_NAME = "ckpt.pt"


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write state to path so that path always holds a complete checkpoint.

    The bytes go to a temporary file in the same directory, are flushed and fsync'ed, and only then
    renamed over path (rename is atomic within a filesystem). A crash, a kill or a full disk at any
    moment leaves either the old checkpoint or the new one, never a torn file.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint with weights_only=True (no code in the file can run) and check its shape.

    Raises:
        ValueError: the file is missing, truncated, corrupt, holds pickled objects, or is not a
            checkpoint of this project; the message says which.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises several types for truncated/corrupt/unsafe files
        raise ValueError(f"{path} is not a loadable checkpoint (truncated, corrupt, or it holds "
                         f"objects other than plain data): {type(e).__name__}: {e}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path} is not a checkpoint written by this project (format {FORMAT})")
    for key in ("model", "model_config", "config", "vocab", "step"):
        if key not in ckpt:
            raise ValueError(f"checkpoint {path} lacks {key!r}")
    return ckpt


def model_from_checkpoint(ckpt: dict[str, Any], device: str | torch.device = "cpu",
                          **overrides: Any) -> tuple[GPT, CharTokenizer]:
    """Rebuild the model and tokenizer a checkpoint describes; overrides replace GPTConfig fields
    that do not change the weights' shapes (e.g. attn_backend, dropout)."""
    tok = CharTokenizer.from_dict(ckpt["vocab"])
    cfg = GPTConfig(**{**ckpt["model_config"], **overrides})
    if cfg.vocab_size != tok.vocab_size:
        raise ValueError(f"checkpoint vocab_size {cfg.vocab_size} != its vocabulary's {tok.vocab_size}")
    model = GPT(cfg)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise ValueError(f"checkpoint weights do not match its architecture: {e}") from None
    return model.to(device), tok
