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

from .files import atomic_file

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
    """Every *.txt file under a folder (recursively, in sorted path order), concatenated. Hidden files
    and folders (a name starting with '.', e.g. .ipynb_checkpoints copies) are skipped."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*.txt")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise ValueError(f"folder {path} contains no .txt files")
    # "folder" first: a single file can never hash like a folder, whatever its bytes
    digest = hashlib.sha256(b"txt-folder\0")
    parts = []
    for f in files:
        raw = f.read_bytes()
        # surrogateescape: a file name that is not UTF-8 still hashes (and is read) instead of failing
        digest.update(str(f.relative_to(path)).encode("utf-8", "surrogateescape") + b"\0" + raw + b"\0")
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

            with atomic_file(target, prefix=".download-") as f, tqdm(total=total, unit="B", unit_scale=True,
                                                                    desc="download", file=sys.stderr) as bar:
                while chunk := resp.read(1 << 16):
                    f.write(chunk)
                    bar.update(len(chunk))
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise ConnectionError(
            f"could not download Tiny Shakespeare from {url} ({e}). Offline? Pass a local copy "
            f"instead: --dataset=PATH/TO/input.txt (any UTF-8 text file works), or put the file "
            f"at {target}"
        ) from None


# Local files `datasets` can read, by suffix -> its packaged builder.
HF_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text",
               ".arrow": "arrow"}
# Written by Dataset/DatasetDict.save_to_disk: such a directory is read with load_from_disk.
SAVED_MARKERS = ("dataset_dict.json", "dataset_info.json", "state.json")
# The usual split order: a corpus cut into train/validation/test reads back in its original order.
SPLIT_ORDER = {"train": 0, "validation": 1, "test": 2}


def hf_dataset(spec: str, split: str | None, text_column: str | None,
               cache_dir: str | os.PathLike = "data_cache") -> Source:
    """A Hugging Face dataset's text column, via `datasets` (imported only when used).

    Args:
        spec: NAME or NAME:SPLIT (what follows "hf:"). NAME is, in this order:
            - an existing directory written by `save_to_disk` (read with `load_from_disk`);
            - an existing .parquet/.json/.jsonl/.csv/.txt/.arrow file, or a directory of such files
              (e.g. a clone of a hub dataset repository), read with `load_dataset`, no network;
            - otherwise a hub id such as karpathy/tiny_shakespeare, downloaded once (with progress
              bars) into huggingface_hub's cache (~/.cache/huggingface/hub; HF_HOME moves it).
        split: the split to read; None reads every split, concatenated train, validation, test
            first (so the hub copy of Tiny Shakespeare, cut 1,003,854 / 55,770 / 55,770, reads back
            as the original file and the 90/10 split is nanoGPT's), then the others by name.
        text_column: the column to read; None means 'text', else the only string column.
        cache_dir: the project's cache; `datasets` keeps the Arrow tables it prepares for a hub id in
            cache_dir/hf (for local files, in a temporary folder there, deleted after the load).
    Returns:
        The rows of the column concatenated as they are (no separator is added), keyed by the
        sha256 of that text, so the same content shares one encoded cache however it was loaded.
    Raises:
        ValueError: a missing path, an unknown split or column, an unsupported file.
        ConnectionError: the hub cannot be reached; the message says how to pass a local copy.
    """
    name, _, spec_split = spec.partition(":")
    if split and spec_split and split != spec_split:
        raise ValueError(f"dataset=hf:{spec} names split {spec_split!r} but config field split={split!r}")
    split = split or spec_split or None
    try:
        import datasets
    except ImportError:
        raise ImportError("dataset 'hf:...' needs the `datasets` package: pip install datasets") from None
    hf_cache = str(Path(cache_dir) / "hf")
    local = Path(name).expanduser()
    saved = local.is_dir() and any((local / m).exists() for m in SAVED_MARKERS)
    if not local.exists() and (name.startswith((".", "/", "~")) or local.suffix in HF_BUILDERS
                               or name.count("/") > 1):
        raise ValueError(f"dataset=hf:{name}: no such file or directory (a hub id is NAME or OWNER/NAME)")
    if saved:
        ds = _read(lambda: datasets.load_from_disk(str(local)), name, local=True)
        return _source(ds, name, split, text_column, saved=True)
    if not local.exists():  # a hub id
        ds = _read(lambda: datasets.load_dataset(name, split=split, cache_dir=hf_cache), name, local=False)
        return _source(ds, name, split, text_column, saved=False)
    builder, options = _local_builder(local, name)
    # A private cache for this one load, deleted once the text is out: datasets keys its own cache on
    # a local file's path and mtime, not its content (an edit that keeps the mtime, as cp -p, rsync -a
    # and tar x do, would read the old rows), and concurrent loads rebuilding one shared entry race.
    Path(hf_cache).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=hf_cache, prefix="local-") as private:
        ds = _read(lambda: datasets.load_dataset(builder, **options, split=split, cache_dir=private), name,
                   local=True)
        return _source(ds, name, split, text_column, saved=False)


def _read(load, name: str, local: bool):
    """load() -> a Dataset or DatasetDict, its failures turned into errors that say what to do."""
    import datasets

    try:
        return load()
    except ConnectionError as e:
        raise ConnectionError(
            f"could not load hf:{name} from the Hugging Face Hub ({e}). Offline? Pass a local copy "
            f"instead: --dataset=hf:PATH, where PATH is a directory written by save_to_disk, a "
            f".parquet/.json/.jsonl/.csv/.txt file, or a folder of them such as a clone of the dataset's "
            f"repository; or --dataset=PATH for plain UTF-8 text (a file or a folder of .txt files)"
        ) from None
    except (datasets.exceptions.DatasetNotFoundError, ValueError) as e:  # e.g. 'Unknown split "x"'
        raise ValueError(f"dataset=hf:{name}: {e}") from None
    except Exception as e:  # a malformed or empty local file: datasets wraps the cause
        if not local:
            raise
        cause = e.__cause__ or e
        raise ValueError(f"dataset=hf:{name}: datasets could not read it: {type(cause).__name__}: {cause}") from None


def _source(ds, name: str, split: str | None, text_column: str | None, saved: bool) -> Source:
    """The text column of ds (a Dataset, or a DatasetDict read split by split) as one Source."""
    import datasets

    if split is not None and isinstance(ds, datasets.Dataset) and saved:
        # a single saved Dataset has no splits to choose from (its recorded split name is not reliable:
        # train_test_split()["test"] still says "train"), so a split name must not be ignored silently
        raise ValueError(f"dataset=hf:{name} is a single saved Dataset, with no splits to choose from; "
                         f"drop the split {split!r} to read it whole")
    if split is not None and isinstance(ds, datasets.DatasetDict):  # load_from_disk reads every split
        if split not in ds:
            raise ValueError(f"dataset=hf:{name} has no split {split!r}; it has {sorted(ds)}")
        ds = ds[split]
    if isinstance(ds, datasets.DatasetDict):
        parts = [ds[s] for s in sorted(ds, key=lambda s: (SPLIT_ORDER.get(s, len(SPLIT_ORDER)), s))]
    else:
        parts = [ds]
    texts = []
    for part in parts:
        column = text_column or _text_column(part, name)
        if column not in part.column_names:
            raise ValueError(f"hf:{name} has no column {column!r}; it has {part.column_names}")
        if getattr(part.features[column], "dtype", None) not in ("string", "large_string"):
            raise ValueError(f"hf:{name} column {column!r} holds {part.features[column]}, not text; "
                             f"set text_column to one of the string columns")
        texts.extend(t for t in part[column] if t is not None)  # a missing row adds nothing
    text = "".join(texts)
    return Source(text, _sha256(text.encode("utf-8")), f"hf:{name}" + (f":{split}" if split else ""))


def _local_builder(path: Path, name: str) -> tuple[str, dict]:
    """The `load_dataset` call for a local data file or folder of them: (path or builder, options)."""
    files = [path] if path.is_file() else _data_files(path)
    if not files or (path.is_file() and path.suffix not in HF_BUILDERS):
        raise ValueError(f"dataset=hf:{name}: expected a save_to_disk directory, or a file or folder of "
                         f"{', '.join(HF_BUILDERS)} files; for plain text drop the hf: prefix")
    formats = sorted({HF_BUILDERS[f.suffix] for f in files})
    if len(formats) > 1:
        # datasets would read only the most common format of a folder and drop the rest silently
        counts = ", ".join(f"{sum(HF_BUILDERS[f.suffix] == b for f in files)} {b}" for b in formats)
        raise ValueError(f"dataset=hf:{name}: the folder mixes data formats ({counts} files), of which "
                         f"datasets would read only one; keep one format, or point hf: at one file")
    # the text builder cuts lines; keeping their line breaks makes the rows concatenate to the files
    options = {"keep_linebreaks": True} if formats == ["text"] else {}
    if path.is_file():
        return HF_BUILDERS[path.suffix], {"data_files": str(path), **options}
    return str(path), options  # a folder: datasets infers the format and the splits from file names


def _data_files(folder: Path) -> list[Path]:
    """The files of a folder that `datasets` itself would read (its split patterns: data/train-*.parquet
    and the like, hidden paths skipped), of the formats it can read. Metadata next to them
    (dataset_infos.json, LICENSE.txt) is not data when the data files carry split names."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        resolved = DataFilesDict.from_patterns(get_data_patterns(str(folder)), base_path=str(folder))
    except Exception:  # noqa: BLE001 - no pattern matched: the caller reports an empty folder
        return []
    return [Path(f) for files in resolved.values() for f in files if Path(f).suffix in HF_BUILDERS]


def _text_column(ds, name: str) -> str:
    """The column named 'text', else the only string column."""
    if "text" in ds.column_names:
        return "text"
    strings = [c for c, f in ds.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
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
        return hf_dataset(dataset[3:], split, text_column, cache_dir)
    path = Path(dataset).expanduser()
    if path.is_file():
        return read_text_file(path)
    if path.is_dir():
        return read_text_folder(path)
    raise ValueError(
        f"dataset={dataset!r} is neither 'shakespeare_char', 'hf:NAME', an existing file nor a folder"
    )
