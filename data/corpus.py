"""Text -> character tokens -> train/val splits -> random (x, y) batches.

The label shift happens here and only here, in inputs_and_targets: y is x moved one token to the
left, so y[:, t] is the token that follows x[:, t]. Training batches and the exact val loss both cut
their windows with it; the model scores position t against y[:, t] without shifting again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .text import load_text

TRAIN_FRACTION = 0.9  # first 90 % train, last 10 % val: nanoGPT's split, so losses compare
TOKEN_DTYPE = np.uint16  # 65,536 symbols at most


class CharTokenizer:
    """One token per distinct character, ids in the order given (sorted, as nanoGPT's)."""

    def __init__(self, chars: Iterable[str]) -> None:
        self.chars: list[str] = list(chars)
        if not self.chars or any(not isinstance(c, str) or len(c) != 1 for c in self.chars):
            raise ValueError("CharTokenizer needs a non-empty list of single characters")
        if len(set(self.chars)) != len(self.chars):
            raise ValueError("CharTokenizer vocabulary has duplicate characters")
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        """V: ids are 0..V-1."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """str -> ids; characters outside the vocabulary raise a ValueError naming them."""
        unknown = set(text) - self.stoi.keys()
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {', '.join(map(repr, sorted(unknown)))}")
        return [self.stoi[c] for c in text]

    def encode_array(self, text: str) -> np.ndarray:
        """Like encode, vectorised over code points (a whole corpus in milliseconds): (N,) uint16."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        table = np.full(max(codes.max(initial=0), max(map(ord, self.chars))) + 1, -1, dtype=np.int64)
        table[[ord(c) for c in self.chars]] = np.arange(self.vocab_size)
        ids = table[codes]
        if (ids < 0).any():
            self.encode(text)  # raises, naming the unknown characters
        return ids.astype(TOKEN_DTYPE)

    def decode(self, ids: Iterable[int]) -> str:
        """ids -> str."""
        return "".join(self.chars[int(i)] for i in ids)

    def to_dict(self) -> dict:
        """Plain data, for checkpoints."""
        return {"chars": list(self.chars)}

    @classmethod
    def from_dict(cls, d: dict) -> CharTokenizer:
        """The tokenizer to_dict described."""
        if not isinstance(d, dict) or not isinstance(d.get("chars"), list):
            raise ValueError("a tokenizer dict needs a 'chars' list")
        return cls(d["chars"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars


@dataclass
class Corpus:
    """The encoded splits of one text: train (N_train,) and val (N_val,) token ids."""

    train: np.ndarray
    val: np.ndarray
    tokenizer: CharTokenizer
    name: str


def encode_corpus(text: str, name: str) -> Corpus:
    """Vocabulary = the sorted characters of the whole text; the first 90 % is train, the rest val."""
    if not text:
        raise ValueError(f"corpus {name} is empty")
    chars = sorted(set(text))
    if len(chars) > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"corpus {name} has {len(chars):,} distinct characters; at most 65,536 fit a uint16 token")
    tok = CharTokenizer(chars)
    ids = tok.encode_array(text)
    n_train = int(len(ids) * TRAIN_FRACTION)
    return Corpus(ids[:n_train], ids[n_train:], tok, name)


def load_corpus(dataset: str, split: str = "", text_column: str = "") -> Corpus:
    """encode_corpus of data.text.load_text(dataset, split, text_column)."""
    return encode_corpus(*load_text(dataset, split, text_column))


def check_split_sizes(corpus: Corpus, block_size: int) -> None:
    """Both splits must hold one window of block_size + 1 tokens (the inputs and the next-token targets)."""
    for split, data in (("train", corpus.train), ("val", corpus.val)):
        if len(data) < block_size + 1:
            fits = min(len(corpus.train), len(corpus.val)) - 1
            smaller = f"--block_size={fits} or less" if fits >= 1 else "a smaller block_size"
            raise ValueError(f"the {split} split of {corpus.name} has {len(data):,} tokens; block_size={block_size} "
                             f"needs at least {block_size + 1:,}. Use a longer corpus (val is the last 10 % of it) "
                             f"or {smaller}")


def get_batch(data: np.ndarray | Tensor, batch_size: int, block_size: int,
              generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Random windows of data as inputs and next-token targets.

    Args:
        data: (N,) token ids, numpy or a tensor (a tensor on the GPU is gathered there).
        batch_size, block_size: B, T.
        generator: RNG for the window offsets (on data's device for a tensor, else the CPU).
    Returns:
        x: (B, T) int64, x[b] = data[i : i + T]; y: (B, T) int64, y[b] = data[i + 1 : i + 1 + T].
    """
    n = len(data)
    if n < block_size + 1:
        raise ValueError(f"data has {n} tokens; a batch needs at least block_size + 1 = {block_size + 1}")
    where = generator.device if generator is not None else (data.device if isinstance(data, Tensor) else "cpu")
    offsets = torch.randint(n - block_size, (batch_size,), generator=generator, device=where)  # last: n - T - 1
    if isinstance(data, Tensor):
        chunk = data[offsets.to(data.device)[:, None] + torch.arange(block_size + 1, device=data.device)].long()
    else:
        chunk = torch.from_numpy(data[offsets.numpy()[:, None] + np.arange(block_size + 1)].astype(np.int64))
    return inputs_and_targets(chunk.to(device, non_blocking=True))  # (B, T + 1) -> 2 x (B, T)


def inputs_and_targets(windows: Tensor) -> tuple[Tensor, Tensor]:
    """The label shift, the one place it happens: windows (B, T + 1) of consecutive tokens -> x (B, T) =
    windows[:, :-1] and y (B, T) = windows[:, 1:], so y[:, t] is the token after x[:, t]."""
    return windows[:, :-1], windows[:, 1:]


def eval_windows(data: np.ndarray | Tensor, block_size: int) -> list[tuple[int, int]]:
    """Consecutive (start, length) windows whose targets cover data[1:] exactly once, in order; the last
    one is shorter when N - 1 is not a multiple of block_size."""
    n_targets = len(data) - 1
    return [(s, min(block_size, n_targets - s)) for s in range(0, n_targets, block_size)]
