"""Training config (nanoGPT's field names): frozen dataclass from TOML, then --field=value overrides."""

import dataclasses
import difflib
import math
import re
import tomllib
from pathlib import Path
from typing import Any, Self

from data import DOCUMENTS
from model import GPTConfig
from model.gpt import ATTN_BACKENDS, POS_EMBS

MAX_SEED = 2**62  # seed + rank + world * step stays in torch's 64-bit range
RANGES = {  # a field's `rule`; GPTConfig checks the model's fields
    ">= 1": lambda v: v >= 1,
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    "in [0, 1)": lambda v: 0 <= v < 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in [0, 2**62]": lambda v: 0 <= v <= MAX_SEED,
}
BOOLS = dict.fromkeys(("true", "1", "yes", "on"), True) | dict.fromkeys(("false", "0", "no", "off"), False)


def _f(default: Any, help: str, choices: tuple[str, ...] | None = None, rule: str | None = None) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "rule": rule})


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a run needs, validated on construction."""

    dataset: str = _f("shakespeare_char", "shakespeare_char (bundled), a .txt file or folder, or hf:NAME[:SPLIT]")
    split: str = _f("", "hf: only: split ('' = all, concatenated)")
    text_column: str = _f("", "hf: only: text column ('' = 'text' or the only string column)")
    documents: str = _f("", "a document per line or per blank-line-separated paragraph of a file ('' = the file "
                            "is one text; a folder's files and an hf: dataset's rows are documents anyway)", DOCUMENTS)
    doc_mask: bool = _f(False, "no query reads a key of another document (needs documents)")
    out_dir: str = _f("out", "run folder: checkpoint, summary, config, TensorBoard events")
    n_layer: int = _f(6, "transformer blocks")
    n_head: int = _f(6, "attention heads (must divide n_embd)")
    n_embd: int = _f(384, "embedding width")
    block_size: int = _f(256, "context length in tokens")
    dropout: float = _f(0.2, "dropout on embeddings, attention, residuals")
    bias: bool = _f(False, "biases in Linear and LayerNorm")
    attn_backend: str = _f("manual", "from-scratch attention, or PyTorch's fused kernel", ATTN_BACKENDS)
    pos_emb: str = _f("learned", "learned position table, or rotary q/k (rope)", POS_EMBS)
    qk_norm: bool = _f(False, "RMS-normalise queries and keys per head")
    attn_window: int = _f(0, "sliding window: each query reads itself and the W - 1 keys before it (W keys, as "
                             "torchtitan counts; FlashAttention's window_size=(W - 1, 0)); 0 = every earlier key")
    batch_size: int = _f(64, "sequences per micro-batch", rule=">= 1")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step", rule=">= 1")
    max_iters: int = _f(5000, "optimizer steps", rule=">= 1")
    learning_rate: float = _f(1e-3, "peak learning rate", rule="> 0")
    min_lr: float = _f(1e-4, "lr at the end of the decay and after", rule=">= 0")
    warmup_iters: int = _f(100, "linear warmup steps", rule=">= 0")
    lr_decay_iters: int = _f(5000, "step where the decay reaches min_lr", rule=">= 0")
    lr_schedule: str = _f("cosine", "cosine, or wsd: warmup, stable, linear cooldown", ("cosine", "wsd"))
    cooldown_frac: float = _f(0.3, "wsd: last fraction of lr_decay_iters spent decaying", rule="in [0, 1]")
    optimizer: str = _f("adamw", "AdamW, or Muon for the blocks' matrices (AdamW for the rest)", ("adamw", "muon"))
    muon_lr: float = _f(0.02, "Muon's peak lr (scheduled like learning_rate)", rule=">= 0")
    muon_momentum: float = _f(0.95, "Muon's momentum", rule="in [0, 1]")
    weight_decay: float = _f(0.1, "AdamW weight decay (2-D weights only)", rule=">= 0")
    beta1: float = _f(0.9, "AdamW beta1", rule="in [0, 1)")
    beta2: float = _f(0.99, "AdamW beta2", rule="in [0, 1)")
    grad_clip: float = _f(1.0, "gradient-norm clip (0 = off)", rule=">= 0")
    eval_interval: int = _f(250, "steps between train/val loss estimates", rule=">= 1")
    eval_iters: int = _f(200, "batches per loss estimate", rule=">= 1")
    log_interval: int = _f(10, "steps between progress-line updates", rule=">= 1")
    exact_val: bool = _f(True, "at the end, exact loss over the whole val split")
    always_save_checkpoint: bool = _f(False, "save at every eval, not only when val improves")
    tensorboard: bool = _f(True, "write TensorBoard events to out_dir")
    sample_tokens: int = _f(200, "characters of TensorBoard text sample per eval (0 = none)", rule=">= 0")
    seed: int = _f(1337, "seeds model init, batches and dropout", rule="in [0, 2**62]")
    device: str = _f("auto", "auto (cuda, mps, then cpu), cpu, cuda, cuda:N or mps")
    dtype: str = _f("auto", "autocast dtype (auto: bfloat16 where fast)", ("auto", "float32", "bfloat16", "float16"))
    compile: str = _f("auto", "torch.compile the model (auto = on for CUDA)", ("auto", "true", "false"))
    resume: bool = _f(False, "continue from out_dir/ckpt.pt")
    overwrite: bool = _f(False, "replace the run in out_dir (default: a run there is kept; this one goes beside it)")
    peak_tflops: float = _f(0.0, "device peak TFLOP/s for MFU (0 = known GPUs only)", rule=">= 0")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, kind, choices = getattr(self, f.name), f.type, f.metadata["choices"]
            if kind is float and type(value) is int:
                object.__setattr__(self, f.name, value := float(value))  # TOML's 1 for 1.0
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"config field {f.name} must be {kind.__name__}, got {value!r}")
            if kind is float and not math.isfinite(value):
                raise ValueError(f"config field {f.name} must be a finite number, got {value!r}")
            if choices and value not in choices:
                raise ValueError(f"config field {f.name}={value!r} is not one of {', '.join(choices)}")
            if f.metadata["rule"] and not RANGES[f.metadata["rule"]](value):
                raise ValueError(f"config field {f.name} must be {f.metadata['rule']}, got {value!r}")
        for name in ("split", "text_column"):
            if getattr(self, name) and not self.dataset.startswith("hf:"):
                raise ValueError(f"config field {name}={getattr(self, name)!r} applies to hf: datasets only")
        if self.lr_decay_iters < self.warmup_iters < self.max_iters:
            raise ValueError(f"config field lr_decay_iters={self.lr_decay_iters} ends the decay before "
                             f"warmup_iters={self.warmup_iters} ends; give lr_decay_iters >= warmup_iters")
        if self.min_lr > self.learning_rate:
            raise ValueError(f"config field min_lr={self.min_lr} exceeds learning_rate={self.learning_rate}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", self.device):
            raise ValueError(f"config field device={self.device!r} is not one of auto, cpu, cuda, cuda:N, mps")
        try:
            self.model_config(1)
        except ValueError as e:
            raise ValueError(str(e).replace("GPTConfig.", "config field ")) from None

    def model_config(self, vocab_size: int, doc_sep: int | None = None) -> GPTConfig:
        """The architecture for vocab_size symbols, doc_sep the separator's id when doc_mask is on."""
        names = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "doc_sep"}
        return GPTConfig(vocab_size=vocab_size, doc_sep=doc_sep, **{n: getattr(self, n) for n in names})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def check_key(key: str, where: str = "") -> None:
    """Raise for an unknown key, naming the closest keys (else all)."""
    if key not in FIELDS:
        close = difflib.get_close_matches(key, FIELDS, n=3)
        hint = f"did you mean {' or '.join(close)}?" if close else f"valid keys: {', '.join(FIELDS)}"
        raise ValueError(f"unknown config key {key!r}{where}; {hint} (python train.py --help lists them)")


def load_toml(path: str | Path) -> dict[str, Any]:
    """A TOML config file as a dict; an unknown key is an error."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"config file {path}: cannot read it ({e.strerror}); give a .toml file") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    for key in data:
        check_key(key, f" in {path}")
    return data


def parse_args(argv: list[str]) -> TrainConfig:
    """`[CONFIG.toml] [--field=value | --field value | --flag] ...` -> config."""
    args = list(argv)
    values = load_toml(args.pop(0)) if args and not args[0].startswith("--") else {}
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}: only the config file comes without --")
        key, eq, text = arg[2:].partition("=")
        check_key(key)
        kind = FIELDS[key].type
        if not eq:
            given = bool(args) and not args[0].startswith("--")
            if not given and not (kind is bool or "true" in (FIELDS[key].metadata["choices"] or ())):
                raise ValueError(f"config key {key} needs a value: --{key}=VALUE")
            text = args.pop(0) if given else "true"
        try:
            values[key] = BOOLS[text.lower()] if kind is bool else kind(text)
        except (KeyError, ValueError):
            raise ValueError(f"config key {key}: {text!r} is not a valid {kind.__name__}") from None
    return TrainConfig(**values)


def help_text() -> str:
    """Usage, then each field's type, default and meaning."""
    lines = ["usage: python train.py [CONFIG.toml] [--field=value ...]", "",
             "Trains a character-level GPT (no config: the recipe for this machine). The TOML file",
             "(e.g. configs/debug.toml) goes first, then overrides; a bare --flag sets a bool.", "", "fields:"]
    for f in FIELDS.values():
        kind = "|".join(c or "''" for c in f.metadata["choices"] or (f.type.__name__,))
        lines += [f"  --{f.name}={kind}  (default: {f.default!r})", f"      {f.metadata['help']}"]
    return "\n".join(lines)
