"""Checkpoints: contents, atomic writes, weights_only reads, resuming."""

import itertools
import json
import math
import os
import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from data import CharTokenizer
from model import GPT, GPTConfig

FORMAT = "gpt-char-ckpt/1"
CKPT_NAME = "ckpt.pt"


def write_atomic(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """write(f) into `.NAME.*.tmp` beside path, then rename it durably over path."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        with open(tmp, "xb") as f:  # not mkstemp: keeps the umask's permissions
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def json_safe(value: Any) -> Any:
    """value as strict-JSON data: non-finite floats become None."""
    return json.loads(json.dumps(value), parse_constant=lambda _: None)


def write_json(path: str | Path, value: Any) -> None:
    """value as strict JSON, written atomically."""
    write_atomic(path, lambda f: f.write(json.dumps(json_safe(value), indent=2).encode()))


def run_folder(cfg: Any, claim: bool = False) -> tuple[Path, str | None, bool | None]:
    """Where a run writes: cfg.out_dir, unless it holds another run and cfg says neither resume nor overwrite;
    then a new folder beside it, named for the dataset when that differs (out/x-mytext, out/x-2, ...), and a
    note saying so. claim (a new run's rank 0): take it by creating its config.json exclusively, so runs started
    at once never share a folder. Last: True if the folder is new, False if an empty one, None if a run's."""
    out = Path(cfg.out_dir)
    if cfg.resume or cfg.overwrite:
        return out, None, free(out, claim=False)
    try:
        theirs = json.loads((out / "config.json").read_text())["config"]["dataset"]
    except (OSError, ValueError, KeyError, TypeError):
        theirs = None
    ours = Path(cfg.dataset.removeprefix("hf:").split(":")[0]).stem or "data"
    base = out.name if theirs in (None, cfg.dataset) else f"{out.name}-{ours}"
    for name in itertools.chain([base], (f"{base}-{i}" for i in itertools.count(2))):
        if (new := free(out.parent / name, claim)) is not None:
            break
    folder = out.parent / name
    resume = "--resume continues that run, " if (out / CKPT_NAME).exists() else ""  # only a saved run resumes
    return folder, None if folder == out else (f"{out} holds another run" + (f" (of {theirs})" if theirs else "") +
                                               f": this one writes to {folder} ({resume}--overwrite replaces it)"), new


def free(folder: Path, claim: bool) -> bool | None:
    """None if folder holds a run, else whether it is new; claim: make it and its config.json, exclusively (None if
    another run did first)."""
    if (folder / CKPT_NAME).exists() or not claim and (folder / "config.json").exists():
        return None
    new = not folder.exists()
    if claim:
        make_folder(folder)
        try:
            (folder / "config.json").open("x").close()  # atomic; write_json replaces it
        except FileExistsError:
            return None
    return new


def make_folder(out: Path) -> None:
    """mkdir -p out, refusing a path that cannot be a folder."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"out_dir={out}: cannot create it as a directory ({e.strerror}); give another "
                         "--out_dir") from None


def prepare_run_folder(cfg: Any, facts: dict) -> None:
    """Create out_dir, delete temporary files of killed writes (and, with --overwrite, the replaced run's checkpoint,
    curves and summary), and write config.json (facts)."""
    out = Path(cfg.out_dir)
    make_folder(out)
    stale = list(out.glob(".*.tmp"))
    if cfg.overwrite:  # else its curves mix with this one's, its weights pass for this run's
        stale += [*out.glob("events.out.tfevents.*"), out / "summary.json", out / CKPT_NAME]
    for path in stale:
        path.unlink(missing_ok=True)
    write_json(out / "config.json", facts)


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write state to path atomically and durably."""
    try:
        write_atomic(path, lambda f: torch.save({"format": FORMAT, **state}, f))
    except OSError as e:
        raise OSError(e.errno, f"could not write checkpoint {path}: {e.strerror or e}; the previous "
                               "checkpoint there (if any) is intact") from e


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu",
                    needs: tuple[str, ...] = ("model", "model_config", "vocab")) -> dict[str, Any]:
    """Read with weights_only=True after checking each record's CRC-32 (torch.load does not); refuse one without the
    entries `needs` (sampling's by default)."""
    path = Path(path)
    if path.is_dir():
        way = f"give {path / CKPT_NAME}" if (path / CKPT_NAME).is_file() else f"it holds no {CKPT_NAME} either"
        raise ValueError(f"{path} is a directory, not a checkpoint: {way}")
    if not path.is_file():
        raise ValueError(f"no checkpoint at {path}: train one (python train.py) or give another --out_dir or --ckpt")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except zipfile.BadZipFile as e:
        raise ValueError(f"{path} is not a checkpoint: not a complete PyTorch archive ({e})") from None
    except OSError as e:  # e.g. another user's, unreadable
        raise ValueError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    if bad is not None:
        raise ValueError(f"{path} is corrupt: record {bad!r} fails its CRC-32 check; use another checkpoint")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))  # the object torch refused, in its long text
        raise ValueError(f"{path} holds pickled objects other than tensors and plain data; refused (they could "
                         f"run code): {found[1] if found else str(e).splitlines()[-1]}") from None
    except Exception as e:  # noqa: BLE001 - torch raises many types here
        raise ValueError(f"{path} is not a loadable checkpoint: {type(e).__name__}: {e}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path} is not a checkpoint written by this project (format {FORMAT})")
    if missing := [k for k in needs if k not in ckpt]:  # a hand-edited file: say so, not KeyError
        raise ValueError(f"{path} is an incomplete checkpoint: it has no {', '.join(missing)}; use another checkpoint")
    return ckpt


def model_from_checkpoint(ckpt: dict[str, Any], device: str | torch.device = "cpu",
                          **overrides: Any) -> tuple[GPT, CharTokenizer]:
    """Model and tokenizer of ckpt; overrides: GPTConfig fields (dropout, attn_backend)."""
    try:
        model = GPT(GPTConfig(**{**ckpt["model_config"], **overrides}))
        model.load_state_dict(ckpt["model"])
    except (TypeError, RuntimeError) as e:  # TypeError: a field this version lacks
        newer = " (a newer version's checkpoint: use that version)" if isinstance(e, TypeError) else ""
        raise ValueError(f"checkpoint model_config does not fit its weights: {e}{newer}") from None
    return model.to(device), CharTokenizer.from_dict(ckpt["vocab"])


def training_state(model: GPT, optimizers: list[torch.optim.Optimizer], cfg: Any, tok: CharTokenizer, step: int,
                   best_val: float, batch_gen: torch.Generator, history: list[dict]) -> dict[str, Any]:
    """Checkpoint contents to continue after `step` optimizer steps, RNG streams included."""
    rng = {"torch": torch.get_rng_state(), "batch": batch_gen.get_state()}
    if model.tok_emb.weight.is_cuda:
        rng["cuda"] = torch.cuda.get_rng_state(model.tok_emb.weight.device)
    return {"model": model.state_dict(), "model_config": model.config.to_dict(), "config": cfg.to_dict(),
            "vocab": tok.to_dict(), "optimizers": [o.state_dict() for o in optimizers], "step": step,
            "best_val_loss": best_val, "rng": rng, "history": list(history)}


def checkpoint_to_resume(cfg: Any, model_config: GPTConfig, tok: CharTokenizer, device: torch.device) -> dict[str, Any]:
    """The checkpoint --resume continues; ValueError (before any write) if it cannot."""
    path = Path(cfg.out_dir) / CKPT_NAME
    if not path.exists():
        where = f"beside it (--overwrite: in {path.parent})" if (path.parent / "config.json").exists() else "there"
        raise ValueError(f"--resume: no checkpoint at {path}; without --resume the run starts afresh {where}")
    ckpt = load_checkpoint(path, device, ("model", "model_config", "config", "vocab", "optimizers", "step",
                                          "best_val_loss", "rng", "history"))  # training_state's
    try:
        have = GPTConfig(**ckpt["model_config"]).to_dict()  # a field added since: its default
    except TypeError as e:  # a field this version lacks: a newer version's checkpoint
        raise ValueError(f"cannot resume: {path}'s model_config does not fit this version's GPTConfig ({e}). Drop "
                         "--resume to start afresh, or give a new --out_dir to keep the old run") from None
    theirs = CharTokenizer.from_dict(ckpt["vocab"])
    if theirs != tok:  # first: another dataset changes vocab_size too
        raise ValueError("cannot resume: the checkpoint has another vocabulary (differing: "
                         f"{sorted(set(theirs.chars) ^ set(tok.chars))[:10]}). Use its dataset, or drop --resume")
    diff = [f"{k}: checkpoint {have.get(k)!r} vs config {v!r}" for k, v in model_config.to_dict().items()
            if k not in ("dropout", "attn_backend") and have.get(k) != v]  # neither changes what eval computes
    if diff:
        raise ValueError(f"cannot resume: the architecture differs ({'; '.join(diff)}). Drop --resume to start "
                         "afresh, or give a new --out_dir to keep the old run")
    # the optimizers' state would not fit; the eval batches and the other ranks' streams follow the seed
    for name, theirs in (("optimizer", ckpt["config"].get("optimizer", "adamw")), ("seed", ckpt["config"].get("seed"))):
        if theirs not in (None, getattr(cfg, name)):
            raise ValueError(f"cannot resume: {name}: checkpoint {theirs!r} vs config {getattr(cfg, name)!r}. Give "
                             f"--{name}={theirs}, or drop --resume")
    step, ended = ckpt["step"], finished_at(path.parent / "summary.json", ckpt)
    if step > cfg.max_iters:
        raise ValueError(f"--resume: {path} is at step {step}, past max_iters={cfg.max_iters}; give --max_iters > "
                         f"{step}")
    if ended is not None and ended >= cfg.max_iters:  # the checkpoint may hold an earlier step: the best val's
        at = "= max_iters" if step == ended else f"(the best val estimate's), and the run ended at step {ended}"
        raise ValueError(f"--resume: {path} is at step {step} {at}: the run is finished (see "
                         f"{path.parent / 'summary.json'}); give --max_iters > {ended}")
    return ckpt


def finished_at(summary: Path, ckpt: dict[str, Any]) -> int | None:
    """The step a run ended at, if summary (its summary.json) says it finished after ckpt was saved; else None. An
    interrupted ckpt is newer than a finished summary, unless that summary's run resumed from it (and never saved)."""
    try:
        facts = json.loads(summary.read_text())
        newer = ckpt.get("interrupted") and facts.get("checkpoint_step") != ckpt["step"]
        ended = None if facts["interrupted"] or newer else int(facts["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ended if ended is not None and ended >= ckpt["step"] else None


def restore(ckpt: dict[str, Any] | None, optimizers: list[torch.optim.Optimizer], batch_gen: torch.Generator,
            device: torch.device) -> tuple[int, float, list[dict]]:
    """Restore optimizer and RNG states; returns (step, best val loss, evals up to step)."""
    if ckpt is None:
        return 0, math.inf, []
    for opt, state in zip(optimizers, ckpt["optimizers"], strict=True):
        opt.load_state_dict(state)
    torch.set_rng_state(ckpt["rng"]["torch"].cpu())
    batch_gen.set_state(ckpt["rng"]["batch"].cpu())
    if device.type == "cuda" and "cuda" in ckpt["rng"]:
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"].cpu(), device)
    return ckpt["step"], ckpt["best_val_loss"], ckpt["history"]  # saved with the evals up to its step
