"""Text sources: a bundled corpus, a UTF-8 file, a folder of .txt files or `hf:NAME[:SPLIT]`; and documents.

A corpus of documents (a folder's files, an hf: dataset's rows, or a file's lines or paragraphs when asked) is one
string in which SEPARATOR opens every document, so none is glued to the next.
"""

import glob
import hashlib
import os
import re
import socket
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

# bundled, public domain, checked by sha256: no network needed
CORPORA = Path(__file__).resolve().parent.parent / "corpora"
BUNDLED = {"shakespeare_char": ("tinyshakespeare.txt", "Tiny Shakespeare",
                                "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"),
           "surnames": ("surnames.txt", "US surnames (1990 census)",
                        "8e7bcf64c3bc12e912d6b347d8c26338c90d91cb6d269cf654f16ba61acaa0e1")}
SEPARATOR = "\x1e"  # ASCII's record separator: in no ordinary text
DOCUMENTS = ("", "lines", "paragraphs")
HF_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}
SPLIT_ORDER = {"train": 0, "validation": 1, "test": 2}  # so val, the last 10 %, is held out


def decode_utf8(raw: bytes, name: str) -> str:
    """bytes -> str, or ValueError naming the file, first bad byte and a fix."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not UTF-8 text: invalid byte 0x{raw[e.start]:02x} at byte offset {e.start}. "
                         f"Convert it first, e.g. iconv -f latin1 -t utf-8 {name} > {name}.utf8") from None


def join_documents(docs: Iterable[str], name: str) -> str:
    """SEPARATOR + each non-empty document, in order; a document holding SEPARATOR is refused."""
    docs = [d for d in docs if d]
    bad = next((i for i, d in enumerate(docs) if SEPARATOR in d), None)
    if bad is not None:
        raise ValueError(f"{name}: document {bad + 1} (of the non-empty ones, beginning {docs[bad][:20]!r}) contains "
                         f"U+001E, the document separator; remove it first, e.g. tr -d '\\036' < FILE > FILE.clean")
    return "".join(SEPARATOR + d for d in docs)


def split_documents(text: str, documents: str) -> list[str]:
    """text as documents: one per line ("lines") or blank-line-separated block ("paragraphs")."""
    if documents == "lines":  # not splitlines(): it also splits at U+001C..U+001E, the separator among them
        return [line.removesuffix("\r") for line in text.split("\n")]
    return [p.strip("\r\n") for p in re.split(r"\r?\n[ \t]*\r?\n", text)]


def load_text(dataset: str, split: str = "", text_column: str = "", documents: str = "") -> tuple[str, str]:
    """(text, name) of dataset. A folder (its non-hidden .txt files, sorted) and an hf: dataset (its rows) are
    documents; `documents` splits a file (or each document) further. A single file without it: its text as is."""
    if dataset in BUNDLED:
        file, name, sha256 = BUNDLED[dataset]
        raw = (CORPORA / file).read_bytes()
        if hashlib.sha256(raw).hexdigest() != sha256:
            raise ValueError(f"{CORPORA / file} is not the bundled {name} (sha256 differs): git checkout -- "
                             f"{CORPORA / file}")
        texts, is_docs = [raw.decode("utf-8")], False
    elif dataset.startswith("hf:"):
        texts, name = hf_text(dataset[3:], split, text_column)
        is_docs = True
    else:
        path = Path(dataset).expanduser()
        if path.is_file():
            texts, name, is_docs = [decode_utf8(path.read_bytes(), str(path))], str(path), False
        elif path.is_dir():
            files = sorted(path / f for f in glob.glob("**/*.txt", root_dir=path, recursive=True)
                           if (path / f).is_file())
            if not files:
                raise ValueError(f"folder {path} contains no .txt files")
            texts, name, is_docs = [decode_utf8(f.read_bytes(), str(f)) for f in files], \
                f"{path} ({len(files)} .txt files)", True
        else:
            raise ValueError(f"dataset={dataset!r} is neither one of {', '.join(BUNDLED)}, 'hf:NAME', an existing file "
                             "nor a folder")
    if documents:
        texts, is_docs = [d for t in texts for d in split_documents(t, documents)], True
    return (join_documents(texts, name) if is_docs else texts[0]), name


def hub_reachable() -> bool:
    """Whether HF_ENDPOINT accepts a TCP connection within 3 s."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
        return True
    except OSError:
        return False


def hf_text(spec: str, split: str, text_column: str) -> tuple[list[str], str]:
    """Rows of the text column of a save_to_disk folder, data file(s) or hub id, and a name; all splits in
    SPLIT_ORDER unless one."""
    name, _, spec_split = spec.partition(":")
    if split and spec_split and split != spec_split:
        raise ValueError(f"dataset=hf:{spec} names split {spec_split!r} but config field split={split!r}")
    split = split or spec_split
    path = Path(name).expanduser()
    if not path.exists() and not hub_reachable():
        os.environ["HF_HUB_OFFLINE"] = "1"  # read on import: cache only, not 20 s of retries
    import datasets

    # a .txt file is one document (one row), as the plain file and folder loaders read it
    options = {"sample_by": "document"} if path.suffix == ".txt" or path.is_dir() and any(path.rglob("*.txt")) else {}
    try:
        if (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists():
            ds = datasets.load_from_disk(str(path))
        elif path.is_file():
            if path.suffix not in HF_BUILDERS:
                raise ValueError(f"expected a {', '.join(HF_BUILDERS)} file; for plain text drop hf:")
            ds = datasets.load_dataset(HF_BUILDERS[path.suffix], data_files=str(path), **options)
        else:  # datasets infers format and splits
            ds = datasets.load_dataset(str(path.resolve()) if path.exists() else name, **options)
    except ConnectionError as e:
        raise ConnectionError(f"could not load hf:{name} ({e}). Offline? Pass a local copy instead: a folder written "
                              "by save_to_disk or data files as hf:PATH, or UTF-8 text as --dataset=PATH") from None
    except Exception as e:  # noqa: BLE001 - datasets raises many types
        raise ValueError(f"dataset=hf:{name}: {type(e.__cause__ or e).__name__}: {e.__cause__ or e}") from None
    splits = ds if isinstance(ds, datasets.DatasetDict) else {}
    if split and split not in splits:
        raise ValueError(f"dataset=hf:{name} has no split {split!r}; it has {list(splits) or 'none'}")
    if splits:
        order = [split] if split else sorted(splits, key=lambda s: (SPLIT_ORDER.get(s, 3), s))
        ds = datasets.concatenate_datasets([splits[s] for s in order])
    strings = [c for c, f in ds.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
    column = text_column or ("text" if "text" in strings else strings[0] if len(strings) == 1 else None)
    if not strings:
        raise ValueError(f"hf:{name} has no text column (its columns: {', '.join(ds.features)}); give one of text")
    if column not in strings:
        raise ValueError(f"hf:{name}: set text_column to one of its string columns {strings} (now {text_column!r})")
    return [t for t in ds[column] if t is not None], f"hf:{name}" + (f":{split}" if split else "")
