"""Checkpoints, both directions: what one holds, how it is written and read, and how a run resumes.

A checkpoint is a dict of tensors and plain data, read with weights_only=True:
    format        "gpt-char-ckpt/1", so a file that is not ours is recognised
    model         state_dict of the uncompiled, unwrapped module (no "_orig_mod." prefixes)
    model_config, config, vocab   plain dicts (GPTConfig, TrainConfig, CharTokenizer)
    optimizers, step, best_val_loss, rng, history   what --resume needs to continue the same run
    interrupted   the signal name, only when a signal stopped the run
Every file of a run is written to a temporary file beside it and renamed over it, so a crash or a
kill at any moment leaves the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from data import CharTokenizer
from model import GPT, GPTConfig

FORMAT = "gpt-char-ckpt/1"
CKPT_NAME = "ckpt.pt"
RESUME_MAY_CHANGE = ("dropout", "attn_backend")  # neither changes the weights or what they compute in eval


def write_atomic(path: str | Path, write: Callable[[BinaryIO], object], fsync: bool = False) -> None:
    """write(f) into a temporary file beside path, then rename it over path (atomic in a filesystem).

    The temporary file is `.NAME.*.tmp`, made with open(), so it gets the umask's permissions; a failed
    write removes it and leaves the old file as it was; one a killed process left is removed by
    remove_partial_saves. fsync: flush to the disk before the rename, and the rename after it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def json_safe(value: Any) -> Any:
    """value with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return [json_safe(v) for v in value] if isinstance(value, list) else value


def write_json(path: str | Path, value: Any) -> None:
    """value as strict JSON (non-finite floats as null), written atomically."""
    write_atomic(path, lambda f: f.write(json.dumps(json_safe(value), indent=2).encode()))


def remove_partial_saves(out_dir: str | Path) -> None:
    """Delete the temporary files that writes killed mid-way left in out_dir (never read; tidying only)."""
    for tmp in Path(out_dir).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write state to path atomically and durably; an OSError (disk full) says the old one is intact."""
    try:
        write_atomic(path, lambda f: torch.save({"format": FORMAT, **state}, f), fsync=True)
    except OSError as e:
        raise OSError(e.errno, f"could not write checkpoint {path}: {e.strerror or e}; the previous "
                               "checkpoint there (if any) is intact") from e


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint with weights_only=True (no code in it can run), after checking every record's
    CRC-32 (torch.load does not: a flipped byte would load as a silently wrong weight).

    Raises:
        ValueError: missing, a directory, truncated, corrupt, holding pickled objects, or not ours.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a checkpoint file: give {path / CKPT_NAME}, or the "
                         "directory as --out_dir")
    if not path.is_file():
        where = "" if path.parent.is_dir() else f": the directory {path.parent} does not exist"
        raise ValueError(f"no checkpoint at {path}{where}; train a model there first (python train.py), or "
                         "give the --out_dir or --ckpt of a finished run")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"{path} is not a checkpoint: not a complete PyTorch archive ({e})") from None
    if bad is not None:
        raise ValueError(f"{path} is corrupt: record {bad!r} fails its CRC-32 check; use another checkpoint")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} holds pickled objects other than tensors and plain data; refused, since "
                         f"loading them could run code: {str(e).splitlines()[-1]}") from None
    except Exception as e:  # noqa: BLE001 - torch raises several types for damaged archives
        raise ValueError(f"{path} is not a loadable checkpoint: {type(e).__name__}: {e}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path} is not a checkpoint written by this project (format {FORMAT})")
    missing = [k for k in ("model", "model_config", "config", "vocab", "step") if k not in ckpt]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {', '.join(missing)}")
    return ckpt


def model_from_checkpoint(ckpt: dict[str, Any], device: str | torch.device = "cpu",
                          **overrides: Any) -> tuple[GPT, CharTokenizer]:
    """The model and tokenizer a checkpoint holds; overrides replace GPTConfig fields that do not change
    the weights' shapes (attn_backend, dropout)."""
    tok = CharTokenizer.from_dict(ckpt["vocab"])
    try:
        cfg = GPTConfig(**{**ckpt["model_config"], **overrides})
        model = GPT(cfg)
        model.load_state_dict(ckpt["model"])
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"checkpoint model_config and weights do not describe one GPT: {e}") from None
    if cfg.vocab_size != tok.vocab_size:
        raise ValueError(f"checkpoint vocab_size {cfg.vocab_size} != its vocabulary's {tok.vocab_size}")
    return model.to(device), tok


def rng_state(batch_gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """The random streams a resumed run must continue: dropout's (global, and CUDA's) and the batches'."""
    state = {"torch": torch.get_rng_state(), "batch": batch_gen.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def training_state(model: GPT, optimizers: list[torch.optim.Optimizer], cfg: Any, tok: CharTokenizer, step: int,
                   best_val: float, batch_gen: torch.Generator, history: list[dict]) -> dict[str, Any]:
    """What a checkpoint holds to continue a run from `step` (the optimizer steps taken so far)."""
    return {"model": model.state_dict(), "model_config": model.config.to_dict(), "config": cfg.to_dict(),
            "vocab": tok.to_dict(), "optimizers": [o.state_dict() for o in optimizers], "step": step,
            "best_val_loss": best_val, "rng": rng_state(batch_gen, model.tok_emb.weight.device),
            "history": list(history)}


def checkpoint_to_resume(cfg: Any, model_config: GPTConfig, tok: CharTokenizer,
                         device: torch.device) -> dict[str, Any]:
    """The checkpoint --resume continues, refused before anything is written if it cannot be continued:
    missing, another architecture or vocabulary, already past max_iters, or a finished run."""
    path = Path(cfg.out_dir) / CKPT_NAME
    if not path.exists():
        raise ValueError(f"--resume: no checkpoint at {path} to continue from; without --resume the run "
                         "starts afresh there")
    ckpt = load_checkpoint(path, map_location=device)
    have, want = ckpt["model_config"], model_config.to_dict()
    diff = [f"{k}: checkpoint {have.get(k)!r} vs config {v!r}" for k, v in want.items()
            if k not in RESUME_MAY_CHANGE and have.get(k) != v]
    if diff:
        raise ValueError(f"cannot resume: the checkpoint's architecture differs ({'; '.join(diff)}). Drop "
                         "--resume to start afresh, or give a new --out_dir to keep the old run")
    theirs = CharTokenizer.from_dict(ckpt["vocab"])
    if theirs != tok:
        only = sorted(set(theirs.chars) ^ set(tok.chars))
        raise ValueError(f"cannot resume: the checkpoint was trained on another vocabulary ({theirs.vocab_size} "
                         f"symbols, this corpus has {tok.vocab_size}; differing: {only[:10]}). Resume with the "
                         "dataset it was trained on, or drop --resume")
    if ckpt["step"] > cfg.max_iters:
        raise ValueError(f"--resume: {path} is at step {ckpt['step']}, past max_iters={cfg.max_iters}; give "
                         f"--max_iters > {ckpt['step']} to train on")
    if ckpt["step"] == cfg.max_iters and not ckpt.get("interrupted") and (path.parent / "summary.json").exists():
        raise ValueError(f"--resume: {path} is at step {ckpt['step']} = max_iters: the run is finished and its "
                         f"figures are in {path.parent / 'summary.json'}; give --max_iters > {ckpt['step']}")
    return ckpt


def restore(ckpt: dict[str, Any], optimizers: list[torch.optim.Optimizer], batch_gen: torch.Generator,
            device: torch.device) -> tuple[int, float, list[dict]]:
    """Put a checkpoint's optimizer and RNG states back; returns (step, best val loss, the evals before step)."""
    for opt, state in zip(optimizers, ckpt["optimizers"], strict=True):
        opt.load_state_dict(state)
    torch.set_rng_state(ckpt["rng"]["torch"].cpu())
    batch_gen.set_state(ckpt["rng"]["batch"].cpu())
    if device.type == "cuda" and "cuda" in ckpt["rng"]:
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"].cpu(), device)
    return ckpt["step"], ckpt["best_val_loss"], [h for h in ckpt["history"] if h["step"] < ckpt["step"]]
