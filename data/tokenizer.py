"""Character-level tokenizer: one token per distinct character of the corpus."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class CharTokenizer:
    """Maps characters to ids 0..V-1 in the order given (from_text sorts them, as nanoGPT does)."""

    def __init__(self, chars: Iterable[str]) -> None:
        chars = list(chars)
        if any(not isinstance(c, str) or len(c) != 1 for c in chars):
            raise ValueError("CharTokenizer needs single characters")
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer vocabulary has duplicate characters")
        if not chars:
            raise ValueError("CharTokenizer vocabulary is empty")
        self.chars: list[str] = chars
        self.stoi: dict[str, int] = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Vocabulary = the sorted unique characters of text."""
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        """V, the number of distinct characters (ids are 0..V-1)."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """str -> token ids. Characters outside the vocabulary raise ValueError naming them."""
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            unknown = sorted(set(text) - self.stoi.keys())
            raise ValueError(
                f"characters not in the vocabulary: {', '.join(repr(c) for c in unknown)}"
            ) from None

    def encode_array(self, text: str, dtype: np.dtype = np.uint16) -> np.ndarray:
        """Like encode, as a 1-D numpy array (fast path for whole corpora)."""
        if self.vocab_size > np.iinfo(dtype).max + 1:
            raise ValueError(f"{self.vocab_size} symbols do not fit in {np.dtype(dtype).name}")
        # Vectorised lookup over code points: ~10x faster than a Python loop on 1 MB (benchmarks/micro.py).
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        table = np.full(max(codes.max(initial=0), max(map(ord, self.chars))) + 1, -1, dtype=np.int64)
        table[[ord(c) for c in self.chars]] = np.arange(self.vocab_size)
        ids = table[codes]
        if (ids < 0).any():
            self.encode(text)  # raises with the unknown characters named
        return ids.astype(dtype)

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> str."""
        return "".join(self.chars[int(i)] for i in ids)

    def to_dict(self) -> dict:
        """Plain data (JSON-safe, safe for weights_only checkpoints)."""
        return {"chars": list(self.chars)}

    @classmethod
    def from_dict(cls, d: dict) -> CharTokenizer:
        """The tokenizer to_dict described; raises ValueError on anything else."""
        if not isinstance(d, dict) or not isinstance(d.get("chars"), list):
            raise ValueError("a tokenizer dict needs a 'chars' list")
        return cls(d["chars"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"
