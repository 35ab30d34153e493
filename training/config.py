"""Training config (nanoGPT's field names): frozen dataclass from TOML, then --field=value overrides. The one
command-line mechanism: sample.py's options are such a dataclass too."""

import dataclasses
import difflib
import math
import os
import re
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any, ClassVar, Self

from data import DOCUMENTS, decode_utf8
from model import GPTConfig
from model.gpt import ATTN_BACKENDS, POS_EMBS

MAX_SEED = 2**62  # seed + rank + world * step stays in torch's 64-bit range
RANGES = {  # a field's `rule`; GPTConfig checks the model's fields
    ">= 1": lambda v: v >= 1,
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    "in [0, 1)": lambda v: 0 <= v < 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "in [0, 2**62]": lambda v: 0 <= v <= MAX_SEED,
    "non-empty": lambda v: v.strip() != "",  # "" is Path("."): a run into, or of, the current folder
    "one of auto, cpu, cuda, cuda:N, mps": lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", v) is not None,
}
BOOLS = dict.fromkeys(("true", "1", "yes", "on"), True) | dict.fromkeys(("false", "0", "no", "off"), False)


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None, rule: str | None = None,
        bare: str | None = None) -> Any:
    """A field of a command line's dataclass: its --help text, allowed values, range rule, and the value a bare
    --name gives (bools and fields with a "true" choice: "true"; else None: it needs a value)."""
    if bare is None and (isinstance(default, bool) or "true" in (choices or ())):
        bare = "true"
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "rule": rule, "bare": bare})


def field_type(f: dataclasses.Field) -> type:
    """A field's type; `str | None` -> str (None: not given)."""
    return next(t for t in typing.get_args(f.type) or (f.type,) if t is not type(None))


def check_fields(options: Any) -> None:
    """Each field's type, finiteness, choices and range rule; errors name the field as options.FIELD does."""
    for f in dataclasses.fields(options):
        value, kind, choices, name = getattr(options, f.name), field_type(f), f.metadata["choices"], \
            options.FIELD + f.name
        if value is None and f.default is None:
            continue
        if kind is float and type(value) is int:
            object.__setattr__(options, f.name, value := float(value))  # TOML's 1 for 1.0
        if choices and type(value) is bool and str(value).lower() in choices:
            object.__setattr__(options, f.name, value := str(value).lower())  # TOML's true for "true"
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{name} must be {kind.__name__}, got {value!r}")
        if kind is float and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if choices and value not in choices:
            raise ValueError(f"{name}={value!r} is not one of {', '.join(c or repr(c) for c in choices)}")
        if f.metadata["rule"] and not RANGES[f.metadata["rule"]](value):
            raise ValueError(f"{name} must be {f.metadata['rule']}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a run needs, validated on construction."""

    PROGRAM: ClassVar[str] = "train.py"
    KEY: ClassVar[str] = "config key"  # how errors name an unknown option, and a field
    NANOGPT: ClassVar[dict[str, str]] = {"init_from": "resume"}  # its --init_from=resume
    FIELD: ClassVar[str] = "config field "
    USAGE: ClassVar[tuple[str, ...]] = (
        "usage: python train.py [CONFIG.toml] [--field=value ...]", "",
        "Trains a character-level GPT (no config: the recipe for this machine). The TOML file",
        "(e.g. configs/debug.toml) goes first, then overrides; a bare --flag sets a bool.", "", "fields:")
    dataset: str = opt("shakespeare_char", "shakespeare_char or surnames (bundled), a .txt file or folder, or "
                                           "hf:NAME[:SPLIT]", rule="non-empty")
    split: str = opt("", "hf: only: split ('' = all, concatenated)")
    text_column: str = opt("", "hf: only: text column ('' = 'text' or the only string column)")
    documents: str = opt("", "a document per line or per blank-line-separated paragraph of a file ('' = the file "
                             "is one text; a folder's files and an hf: dataset's rows are documents anyway)", DOCUMENTS)
    doc_mask: bool = opt(False, "no query reads a key of another document (needs documents)")
    out_dir: str = opt("out/run", "run folder: checkpoint, summary, config, TensorBoard events", rule="non-empty")
    n_layer: int = opt(6, "transformer blocks")
    n_head: int = opt(6, "attention heads (must divide n_embd)")
    n_embd: int = opt(384, "embedding width")
    block_size: int = opt(256, "context length in tokens")
    dropout: float = opt(0.2, "dropout on embeddings, attention, residuals")
    bias: bool = opt(False, "biases in Linear and LayerNorm")
    attn_backend: str = opt("manual", "from-scratch attention, or PyTorch's fused kernel", ATTN_BACKENDS)
    pos_emb: str = opt("learned", "learned position table, or rotary q/k (rope)", POS_EMBS)
    qk_norm: bool = opt(False, "RMS-normalise queries and keys per head")
    attn_window: int = opt(0, "sliding window: each query reads itself and the W - 1 keys before it (W keys, as "
                              "torchtitan counts; FlashAttention's window_size=(W - 1, 0)); 0 = every earlier key")
    batch_size: int = opt(64, "sequences per micro-batch", rule=">= 1")
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step", rule=">= 1")
    max_iters: int = opt(5000, "optimizer steps", rule=">= 1")
    learning_rate: float = opt(1e-3, "peak learning rate", rule="> 0")
    min_lr: float = opt(1e-4, "lr at the end of the decay and after", rule=">= 0")
    warmup_iters: int = opt(100, "linear warmup steps", rule=">= 0")
    lr_decay_iters: int = opt(5000, "step where the decay reaches min_lr", rule=">= 0")
    lr_schedule: str = opt("cosine", "cosine, or wsd: warmup, stable, linear cooldown", ("cosine", "wsd"))
    cooldown_frac: float = opt(0.3, "wsd: last fraction of lr_decay_iters spent decaying", rule="in [0, 1]")
    optimizer: str = opt("adamw", "AdamW, or Muon for the blocks' matrices (AdamW for the rest)", ("adamw", "muon"))
    muon_lr: float = opt(0.02, "Muon's peak lr (scheduled like learning_rate)", rule=">= 0")
    muon_momentum: float = opt(0.95, "Muon's momentum", rule="in [0, 1]")
    weight_decay: float = opt(0.1, "AdamW weight decay (2-D weights only)", rule=">= 0")
    beta1: float = opt(0.9, "AdamW beta1", rule="in [0, 1)")
    beta2: float = opt(0.99, "AdamW beta2", rule="in [0, 1)")
    grad_clip: float = opt(1.0, "gradient-norm clip (0 = off)", rule=">= 0")
    eval_interval: int = opt(250, "steps between train/val loss estimates", rule=">= 1")
    eval_iters: int = opt(200, "batches per loss estimate", rule=">= 1")
    log_interval: int = opt(10, "steps between progress-line updates", rule=">= 1")
    exact_val: bool = opt(True, "at the end, exact loss over the whole val split")
    always_save_checkpoint: bool = opt(False, "save at every eval, not only when val improves")
    tensorboard: bool = opt(True, "write TensorBoard events to out_dir")
    sample_tokens: int = opt(200, "characters of TensorBoard text sample per eval (0 = none)", rule=">= 0")
    seed: int = opt(1337, "seeds model init, batches and dropout", rule="in [0, 2**62]")
    device: str = opt("auto", "auto (cuda, mps, then cpu), cpu, cuda, cuda:N or mps",
                      rule="one of auto, cpu, cuda, cuda:N, mps")
    dtype: str = opt("auto", "autocast dtype (auto: bfloat16 where fast)", ("auto", "float32", "bfloat16", "float16"))
    compile: str = opt("auto", "torch.compile the model (auto: on CUDA, and on a CPU where runs here measured a "
                       "gain)", ("auto", "true", "false"))
    resume: bool = opt(False, "continue from out_dir/ckpt.pt")
    overwrite: bool = opt(False, "replace the run in out_dir, deleting its checkpoint, summary and curves at the "
                                 "start (default: a run there is kept; this one goes beside it)")
    peak_tflops: float = opt(0.0, "device peak TFLOP/s for MFU (0 = known GPUs only)", rule=">= 0")

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("split", "text_column"):
            if getattr(self, name) and not self.dataset.startswith("hf:"):
                raise ValueError(f"config field {name}={getattr(self, name)!r} applies to hf: datasets only")
        if self.lr_decay_iters < self.warmup_iters < self.max_iters:
            raise ValueError(f"config field lr_decay_iters={self.lr_decay_iters} ends the decay before "
                             f"warmup_iters={self.warmup_iters} ends; give lr_decay_iters >= warmup_iters")
        if self.min_lr > self.learning_rate:
            raise ValueError(f"config field min_lr={self.min_lr} exceeds learning_rate={self.learning_rate}; give "
                             f"--min_lr <= {self.learning_rate}")
        if self.min_lr == 0 and self.lr_decay_iters < self.max_iters:  # lr 0 moves no weight: those steps do nothing
            raise ValueError(f"config field max_iters={self.max_iters} runs past lr_decay_iters={self.lr_decay_iters} "
                             f"at min_lr=0, where steps change nothing; give --lr_decay_iters={self.max_iters}")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in out_dir and --overwrite replaces it: give one of them")
        try:
            self.model_config(1)
        except ValueError as e:
            raise ValueError(str(e).replace("GPTConfig.", "config field ")) from None

    def model_config(self, vocab_size: int, doc_sep: int | None = None) -> GPTConfig:
        """The architecture for vocab_size symbols, doc_sep the separator's id when doc_mask is on."""
        names = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "doc_sep"}
        return GPTConfig(vocab_size=vocab_size, doc_sep=doc_sep, **{n: getattr(self, n) for n in names})

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (config.json, checkpoints)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Self:
        """A copy with changes, validated again."""
        return dataclasses.replace(self, **changes)


def check_key(key: str, kind: type, where: str = "") -> None:
    """Raise for a key that is not a field of kind, naming the closest fields (or the one its initials spell, or
    nanoGPT's name gives)."""
    names = [f.name for f in dataclasses.fields(kind)]
    if key not in names:
        close = difflib.get_close_matches(key, names, n=3) or [n for n in names  # or its initials: lr
                                                               if key == "".join(w[0] for w in n.split("_"))
                                                               or kind.NANOGPT.get(key) == n]
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ValueError(f"unknown {kind.KEY} {key!r}{where}; {hint}python {kind.PROGRAM} --help lists them")


def load_toml(path: str | Path) -> dict[str, Any]:
    """A TOML config file as a dict; an unknown key is an error."""
    try:
        data = tomllib.loads(decode_utf8(Path(path).read_bytes(), str(path)))
    except OSError as e:
        raise ValueError(f"config file {path}: cannot read it ({e.strerror}); give a .toml file") from None
    except tomllib.TOMLDecodeError as e:
        hint = {".txt": f" (to train on a text file: --dataset={path})",
                ".py": " (configs are TOML here: nanoGPT's shakespeare_char ones are in configs/)"}
        raise ValueError(f"config file {path} is not valid TOML: {e}{hint.get(Path(path).suffix, '')}") from None
    for key in data:
        check_key(key, TrainConfig, f" in {path}")
    return data


def parse_args(argv: list[str], kind: type = TrainConfig) -> Any:
    """`[CONFIG.toml] [--field=value | --field value | --flag] ...` -> a kind (the config file: TrainConfig only)."""
    return kind(**parse_values(argv, kind))


def parse_values(argv: list[str], kind: type = TrainConfig) -> dict[str, Any]:
    """parse_args's field values, each of its field's type, not yet checked against each other."""
    args, fields = list(argv), {f.name: f for f in dataclasses.fields(kind)}
    values = load_toml(args.pop(0)) if kind is TrainConfig and args and not args[0].startswith("--") else {}
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}: " + ("the config file comes first, then the --field=value "
                                                               "overrides" if kind is TrainConfig else
                                                               "options start with --"))
        key, eq, text = arg[2:].partition("=")
        check_key(key, kind)
        meta = fields[key].metadata
        value_type, bare, choices = field_type(fields[key]), meta["bare"], meta["choices"] or ()
        if not eq:  # --name VALUE; a flag takes only a bool or a choice (`--resume configs/x.toml`: a bare flag)
            flag = bare is not None and (value_type is bool or bool(choices))
            given = bool(args) and not args[0].startswith("--") and (
                not flag or args[0].lower() in BOOLS or args[0] in choices)
            if not given and bare is None:
                raise ValueError(f"{kind.KEY} {key} needs a value: --{key}=VALUE")
            text = args.pop(0) if given else bare
        if "true" in choices and text.lower() in BOOLS:  # nanoGPT's --compile=False: a bool, as TOML's false is
            value_type = bool
        try:
            values[key] = BOOLS[text.lower()] if value_type is bool else value_type(text)
        except (KeyError, ValueError):
            raise ValueError(f"{kind.KEY} {key}: {text!r} is not a valid {value_type.__name__}"
                             + " (true or false)" * (value_type is bool)) from None
    return values


def print_help(argv: list[str], kind: type = TrainConfig) -> bool:
    """Print kind's usage and each field's type, default and meaning if argv asks (-h, --help); whether it did."""
    if "-h" not in argv and "--help" not in argv:
        return False
    lines = list(kind.USAGE)
    for f in dataclasses.fields(kind):
        names = "|".join(c or "''" for c in f.metadata["choices"] or (field_type(f).__name__,))
        lines += [f"  --{f.name}={names}  (default: {f.default!r})", f"      {f.metadata['help']}"]
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # `python train.py --help | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return True
