"""The training configuration: one typed, frozen dataclass, filled from TOML and --field=value.

Field names follow nanoGPT's (learning_rate, max_iters, ...) so its command lines carry over. `--help`
is generated from the fields, so it cannot drift from what the code accepts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model import GPTConfig
from model.gpt import ATTN_BACKENDS, POS_EMBS

MAX_SEED = 2**62  # derived seeds (seed + 1, seed + rank + world * step) stay inside torch's 64-bit range


def _f(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field carrying its --help line and its valid choices."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a run needs. Validated on construction; errors name the field."""

    # data
    dataset: str = _f("shakespeare_char", "'shakespeare_char' (bundled), a UTF-8 text file, a folder of .txt "
                                          "files, or hf:NAME[:SPLIT]")
    split: str = _f("", "hf: datasets only: the split to read ('' = all, concatenated)")
    text_column: str = _f("", "hf: datasets only: the text column ('' = 'text' or the only string column)")
    out_dir: str = _f("out", "run directory: checkpoint, summary.json, config.json, TensorBoard events")
    # model
    n_layer: int = _f(6, "number of transformer blocks")
    n_head: int = _f(6, "attention heads per block (must divide n_embd)")
    n_embd: int = _f(384, "embedding width")
    block_size: int = _f(256, "context length in tokens")
    dropout: float = _f(0.2, "dropout probability (embeddings, attention weights, residuals)")
    bias: bool = _f(False, "biases in Linear and LayerNorm layers")
    attn_backend: str = _f("manual", "the from-scratch attention, or PyTorch's fused kernel with the same mask",
                           ATTN_BACKENDS)
    pos_emb: str = _f("learned", "positions: a learned table, or rotary q/k (rope)", POS_EMBS)
    qk_norm: bool = _f(False, "RMS-normalise queries and keys per head")
    # optimisation
    batch_size: int = _f(64, "sequences per micro-batch")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step")
    max_iters: int = _f(5000, "optimizer steps")
    learning_rate: float = _f(1e-3, "peak learning rate")
    min_lr: float = _f(1e-4, "learning rate at the end of the decay, and after it")
    warmup_iters: int = _f(100, "steps of linear warmup")
    lr_decay_iters: int = _f(5000, "step at which the decay (cosine or wsd) reaches min_lr")
    lr_schedule: str = _f("cosine", "warmup then cosine to min_lr, or wsd: warmup, stable, linear cooldown",
                          ("cosine", "wsd"))
    cooldown_frac: float = _f(0.3, "wsd only: the last fraction of lr_decay_iters spent decaying to min_lr")
    optimizer: str = _f("adamw", "AdamW for everything, or Muon for the blocks' matrices + AdamW for the rest",
                        ("adamw", "muon"))
    muon_lr: float = _f(0.02, "Muon's peak learning rate (scheduled like learning_rate)")
    muon_momentum: float = _f(0.95, "Muon's momentum")
    weight_decay: float = _f(0.1, "AdamW weight decay (2-D weights only)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.99, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the gradient norm to this (0 = off)")
    # evaluation and logging
    eval_interval: int = _f(250, "estimate train/val loss every this many steps")
    eval_iters: int = _f(200, "batches per loss estimate")
    log_interval: int = _f(10, "update the progress line every this many steps")
    exact_val: bool = _f(True, "at the end, the exact loss over the whole val split")
    always_save_checkpoint: bool = _f(False, "save at every eval, not only when val improves")
    tensorboard: bool = _f(True, "write TensorBoard event files to out_dir")
    sample_tokens: int = _f(200, "characters of the TensorBoard text sample at each eval (0 = none)")
    # system
    seed: int = _f(1337, "seeds the model init, the batches and dropout")
    device: str = _f("auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps")
    dtype: str = _f("auto", "autocast dtype; auto = bfloat16 on CUDA, and on a CPU where bf16 matmuls measure "
                            "faster (AMX, AVX512-BF16); else float32", ("auto", "float32", "bfloat16", "float16"))
    compile: str = _f("auto", "torch.compile the model (auto = on for CUDA)", ("auto", "true", "false"))
    resume: bool = _f(False, "continue from out_dir/ckpt.pt")
    peak_tflops: float = _f(0.0, "device peak TFLOP/s for MFU (0 = known GPUs only)")

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), hints[f.name]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, value := float(value))  # TOML's 1 for 1.0
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"config field {f.name} must be {kind.__name__}, got {value!r}")
            if kind is float and not math.isfinite(value):
                raise ValueError(f"config field {f.name} must be a finite number, got {value!r}")
            if f.metadata["choices"] and value not in f.metadata["choices"]:
                raise ValueError(f"config field {f.name}={value!r} is not one of {', '.join(f.metadata['choices'])}")
        ranges = {">= 1": ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "gradient_accumulation_steps",
                           "max_iters", "eval_interval", "eval_iters", "log_interval"),
                  "> 0": ("learning_rate",),
                  ">= 0": ("min_lr", "warmup_iters", "lr_decay_iters", "weight_decay", "grad_clip", "muon_lr",
                           "sample_tokens", "peak_tflops"),
                  "in [0, 1)": ("dropout", "beta1", "beta2"), "in [0, 1]": ("cooldown_frac", "muon_momentum")}
        tests = {">= 1": lambda v: v >= 1, "> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0,
                 "in [0, 1)": lambda v: 0 <= v < 1, "in [0, 1]": lambda v: 0 <= v <= 1}
        for rule, names in ranges.items():
            for name in names:
                if not tests[rule](getattr(self, name)):
                    raise ValueError(f"config field {name} must be {rule}, got {getattr(self, name)!r}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"config field seed must be in [0, 2**62], got {self.seed!r}")
        for name in ("split", "text_column"):
            if getattr(self, name) and not self.dataset.startswith("hf:"):
                raise ValueError(f"config field {name}={getattr(self, name)!r} applies to hf: datasets only")
        if self.n_embd % self.n_head:
            raise ValueError(f"config field n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.lr_decay_iters < self.warmup_iters < self.max_iters:
            raise ValueError(f"config field lr_decay_iters={self.lr_decay_iters} ends the decay before "
                             f"warmup_iters={self.warmup_iters} ends, so the learning rate would drop from the "
                             f"warmup straight to min_lr at step {self.warmup_iters}; give lr_decay_iters >= "
                             f"warmup_iters (usually lr_decay_iters = max_iters={self.max_iters})")
        if self.min_lr > self.learning_rate:
            raise ValueError(f"config field min_lr={self.min_lr} exceeds learning_rate={self.learning_rate}")
        if not (self.device in ("auto", "cpu", "cuda", "mps") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ValueError(f"config field device={self.device!r} is not one of auto, cpu, cuda, cuda:N, mps")

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The architecture this config describes, for a corpus of vocab_size symbols."""
        names = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size"}
        return GPTConfig(vocab_size=vocab_size, **{n: getattr(self, n) for n in names})

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (config.json, the checkpoint, TensorBoard hparams)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed, validated like a new config."""
        return dataclasses.replace(self, **changes)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def unknown_key(key: str, where: str = "") -> ValueError:
    """The error for a key TrainConfig does not have: the closest ones, else all of them."""
    close = difflib.get_close_matches(key, FIELDS, n=3)
    hint = f"did you mean {' or '.join(close)}?" if close else f"valid keys: {', '.join(FIELDS)}"
    return ValueError(f"unknown config key {key!r}{where}; {hint} (python train.py --help lists them)")


def parse_value(name: str, text: str) -> Any:
    """A command-line string as the type of config field `name`."""
    kind = typing.get_type_hints(TrainConfig)[name]
    if kind is bool:
        if text.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return text.lower() in ("true", "1", "yes", "on")
    else:
        try:
            return kind(text)
        except ValueError:
            pass
    raise ValueError(f"config key {name}: {text!r} is not a valid {kind.__name__}")


def load_toml(path: str | Path) -> dict[str, Any]:
    """A config file as plain data (TOML is never executed)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist (the shipped ones are in configs/)") from None
    except OSError as e:  # a directory, no permission
        raise ValueError(f"config file {path}: cannot read it ({e.strerror}); give a .toml file such as "
                         "configs/debug.toml") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    for key in data:
        if key not in FIELDS:
            raise unknown_key(key, f" in {path}")
    return data


def parse_args(argv: list[str]) -> TrainConfig:
    """`[CONFIG.toml] [--field=value | --field value | --flag] ...` -> the config: the file first, then the
    overrides in order. A bare --flag sets a bool field to true."""
    values: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            if i != 1:
                raise ValueError(f"unexpected argument {arg!r}: only the config file may come without --")
            values.update(load_toml(arg))
            continue
        key, eq, text = arg[2:].partition("=")
        if key not in FIELDS:
            raise unknown_key(key)
        if not eq:
            flag = FIELDS[key].type in (bool, "bool") or "true" in (FIELDS[key].metadata["choices"] or ())
            if flag and (i == len(argv) or argv[i].startswith("--")):
                text = "true"
            elif i < len(argv):
                text, i = argv[i], i + 1
            else:
                raise ValueError(f"config key {key} needs a value: --{key}=VALUE")
        values[key] = parse_value(key, text)
    return TrainConfig(**values)


def help_text() -> str:
    """Usage and every config field with its type, default and description."""
    hints = typing.get_type_hints(TrainConfig)
    lines = ["usage: python train.py [CONFIG.toml] [--field=value ...]", "",
             "Trains a character-level GPT. Without a config it picks the recipe for this machine (the GPU",
             "recipe on CUDA, the fast CPU recipe otherwise). The TOML file (e.g. configs/debug.toml) is",
             "applied first, then the --field=value overrides. A bare --flag sets a bool field to true.", "",
             "fields:"]
    for f in FIELDS.values():
        kind = "|".join(f.metadata["choices"]) if f.metadata["choices"] else hints[f.name].__name__
        lines += [f"  --{f.name}={kind}  (default: {f.default!r})", f"      {f.metadata['help']}"]
    return "\n".join(lines)
