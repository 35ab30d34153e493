"""Text -> encoded train/val splits (cached on disk) -> random (x, y) batches.

The label shift happens here and only here, in inputs_and_targets: y is x moved one token to the
left, so y[:, t] is the token that follows x[:, t]. Training batches and the exact val loss both cut
their windows with it; the model scores position t against y[:, t] without shifting again.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .files import write_atomic
from .sources import load_source
from .tokenizer import CharTokenizer

TRAIN_FRACTION = 0.9  # first 90 % train, last 10 % val: nanoGPT's split, so losses compare
TOKEN_DTYPE = np.uint16  # 65,536 symbols; a character corpus with more is refused
_CACHE_VERSION = "1"  # bump when the on-disk format or the split rule changes


@dataclass
class Corpus:
    """Encoded splits of one text source."""

    train: np.ndarray  # (N_train,) token ids
    val: np.ndarray  # (N_val,) token ids
    tokenizer: CharTokenizer
    name: str


def encode_corpus(text: str, name: str) -> Corpus:
    """Build the vocabulary from the whole text, encode it, and split 90/10.

    Raises:
        ValueError: the text is empty, or has more distinct characters than TOKEN_DTYPE holds (checked
            on the set of characters, before any encoding work).
    """
    if not text:
        raise ValueError(f"corpus {name} is empty")
    chars = set(text)
    if len(chars) > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(
            f"corpus {name} has {len(chars):,} distinct characters; the token dtype "
            f"{np.dtype(TOKEN_DTYPE).name} holds at most {np.iinfo(TOKEN_DTYPE).max + 1:,}"
        )
    tok = CharTokenizer(sorted(chars))
    ids = _encode_with_progress(tok, text)
    n_train = int(len(ids) * TRAIN_FRACTION)
    return Corpus(ids[:n_train], ids[n_train:], tok, name)


def check_split_sizes(corpus: Corpus, block_size: int) -> None:
    """Both splits must hold one window of block_size + 1 tokens (inputs plus the next-token target).

    Raises:
        ValueError: naming the split, its size, what block_size needs, and the two ways out.
    """
    for split, data in (("train", corpus.train), ("val", corpus.val)):
        if len(data) < block_size + 1:
            fits = min(len(corpus.train), len(corpus.val)) - 1
            smaller = f"--block_size={fits} or less" if fits >= 1 else "a smaller block_size"
            raise ValueError(
                f"the {split} split of {corpus.name} has {len(data):,} tokens; block_size={block_size} "
                f"needs at least {block_size + 1:,}. Use a longer corpus (val is the last "
                f"{1 - TRAIN_FRACTION:.0%} of it) or {smaller}"
            )


def _encode_with_progress(tok: CharTokenizer, text: str, chunk: int = 1 << 22) -> np.ndarray:
    """Encode in 4M-character chunks, with a progress bar when there is more than one."""
    if len(text) <= chunk:
        return tok.encode_array(text, TOKEN_DTYPE)
    from tqdm import tqdm

    parts = [tok.encode_array(text[i:i + chunk], TOKEN_DTYPE)
             for i in tqdm(range(0, len(text), chunk), desc="encoding", unit="chunk", file=sys.stderr)]
    return np.concatenate(parts)


def load_corpus(dataset: str, cache_dir: str | os.PathLike = "data_cache", split: str | None = None,
                text_column: str | None = None) -> Corpus:
    """Load a corpus by the config's `dataset` value, from the encoded cache when it is current.

    The cache entry is keyed by the source's content hash, so a second run skips encoding and an
    edited file is re-encoded. Layout: cache_dir/encoded/KEY-vN/{train.bin, val.bin, vocab.json}
    (KEY: the first 32 characters of the source's content key; N: the cache format version).
    """
    src = load_source(dataset, cache_dir, split, text_column)
    entry = Path(cache_dir) / "encoded" / f"{src.key[:32]}-v{_CACHE_VERSION}"
    vocab_path = entry / "vocab.json"
    if vocab_path.exists():
        try:
            tok = CharTokenizer.from_dict(json.loads(vocab_path.read_text(encoding="utf-8")))
            train = np.fromfile(entry / "train.bin", dtype=TOKEN_DTYPE)
            val = np.fromfile(entry / "val.bin", dtype=TOKEN_DTYPE)
            return Corpus(train, val, tok, src.name)
        except (OSError, ValueError):
            pass  # a damaged cache entry is rebuilt below
    corpus = encode_corpus(src.text, src.name)
    entry.mkdir(parents=True, exist_ok=True)
    # Every file goes through a temporary name of its own and os.replace, so processes filling the
    # same entry at once (ranks of a torchrun job, two runs sharing cache_dir) never see a torn file.
    write_atomic(entry / "train.bin", memoryview(corpus.train))
    write_atomic(entry / "val.bin", memoryview(corpus.val))
    # vocab.json last: its presence marks a complete entry
    write_atomic(vocab_path, json.dumps(corpus.tokenizer.to_dict(), ensure_ascii=False).encode("utf-8"))
    return corpus


def get_batch(
    data: np.ndarray | Tensor,
    batch_size: int,
    block_size: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor]:
    """Random windows of the corpus as inputs and next-token targets.

    Args:
        data: (N,) token ids, a numpy array or a tensor (a tensor on the GPU is gathered there).
        batch_size: B.
        block_size: T.
        generator: RNG for the window offsets (on the device of the offsets: CPU for numpy data).
        device: where x and y go.
    Returns:
        x: (B, T) int64, x[b] = data[i : i + T].
        y: (B, T) int64, y[b] = data[i + 1 : i + 1 + T]  <- the label shift (inputs_and_targets).
    """
    n = len(data)
    if n < block_size + 1:
        raise ValueError(f"data has {n} tokens; a batch needs at least block_size + 1 = {block_size + 1}")
    # offsets i in [0, n - T - 1]: the last valid window ends exactly at the last token
    if isinstance(data, Tensor):
        gen_device = generator.device if generator is not None else data.device
        offsets = torch.randint(n - block_size, (batch_size,), generator=generator, device=gen_device)
        idx = offsets.to(data.device)[:, None] + torch.arange(block_size + 1, device=data.device)
        chunk = data[idx].long()  # (B, T + 1)
    else:
        offsets = torch.randint(n - block_size, (batch_size,), generator=generator)
        idx = offsets.numpy()[:, None] + np.arange(block_size + 1)
        chunk = torch.from_numpy(data[idx].astype(np.int64))  # (B, T + 1)
    return inputs_and_targets(chunk.to(device, non_blocking=True))


def inputs_and_targets(windows: Tensor) -> tuple[Tensor, Tensor]:
    """The label shift, the one place it happens: windows (B, T + 1) of consecutive tokens ->
    x = windows[:, :-1] (B, T) and y = windows[:, 1:] (B, T), so y[:, t] is the token after x[:, t].
    get_batch (training, loss estimates) and exact_loss (the exact val loss) both cut here."""
    return windows[:, :-1], windows[:, 1:]


def eval_windows(data: np.ndarray | Tensor, block_size: int) -> list[tuple[int, int]]:
    """Non-overlapping (start, length) windows whose targets cover data[1:] exactly once, in order.

    Window w has inputs data[start : start + length] and targets data[start + 1 : start + 1 + length];
    the last window is shorter when (N - 1) is not a multiple of block_size.
    """
    n_targets = len(data) - 1
    return [(s, min(block_size, n_targets - s)) for s in range(0, n_targets, block_size)]
