"""Where the text comes from: the bundled Tiny Shakespeare, a UTF-8 file, a folder of .txt files, or a
Hugging Face dataset (`hf:NAME[:SPLIT]`, through `datasets`)."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

# Tiny Shakespeare (public domain), shipped with the code: the default corpus needs no network.
SHAKESPEARE = Path(__file__).resolve().parent.parent / "corpora" / "tinyshakespeare.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
# local data files `datasets` reads, by suffix -> its builder
HF_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}
SPLIT_ORDER = {"train": 0, "validation": 1, "test": 2}  # a corpus cut into splits reads back in order


def decode_utf8(raw: bytes, name: str) -> str:
    """bytes -> str, or a ValueError naming the file, the first bad byte, and how to convert the file."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not UTF-8 text: invalid byte 0x{raw[e.start]:02x} at byte offset {e.start}. "
                         f"Convert it first, e.g. iconv -f latin1 -t utf-8 {name} > {name}.utf8") from None


def load_text(dataset: str, split: str = "", text_column: str = "") -> tuple[str, str]:
    """The config's `dataset` as (text, a name for messages).

    Args:
        dataset: "shakespeare_char" (the bundled file, checked against its sha256), "hf:NAME[:SPLIT]",
            a UTF-8 text file, or a folder of .txt files (concatenated in path order, hidden ones skipped).
        split, text_column: for hf: datasets only ('' = every split / 'text' or the only string column).
    """
    if dataset == "shakespeare_char":
        raw = SHAKESPEARE.read_bytes()
        if hashlib.sha256(raw).hexdigest() != SHAKESPEARE_SHA256:
            raise ValueError(f"{SHAKESPEARE} is not Tiny Shakespeare (its sha256 differs): restore it with "
                             f"git checkout -- {SHAKESPEARE.parent.name}")
        return raw.decode("utf-8"), "Tiny Shakespeare"
    if dataset.startswith("hf:"):
        return hf_text(dataset[3:], split, text_column)
    path = Path(dataset).expanduser()
    if path.is_file():
        return decode_utf8(path.read_bytes(), str(path)), str(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise ValueError(f"folder {path} contains no .txt files")
        return "".join(decode_utf8(f.read_bytes(), str(f)) for f in files), f"{path} ({len(files)} .txt files)"
    raise ValueError(f"dataset={dataset!r} is neither 'shakespeare_char', 'hf:NAME', an existing file nor a folder")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers a TCP connection within `timeout` seconds."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def hf_text(spec: str, split: str, text_column: str) -> tuple[str, str]:
    """A Hugging Face dataset's text column, every split concatenated (train, validation, test first)
    unless one is named. NAME is a save_to_disk directory, a data file, a folder of data files, or a
    hub id (downloaded once into the Hugging Face cache). Offline, hub ids are read from that cache:
    the Hub is probed once, in seconds, instead of retried for half a minute."""
    name, _, spec_split = spec.partition(":")
    if split and spec_split and split != spec_split:
        raise ValueError(f"dataset=hf:{spec} names split {spec_split!r} but config field split={split!r}")
    split = split or spec_split or None
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith((".", "/", "~")) or path.suffix in HF_BUILDERS):
        raise ValueError(f"dataset=hf:{name}: no such file or directory")
    if not path.exists() and not hub_reachable():
        os.environ["HF_HUB_OFFLINE"] = "1"  # read before `datasets` is imported: the cache only, no retries
    try:
        import datasets
    except ImportError:
        raise ImportError("dataset 'hf:...' needs the `datasets` package: pip install datasets") from None
    try:
        if (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists():
            ds = datasets.load_from_disk(str(path))
            if split is not None:
                if not isinstance(ds, datasets.DatasetDict) or split not in ds:
                    raise ValueError(f"it has no split {split!r}")
                ds = ds[split]
        elif path.is_file():
            if path.suffix not in HF_BUILDERS:
                raise ValueError(f"expected a {', '.join(HF_BUILDERS)} file; for plain text drop the hf: prefix")
            options = {"keep_linebreaks": True} if path.suffix == ".txt" else {}
            ds = datasets.load_dataset(HF_BUILDERS[path.suffix], data_files=str(path), split=split, **options)
        else:  # a folder of data files or a hub id: datasets infers the format and the splits
            options = {"keep_linebreaks": True} if path.is_dir() and any(path.rglob("*.txt")) else {}
            ds = datasets.load_dataset(str(path.resolve()) if path.exists() else name, split=split, **options)
    except ConnectionError as e:
        raise ConnectionError(f"could not load hf:{name} ({e}). Offline? Pass a local copy instead: a folder "
                              "written by save_to_disk, a data file or a folder of them as hf:PATH, or plain "
                              "UTF-8 text as --dataset=PATH") from None
    except Exception as e:  # noqa: BLE001 - datasets raises many types; the message names the dataset
        cause = e.__cause__ or e
        raise ValueError(f"dataset=hf:{name}: {type(cause).__name__}: {cause}") from None
    parts = [ds] if isinstance(ds, datasets.Dataset) else \
        [ds[s] for s in sorted(ds, key=lambda s: (SPLIT_ORDER.get(s, len(SPLIT_ORDER)), s))]
    texts = []
    for part in parts:
        strings = [c for c, f in part.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
        column = text_column or ("text" if "text" in strings else strings[0] if len(strings) == 1 else None)
        if column not in strings:
            given = f"text_column={text_column!r} is not among them; " if text_column else ""
            raise ValueError(f"hf:{name}: {given}set text_column to one of its string columns {strings} "
                             f"(it has {part.column_names})")
        texts.extend(t for t in part[column] if t is not None)
    return "".join(texts), f"hf:{name}" + (f":{split}" if split else "")
