"""Checkpoints: written atomically, read with weights_only=True, holding only plain data.

One module for train.py (save, resume) and sample.py (load a model to sample from).
A checkpoint is a dict of tensors, numbers, strings, lists and dicts:
    format    "gpt-char-ckpt/1", so a file that is not ours is recognised
    model     state_dict of the uncompiled, unwrapped module (no "_orig_mod." prefixes)
    model_config, config, vocab   plain dicts (GPTConfig, TrainConfig, CharTokenizer)
    optimizer, step, best_val_loss, rng   what --resume needs to continue the same run
    history   the evals so far, so that a resumed run's summary.json lists them all
    interrupted   the signal name, only in a checkpoint saved when a signal stopped the run
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from data import CharTokenizer, atomic_file
from model import GPT, GPTConfig

FORMAT = "gpt-char-ckpt/1"
CKPT_NAME = "ckpt.pt"
# the advice in "no checkpoint" errors: sample.py names a run by --out_dir or --ckpt, tests/causality.py by --ckpt
FIND_A_CHECKPOINT = "train a model there first, or give the --out_dir or --ckpt of a finished run"
# the GPTConfig fields a resumed run may change: neither alters the weights nor the function they
# compute in eval mode. Every other field (sizes, pos_emb, qk_norm, ...) must match the checkpoint.
RESUME_MAY_CHANGE = ("dropout", "attn_backend")


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write state to path so that path always holds a complete checkpoint.

    The bytes go to a temporary file in the same directory, are flushed and fsync'ed, and only then
    renamed over path (rename is atomic within a filesystem). A crash, a kill or a full disk at any
    moment leaves either the old checkpoint or the new one, never a torn file. A failed save removes
    its temporary file; one left by a killed process is removed by remove_partial_saves.

    Raises:
        OSError: the write failed (e.g. disk full); the message says the previous checkpoint is intact.
    """
    path = Path(path)
    try:
        with atomic_file(path, fsync=True) as f:
            torch.save({"format": FORMAT, **state}, f)
    except OSError as e:
        raise OSError(e.errno, f"could not write checkpoint {path}: {e.strerror or e}; the previous "
                               f"checkpoint there (if any) is intact") from e
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def remove_partial_saves(path: str | Path) -> list[Path]:
    """Delete the temporary files that writes of `path` killed mid-write left behind; returns them.

    save_checkpoint and data.write_atomic both name them `.NAME.*.tmp` beside `path`. They are never
    read (load_checkpoint opens only `path`), so this is tidying, not recovery. Call it only while no
    other process writes the same path.
    """
    path = Path(path)
    stale = sorted(path.parent.glob(f".{path.name}.*.tmp"))
    for tmp in stale:
        tmp.unlink(missing_ok=True)
    return stale


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint with weights_only=True (no code in the file can run) and check its shape.

    Before unpickling, every record's CRC-32 in the archive is checked: torch.load itself does not,
    so a flipped byte in the weights would otherwise load as silently wrong numbers.

    Raises:
        ValueError: the file or its directory is missing, or it is truncated, corrupt, holds pickled
            objects, or is not a checkpoint of this project; the message says which.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"no checkpoint at {path}: the directory {path.parent} does not exist "
                         f"({FIND_A_CHECKPOINT})")
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a checkpoint file: give its ckpt.pt, or the "
                         "directory as --out_dir")
    if not path.is_file():
        raise ValueError(f"no checkpoint at {path} ({FIND_A_CHECKPOINT}; a run saves its first checkpoint "
                         "at its first eval after step 0)")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"{path} is not a checkpoint: not a complete PyTorch archive (truncated, or "
                         f"another kind of file): {e}") from None
    if bad is not None:
        raise ValueError(f"{path} is corrupt: record {bad!r} fails its CRC-32 check (the file changed "
                         "after it was written); use another checkpoint")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} holds pickled objects other than tensors and plain data; refused, "
                         f"since loading them could run code: {str(e).splitlines()[-1]}") from None
    except Exception as e:  # torch raises several types for damaged archives
        raise ValueError(f"{path} is not a loadable checkpoint (corrupt): {type(e).__name__}: {e}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path} is not a checkpoint written by this project (format {FORMAT})")
    for key in ("model", "model_config", "config", "vocab", "step"):
        if key not in ckpt:
            raise ValueError(f"checkpoint {path} lacks {key!r}")
    return ckpt


def model_from_checkpoint(ckpt: dict[str, Any], device: str | torch.device = "cpu",
                          **overrides: Any) -> tuple[GPT, CharTokenizer]:
    """Rebuild the model and tokenizer a checkpoint describes; overrides replace GPTConfig fields
    that do not change the weights' shapes (e.g. attn_backend, dropout).

    Raises:
        ValueError: the checkpoint contradicts itself (its vocabulary, config and weights disagree).
    """
    tok = CharTokenizer.from_dict(ckpt["vocab"])
    try:
        cfg = GPTConfig(**{**ckpt["model_config"], **overrides})
    except TypeError as e:  # a key GPTConfig does not have
        raise ValueError(f"checkpoint model_config does not describe a GPT: {e}") from None
    if cfg.vocab_size != tok.vocab_size:
        raise ValueError(f"checkpoint vocab_size {cfg.vocab_size} != its vocabulary's {tok.vocab_size}")
    model = GPT(cfg)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise ValueError(f"checkpoint weights do not match its architecture: {e}") from None
    return model.to(device), tok


def check_resumable(ckpt: dict[str, Any], want: GPTConfig, vocab: CharTokenizer) -> None:
    """Refuse to resume from a checkpoint whose architecture or vocabulary differs from this run's.

    Only RESUME_MAY_CHANGE (dropout, attn_backend) may differ; any other GPTConfig field, including
    options added later, must match.

    Raises:
        ValueError: naming each differing field, or the characters only one vocabulary has.
    """
    have, want_d = ckpt["model_config"], want.to_dict()
    diff = [f"{k}: checkpoint {have.get(k)!r} vs config {want_d[k]!r}" for k in want_d
            if k not in RESUME_MAY_CHANGE and have.get(k) != want_d[k]]
    if diff:
        raise ValueError("cannot resume: the checkpoint's architecture differs: " + "; ".join(diff))
    theirs = CharTokenizer.from_dict(ckpt["vocab"])
    if theirs != vocab:
        only_ckpt = sorted(set(theirs.chars) - set(vocab.chars))
        only_here = sorted(set(vocab.chars) - set(theirs.chars))
        raise ValueError(
            f"cannot resume: the checkpoint was trained on another vocabulary ({theirs.vocab_size} symbols; "
            f"this corpus has {vocab.vocab_size}); only in the checkpoint: {_show(only_ckpt)}; only in the "
            f"corpus: {_show(only_here)}. Resume with the dataset it was trained on, or drop --resume"
        )


def _show(chars: list[str], limit: int = 10) -> str:
    shown = ", ".join(repr(c) for c in chars[:limit])
    return (shown + f", ... ({len(chars)} in all)" if len(chars) > limit else shown) or "none"
