"""Text -> char tokens -> train/val splits -> (x, y) batches."""

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .text import load_text

TRAIN_FRACTION = 0.9  # nanoGPT's split, so losses compare
TOKEN_DTYPE = np.uint16  # 65,536 symbols at most


class CharTokenizer:
    """One token per character, ids in the given order (encode_corpus sorts, as nanoGPT)."""

    def __init__(self, chars: Iterable[str]) -> None:
        self.chars: list[str] = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        if not 0 < len(self.stoi) == len(self.chars) or not all(isinstance(c, str) and len(c) == 1 for c in self.chars):
            raise ValueError("CharTokenizer needs one or more distinct single characters")

    @property
    def vocab_size(self) -> int:
        """Symbols in the vocabulary: ids are 0 .. vocab_size - 1."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """str -> ids; unknown characters raise a ValueError naming them."""
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """Vectorised encode: (N,) uint16."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        table = np.full(0x110000, -1, dtype=np.int32)  # id by code point; -1: unknown
        table[[ord(c) for c in self.chars]] = np.arange(self.vocab_size)
        ids = table[codes]
        if (ids < 0).any():
            unknown = ", ".join(repr(chr(c)) for c in np.unique(codes[ids < 0]))
            raise ValueError(f"characters not in the vocabulary: {unknown}; use these {self.vocab_size}: "
                             f"{''.join(self.chars)!r}")
        return ids.astype(TOKEN_DTYPE)

    def decode(self, ids: Iterable[int]) -> str:
        """ids (N,) -> str of N characters."""
        return "".join(self.chars[int(i)] for i in ids)

    def to_dict(self) -> dict:
        """The vocabulary as a checkpoint stores it (plain data)."""
        return {"chars": list(self.chars)}

    @classmethod
    def from_dict(cls, d: dict) -> "CharTokenizer":
        """The tokenizer to_dict stored; ValueError for anything else."""
        if not isinstance(d, dict) or not isinstance(d.get("chars"), list):
            raise ValueError("a tokenizer dict needs a 'chars' list")
        return cls(d["chars"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars


@dataclass
class Corpus:
    """Encoded splits of one text: train (N_train,) and val (N_val,) ids."""

    train: np.ndarray
    val: np.ndarray
    tokenizer: CharTokenizer
    name: str


def encode_corpus(text: str, name: str) -> Corpus:
    """Vocabulary: the text's sorted characters; first 90 % train, the rest val."""
    if not text:
        raise ValueError(f"corpus {name} is empty")
    chars = sorted(set(text))
    if len(chars) > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"corpus {name} has {len(chars):,} distinct characters; at most 65,536 fit a uint16 token")
    tok = CharTokenizer(chars)
    ids = tok.encode_array(text)
    n_train = int(len(ids) * TRAIN_FRACTION)
    return Corpus(ids[:n_train], ids[n_train:], tok, name)


def load_corpus(dataset: str, split: str = "", text_column: str = "", documents: str = "") -> Corpus:
    """encode_corpus(load_text(...))."""
    return encode_corpus(*load_text(dataset, split, text_column, documents))


def check_split_sizes(corpus: Corpus, block_size: int) -> None:
    """Raise unless both splits hold block_size + 1 tokens (inputs and targets)."""
    n, split = min((len(corpus.train), "train"), (len(corpus.val), "val"))
    if n < block_size + 1:
        smaller = f"--block_size={n - 1} or less" if n >= 2 else "a smaller block_size"
        raise ValueError(f"the {split} split of {corpus.name} has {n:,} tokens; block_size={block_size} needs at least "
                         f"{block_size + 1:,}. Use a longer corpus (val is its last 10 %) or {smaller}")


def get_batch(data: Tensor, batch_size: int, block_size: int, generator: torch.Generator | None = None,
              device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """x, y (B, T) int64 from random windows data[i : i + T + 1] of data (N,), offsets drawn on generator's device."""
    n = len(data)
    if n < block_size + 1:
        raise ValueError(f"data has {n} tokens; a batch needs at least block_size + 1 = {block_size + 1}")
    where = generator.device if generator is not None else data.device
    offsets = torch.randint(n - block_size, (batch_size,), generator=generator, device=where)  # last: n - T - 1
    chunk = data[offsets.to(data.device)[:, None] + torch.arange(block_size + 1, device=data.device)].long()
    return inputs_and_targets(chunk.to(device, non_blocking=True))


def inputs_and_targets(windows: Tensor) -> tuple[Tensor, Tensor]:
    """Label shift: windows (B, T + 1) -> x = windows[:, :-1], y = windows[:, 1:], (B, T) each."""
    return windows[:, :-1], windows[:, 1:]


def eval_windows(data: Tensor, block_size: int) -> list[tuple[int, int]]:
    """(start, length) windows whose targets cover data[1:] once, in order."""
    return [(s, min(block_size, len(data) - 1 - s)) for s in range(0, len(data) - 1, block_size)]
