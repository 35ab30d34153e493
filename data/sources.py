"""Where text comes from: Tiny Shakespeare, a local file, a folder of .txt files, a HF dataset.

Every source returns a `Source`: the text plus a key that changes whenever the content does, so
the encoded cache (data/corpus.py) is rebuilt exactly when it must be.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# The file nanoGPT's shakespeare_char/prepare.py downloads, and its fingerprint.
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_BYTES = 1_115_394
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


@dataclass(frozen=True)
class Source:
    """A corpus as text, with a content key for caching and a name for messages."""

    text: str
    key: str
    name: str


def decode_utf8(raw: bytes, name: str) -> str:
    """bytes -> str, or a ValueError naming the file and the byte offset of the first bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{name} is not UTF-8 text: invalid byte 0x{raw[e.start]:02x} at byte offset {e.start}"
        ) from None


def _sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def read_text_file(path: str | os.PathLike) -> Source:
    """A single local UTF-8 text file."""
    path = Path(path)
    raw = path.read_bytes()
    return Source(decode_utf8(raw, str(path)), _sha256(raw), str(path))


def read_text_folder(path: str | os.PathLike) -> Source:
    """Every *.txt file under a folder (recursively, in sorted path order), concatenated."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*.txt") if p.is_file())
    if not files:
        raise ValueError(f"folder {path} contains no .txt files")
    digest = hashlib.sha256()
    parts = []
    for f in files:
        raw = f.read_bytes()
        digest.update(str(f.relative_to(path)).encode() + b"\0" + raw + b"\0")
        parts.append(decode_utf8(raw, str(f)))
    return Source("".join(parts), digest.hexdigest(), f"{path} ({len(files)} .txt files)")


def tiny_shakespeare(cache_dir: str | os.PathLike) -> Source:
    """Tiny Shakespeare, downloaded once into cache_dir and verified by size and sha256."""
    target = Path(cache_dir) / "tinyshakespeare" / "input.txt"
    if not target.exists():
        _download(SHAKESPEARE_URL, target)
    raw = target.read_bytes()
    if len(raw) != SHAKESPEARE_BYTES or _sha256(raw) != SHAKESPEARE_SHA256:
        raise ValueError(
            f"{target} is not Tiny Shakespeare ({len(raw)} bytes, expected {SHAKESPEARE_BYTES} "
            f"with sha256 {SHAKESPEARE_SHA256}); delete it to download again"
        )
    return Source(raw.decode("utf-8"), SHAKESPEARE_SHA256, "Tiny Shakespeare")


def _download(url: str, target: Path) -> None:
    """Download url to target atomically (a partial download never looks like a finished one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"downloading {url} -> {target}", file=sys.stderr)
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            total = int(resp.headers.get("Content-Length") or 0) or None
            from tqdm import tqdm

            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".download-")
            try:
                with os.fdopen(fd, "wb") as f, tqdm(total=total, unit="B", unit_scale=True,
                                                    desc="download", file=sys.stderr) as bar:
                    while chunk := resp.read(1 << 16):
                        f.write(chunk)
                        bar.update(len(chunk))
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise ConnectionError(
            f"could not download Tiny Shakespeare from {url} ({e}). Offline? Pass a local copy "
            f"instead: --dataset=PATH/TO/input.txt (any UTF-8 text file works), or put the file "
            f"at {target}"
        ) from None


def hf_dataset(spec: str, split: str | None, text_column: str | None) -> Source:
    """A Hugging Face dataset's text column, via `datasets` (imported only when used).

    spec is NAME or NAME:SPLIT after the "hf:" prefix. NAME may be a hub id, a directory written
    by `Dataset.save_to_disk`, or a local data directory/file that `load_dataset` understands.
    Without a split, every split is concatenated: train, validation, test first (in that order,
    so a hub copy of a corpus that was cut into splits reads in its original order), then any
    others by name.
    """
    name, _, spec_split = spec.partition(":")
    split = split or spec_split or None
    try:
        import datasets
    except ImportError:
        raise ImportError("dataset 'hf:...' needs the `datasets` package: pip install datasets") from None
    local = Path(name)
    if (local / "dataset_info.json").exists() or (local / "dataset_dict.json").exists():
        ds = datasets.load_from_disk(name)  # written by save_to_disk
    else:
        ds = datasets.load_dataset(name)
    if isinstance(ds, datasets.DatasetDict):
        if split is not None:
            if split not in ds:
                raise ValueError(f"hf:{name} has no split {split!r}; it has {sorted(ds)}")
            parts = [ds[split]]
        else:
            order = {"train": 0, "validation": 1, "test": 2}
            parts = [ds[s] for s in sorted(ds, key=lambda s: (order.get(s, 3), s))]
    else:
        parts = [ds]
    texts, digest = [], hashlib.sha256()
    for part in parts:
        column = text_column or _text_column(part, name)
        if column not in part.column_names:
            raise ValueError(f"hf:{name} has no column {column!r}; it has {part.column_names}")
        digest.update(part._fingerprint.encode() + column.encode())
        texts.extend(part[column])
    return Source("".join(texts), digest.hexdigest(), f"hf:{name}")


def _text_column(ds, name: str) -> str:
    """The column named 'text', else the only string column."""
    if "text" in ds.column_names:
        return "text"
    strings = [c for c, f in ds.features.items() if getattr(f, "dtype", None) == "string"]
    if len(strings) == 1:
        return strings[0]
    raise ValueError(f"hf:{name}: cannot tell the text column among {ds.column_names}; set text_column")


def load_source(dataset: str, cache_dir: str | os.PathLike, split: str | None = None,
                text_column: str | None = None) -> Source:
    """Resolve the config's `dataset` value to text.

    Args:
        dataset: "shakespeare_char", "hf:NAME[:SPLIT]", a path to a UTF-8 text file, or a folder
            of .txt files.
        cache_dir: where downloads are kept.
        split, text_column: for hf: datasets only.
    """
    if dataset == "shakespeare_char":
        return tiny_shakespeare(cache_dir)
    if dataset.startswith("hf:"):
        return hf_dataset(dataset[3:], split, text_column)
    path = Path(dataset).expanduser()
    if path.is_file():
        return read_text_file(path)
    if path.is_dir():
        return read_text_folder(path)
    raise ValueError(
        f"dataset={dataset!r} is neither 'shakespeare_char', 'hf:NAME', an existing file nor a folder"
    )
