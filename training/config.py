"""The training configuration: one typed, frozen dataclass, filled from TOML and --field=value.

Field names follow nanoGPT's (learning_rate, max_iters, ...) so its command lines carry over.
`--help` is generated from the fields below, so it cannot drift from what the code accepts.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model import GPTConfig
from model.gpt import ATTN_BACKENDS, POS_EMBS

# seeds of derived streams (seed + 1 for evals, seed + rank + world * step under torchrun) must stay
# inside torch's 64-bit seed range
MAX_SEED = 2**62
ATTENTION_PROMPT_CHARS = 32  # default attention prompt: 32 x 32 cells per head stay readable


def _f(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field carrying its one-line description (and valid choices) for --help."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a run needs. Validated on construction; errors name the field."""

    # data
    dataset: str = _f("shakespeare_char",
                      "'shakespeare_char', a UTF-8 text file, a folder of .txt files, or hf:NAME[:SPLIT]")
    split: str = _f("", "hf: datasets only: the split to read ('' = all splits, concatenated)")
    text_column: str = _f("", "hf: datasets only: the text column ('' = 'text' or the only string column)")
    cache_dir: str = _f("data_cache", "where downloads and encoded corpora are cached")
    out_dir: str = _f("out", "run directory: checkpoint, summary.json, config, TensorBoard events")
    # model
    n_layer: int = _f(6, "number of transformer blocks")
    n_head: int = _f(6, "attention heads per block (must divide n_embd)")
    n_embd: int = _f(384, "embedding width")
    block_size: int = _f(256, "context length in tokens")
    dropout: float = _f(0.2, "dropout probability (embeddings, attention weights, residuals)")
    bias: bool = _f(False, "biases in Linear and LayerNorm layers")
    attn_backend: str = _f("manual", "attention implementation: from scratch, or PyTorch's fused kernel", ATTN_BACKENDS)
    # later techniques (see model/gpt.py and benchmarks/RESULTS.md); the defaults are nanoGPT's
    pos_emb: str = _f("learned", "position information: a learned table, or rotary q/k (rope)", POS_EMBS)
    qk_norm: bool = _f(False, "RMS-normalise queries and keys per head")
    # optimisation
    batch_size: int = _f(64, "sequences per micro-batch")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step")
    max_iters: int = _f(5000, "optimizer steps")
    learning_rate: float = _f(1e-3, "peak learning rate")
    min_lr: float = _f(1e-4, "learning rate at the end of the decay (cosine or wsd), and after it")
    warmup_iters: int = _f(100, "steps of linear warmup")
    lr_decay_iters: int = _f(5000, "step at which the decay (cosine or wsd) reaches min_lr")
    weight_decay: float = _f(0.1, "AdamW weight decay (2-D weights only)")
    optimizer: str = _f("adamw", "AdamW for everything, or Muon for the blocks' matrices + AdamW for the rest",
                        ("adamw", "muon"))
    muon_lr: float = _f(0.02, "Muon's peak learning rate (scheduled like learning_rate)")
    muon_momentum: float = _f(0.95, "Muon's momentum")
    lr_schedule: str = _f("cosine", "warmup then cosine to min_lr, or wsd: warmup, stable, linear cooldown",
                          ("cosine", "wsd"))
    cooldown_frac: float = _f(0.3, "wsd only: the last fraction of lr_decay_iters spent decaying to min_lr")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.99, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the gradient norm to this (0 = off)")
    # evaluation and logging
    eval_interval: int = _f(250, "estimate train/val loss every this many steps")
    eval_iters: int = _f(200, "batches per loss estimate")
    log_interval: int = _f(10, "update the progress line every this many steps")
    exact_val: bool = _f(True, "at the end, compute the exact loss over the whole val split")
    always_save_checkpoint: bool = _f(False, "save at every eval, not only when val improves")
    tensorboard: bool = _f(True, "write TensorBoard event files to out_dir")
    sample_prompt: str = _f("", "prompt of the TensorBoard text sample at each eval ('' = newline, "
                                "or the first vocabulary character)")
    sample_tokens: int = _f(200, "characters in the TensorBoard text sample at each eval (0 = no sample)")
    attention_prompt: str = _f("", "text whose attention maps TensorBoard shows at each eval ('' = the first "
                                   f"{ATTENTION_PROMPT_CHARS} characters of the val split)")
    # system
    seed: int = _f(1337, "seeds the model init, the batch generator and dropout")
    device: str = _f("auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps")
    dtype: str = _f("auto", "compute dtype for autocast (auto = bfloat16 on CUDA when supported, and on CPUs "
                    "with AMX when batch_size * block_size * n_embd >= 65536; else float32)",
                    ("auto", "float32", "bfloat16", "float16"))
    compile: str = _f("auto", "torch.compile the model (auto = on for CUDA)", ("auto", "true", "false"))
    resume: bool = _f(False, "continue from out_dir/ckpt.pt")
    peak_tflops: float = _f(0.0, "device peak TFLOP/s for MFU (0 = known GPUs only; no MFU on CPU)")

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), hints[f.name]
            ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))  # TOML's 1 for 1.0
                ok = True
            if not ok:
                raise ValueError(f"config field {f.name} must be {kind.__name__}, got {value!r}")
            if kind is float and not math.isfinite(value):
                raise ValueError(f"config field {f.name} must be a finite number, got {value!r}")
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ValueError(f"config field {f.name}={value!r} is not one of {', '.join(choices)}")
        positive = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "gradient_accumulation_steps",
                    "max_iters", "learning_rate", "eval_interval", "eval_iters", "log_interval")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("min_lr", "warmup_iters", "lr_decay_iters", "weight_decay", "grad_clip", "peak_tflops",
                     "sample_tokens", "muon_lr"):
            if getattr(self, name) < 0:
                raise ValueError(f"config field {name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"config field dropout must be in [0, 1), got {self.dropout!r}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"config field {name} must be in [0, 1), got {getattr(self, name)!r}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"config field seed must be in [0, 2**62], got {self.seed!r}")
        for name in ("cooldown_frac", "muon_momentum"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"config field {name} must be in [0, 1], got {getattr(self, name)!r}")
        for name in ("split", "text_column"):
            if getattr(self, name) and not self.dataset.startswith("hf:"):
                raise ValueError(f"config field {name}={getattr(self, name)!r} applies to hf: datasets only, "
                                 f"not dataset={self.dataset!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"config field n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.lr_decay_iters < self.warmup_iters < self.max_iters:
            # lr_at gives warmup precedence and then min_lr at once: a jump, never a decay
            raise ValueError(f"config field lr_decay_iters={self.lr_decay_iters} ends the decay before "
                             f"warmup_iters={self.warmup_iters} ends, so the learning rate would drop from the "
                             f"warmup straight to min_lr at step {self.warmup_iters}; give lr_decay_iters >= "
                             f"warmup_iters (usually lr_decay_iters = max_iters={self.max_iters})")
        if self.min_lr > self.learning_rate:
            raise ValueError(f"config field min_lr={self.min_lr} exceeds learning_rate={self.learning_rate}")
        if not (self.device in ("auto", "cpu", "cuda", "mps") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ValueError(f"config field device={self.device!r} is not one of auto, cpu, cuda, cuda:N, mps")

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The architecture this config describes, for a corpus with vocab_size symbols."""
        return GPTConfig(vocab_size=vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, dropout=self.dropout, bias=self.bias,
                         attn_backend=self.attn_backend, pos_emb=self.pos_emb, qk_norm=self.qk_norm)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (config.json, the checkpoint's config, TensorBoard hparams)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed, validated like a new config."""
        return dataclasses.replace(self, **changes)


def _field_map() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TrainConfig)}


def parse_value(name: str, text: str) -> Any:
    """Parse a command-line string as the type of config field `name`."""
    fields = _field_map()
    if name not in fields:
        raise ValueError(f"unknown config key {name!r}; valid keys: {', '.join(fields)}")
    kind = typing.get_type_hints(TrainConfig)[name]
    try:
        if kind is bool:
            low = text.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        return kind(text)
    except ValueError:
        raise ValueError(f"config key {name}: {text!r} is not a valid {kind.__name__}") from None


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a config file as plain data (TOML is never executed)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except OSError as e:  # a directory (`python train.py configs`), no permission
        raise ValueError(f"config file {path}: cannot read it ({e.strerror}); give a .toml file such as "
                         "configs/debug.toml") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    fields = _field_map()
    for key in data:
        if key not in fields:
            raise ValueError(f"unknown config key {key!r} in {path}; valid keys: {', '.join(fields)}")
    return data


def parse_args(argv: list[str]) -> tuple[TrainConfig, list[str]]:
    """`[CONFIG.toml] [--field=value | --field value | --flag] ...` -> (config, argv it came from).

    The file is applied first, then the overrides in order. A bare --flag sets a bool field to true.
    """
    values: dict[str, Any] = {}
    fields = _field_map()
    hints = typing.get_type_hints(TrainConfig)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            if i != 0:
                raise ValueError(f"unexpected argument {arg!r}: only the config file may come without --")
            values.update(load_toml(arg))
            i += 1
            continue
        key, eq, text = arg[2:].partition("=")
        if key not in fields:
            raise ValueError(f"unknown config key {key!r}; valid keys: {', '.join(fields)}")
        if not eq:
            takes_flag = hints[key] is bool or "true" in (fields[key].metadata.get("choices") or ())
            if takes_flag and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
                text = "true"
            elif i + 1 < len(argv):
                i += 1
                text = argv[i]
            else:
                raise ValueError(f"config key {key} needs a value: --{key}=VALUE")
        values[key] = parse_value(key, text)
        i += 1
    return TrainConfig(**values), argv


def help_text(prog: str = "train.py") -> str:
    """Usage and every config field with its type, default and description."""
    lines = [
        f"usage: python {prog} [CONFIG.toml] [--field=value ...]",
        "",
        "Trains a character-level GPT. The TOML file (e.g. configs/shakespeare_char.toml) is applied",
        "first, then the --field=value overrides. A bare --flag sets a bool field to true.",
        "",
        "fields:",
    ]
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        kind = "|".join(f.metadata["choices"]) if f.metadata.get("choices") else hints[f.name].__name__
        lines.append(f"  --{f.name}={kind}  (default: {f.default!r})")
        lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)
