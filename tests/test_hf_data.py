"""`dataset = "hf:..."`: datasets built with `datasets` in a temp dir and read back with no network
(offline mode on and every socket connection refused), plus a training run on one of them."""

from __future__ import annotations

import hashlib
import socket

import pytest
from tiny_runs import TEXT, tiny_config

import train
from data import load_corpus, load_source

datasets = pytest.importorskip("datasets")

CORPUS = (TEXT * 25)[:2000]  # 2,000 characters: 1,800 / 100 / 100 like the hub's Tiny Shakespeare


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Offline mode for datasets/huggingface_hub (already imported, so their flags are set directly,
    not only the environment), and a socket that refuses to connect, so a test cannot pass online."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def refuse(self, address):
        raise OSError(f"test tried to connect to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A DatasetDict shaped like karpathy/tiny_shakespeare, its splits stored out of order."""
    root = tmp_path_factory.mktemp("hf")
    pieces = {"test": CORPUS[1900:], "train": CORPUS[:1800], "validation": CORPUS[1800:1900]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": [v]}) for k, v in pieces.items()}) \
        .save_to_disk(str(root / "tiny_shakespeare"))
    return root


def test_splits_concatenate_train_validation_test_so_the_90_10_split_is_nanogpts(saved, tmp_path):
    corpus = load_corpus(f"hf:{saved / 'tiny_shakespeare'}", tmp_path / "cache")
    assert corpus.tokenizer.decode(corpus.train) == CORPUS[:1800]  # = the hub's train split
    assert corpus.tokenizer.decode(corpus.val) == CORPUS[1800:]  # = validation + test
    # keyed by content: the same text as a plain file shares its encoded cache entry
    plain = tmp_path / "input.txt"
    plain.write_text(CORPUS, encoding="utf-8")
    src = load_source(f"hf:{saved / 'tiny_shakespeare'}", tmp_path / "cache")
    assert src.key == load_source(str(plain), tmp_path).key == hashlib.sha256(CORPUS.encode()).hexdigest()


def test_one_split_by_suffix_or_by_config_field(saved, tmp_path):
    path = saved / "tiny_shakespeare"
    assert load_source(f"hf:{path}:validation", tmp_path).text == CORPUS[1800:1900]
    assert load_source(f"hf:{path}", tmp_path, split="test").text == CORPUS[1900:]
    with pytest.raises(ValueError, match=r"no split 'dev'; it has \['test', 'train', 'validation'\]"):
        load_source(f"hf:{path}:dev", tmp_path)
    with pytest.raises(ValueError, match="names split 'test' but config field split='train'"):
        load_source(f"hf:{path}:test", tmp_path, split="train")


def test_text_column_is_text_or_the_only_string_column_or_named(tmp_path):
    two = datasets.Dataset.from_dict({"title": ["A", "B"], "body": ["first\n", "second\n"], "n": [1, 2]})
    two.save_to_disk(str(tmp_path / "two"))
    with pytest.raises(ValueError, match=r"cannot tell the text column among \['title', 'body', 'n'\]"):
        load_source(f"hf:{tmp_path / 'two'}", tmp_path)
    assert load_source(f"hf:{tmp_path / 'two'}", tmp_path, text_column="body").text == "first\nsecond\n"
    with pytest.raises(ValueError, match="no column 'content'"):
        load_source(f"hf:{tmp_path / 'two'}", tmp_path, text_column="content")
    with pytest.raises(ValueError, match="column 'n' holds .*int64.*, not text"):
        load_source(f"hf:{tmp_path / 'two'}", tmp_path, text_column="n")
    one = datasets.Dataset.from_dict({"content": ["only ", None, "strings"], "id": [1, 2, 3]})
    one.save_to_disk(str(tmp_path / "one"))
    assert load_source(f"hf:{tmp_path / 'one'}", tmp_path).text == "only strings"  # a null row adds nothing


def test_parquet_file_and_folders_of_data_files_load_offline(tmp_path):
    rows = datasets.Dataset.from_dict({"text": ["alpha\n", "beta\n"]})
    rows.to_parquet(str(tmp_path / "one.parquet"))
    assert load_source(f"hf:{tmp_path / 'one.parquet'}", tmp_path).text == "alpha\nbeta\n"
    folder = tmp_path / "repo" / "data"
    folder.mkdir(parents=True)
    datasets.Dataset.from_dict({"text": ["held out\n"]}).to_parquet(str(folder / "test.parquet"))
    rows.to_parquet(str(folder / "train.parquet"))
    assert load_source(f"hf:{tmp_path / 'repo'}", tmp_path).text == "alpha\nbeta\nheld out\n"  # train first
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("line one\nline two\n", encoding="utf-8")
    (texts / "b.txt").write_text("last line\n", encoding="utf-8")
    # the text builder keeps line breaks: the same text as the plain folder loader reads
    assert load_source(f"hf:{texts}", tmp_path).text == load_source(str(texts), tmp_path).text


def test_missing_paths_and_an_unreachable_hub_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="no such file or directory"):
        load_source(f"hf:{tmp_path / 'missing.parquet'}", tmp_path)
    (tmp_path / "notes.md").write_text("# notes", encoding="utf-8")
    with pytest.raises(ValueError, match="for plain text drop the hf: prefix"):
        load_source(f"hf:{tmp_path / 'notes.md'}", tmp_path)
    with pytest.raises(ConnectionError, match=r"tiny_shakespeare.*Pass a local copy instead: --dataset=hf:PATH"):
        load_source("hf:karpathy/tiny_shakespeare", tmp_path)


@pytest.mark.parametrize("kind", ["hf", "txt folder"])
def test_training_runs_on_a_local_hf_dataset_and_a_txt_folder(kind, saved, tmp_path):
    if kind == "hf":
        dataset = f"hf:{saved / 'tiny_shakespeare'}"
    else:
        (tmp_path / "texts").mkdir()
        for i in range(3):
            (tmp_path / "texts" / f"{i}.txt").write_text(CORPUS[i * 700:(i + 1) * 700], encoding="utf-8")
        dataset = str(tmp_path / "texts")
    cfg = tiny_config(tmp_path, dataset=dataset, max_iters=2, eval_interval=2, tensorboard=False)
    summary = train.train(cfg, verbose=False)
    assert summary["steps"] == 2 and summary["final_val_loss"] > 0
    corpus = load_corpus(dataset, cfg.cache_dir)
    assert corpus.tokenizer.decode(corpus.val) == CORPUS[1800:]


def test_a_local_file_edited_without_a_new_mtime_is_read_again(tmp_path):
    """datasets keys its prepared tables on path + mtime; cp -p, rsync -a and tar x keep the mtime."""
    import os

    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "old rows\\n"}\n', encoding="utf-8")
    os.utime(path, (1_700_000_000, 1_700_000_000))
    assert load_source(f"hf:{path}", tmp_path).text == "old rows\n"
    path.write_text('{"text": "new rows\\n"}\n', encoding="utf-8")
    os.utime(path, (1_700_000_000, 1_700_000_000))  # same size, same mtime, other content
    assert load_source(f"hf:{path}", tmp_path).text == "new rows\n"


def test_a_folder_mixing_data_formats_is_refused_not_half_read(tmp_path):
    """datasets reads only a folder's most common format: the other files would vanish silently."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("line\n", encoding="utf-8")
    (folder / "b.txt").write_text("line\n", encoding="utf-8")
    (folder / "meta.json").write_text('{"text": "x"}', encoding="utf-8")
    with pytest.raises(ValueError, match=r"mixes data formats \(1 json, 2 text files\)"):
        load_source(f"hf:{folder}", tmp_path)


def test_a_saved_single_dataset_refuses_a_split_name_instead_of_ignoring_it(tmp_path):
    """A single Dataset has no splits to choose from; its recorded split name is unreliable
    (train_test_split()["test"] still records "train"), so any split name is refused."""
    rows = datasets.Dataset.from_dict({"text": ["a\n", "b\n", "c\n", "d\n"]}, split="train")
    rows.train_test_split(test_size=0.5, seed=0)["test"].save_to_disk(str(tmp_path / "held_out"))
    assert len(load_source(f"hf:{tmp_path / 'held_out'}", tmp_path).text) == 4  # read whole: fine
    for split in ("test", "train", "validation"):
        with pytest.raises(ValueError, match=f"single saved Dataset, with no splits to choose from; drop the "
                                             f"split '{split}'"):
            load_source(f"hf:{tmp_path / 'held_out'}:{split}", tmp_path)


def test_a_hub_repository_clone_with_metadata_files_loads_its_data_files(tmp_path):
    """dataset_infos.json, LICENSE.txt or a .git folder next to data/{split}-*.parquet are not data:
    datasets reads the split-named files only, and so is the format check."""
    repo = tmp_path / "tiny_shakespeare"
    (repo / "data").mkdir(parents=True)
    (repo / ".git").mkdir()
    for split, text in (("train", "TRAIN\n"), ("validation", "VAL\n"), ("test", "TEST\n")):
        datasets.Dataset.from_dict({"text": [text]}).to_parquet(str(repo / "data" / f"{split}-00000-of-00001.parquet"))
    (repo / "dataset_infos.json").write_text("{}", encoding="utf-8")
    (repo / "LICENSE.txt").write_text("license text\n", encoding="utf-8")
    (repo / ".git" / "config.json").write_text("{}", encoding="utf-8")
    (repo / "README.md").write_text("# card\n", encoding="utf-8")
    assert load_source(f"hf:{repo}", tmp_path).text == "TRAIN\nVAL\nTEST\n"
    assert load_source(f"hf:{repo}:validation", tmp_path).text == "VAL\n"
    assert not list((tmp_path / "hf").glob("local-*"))  # the private caches of the loads are gone


@pytest.mark.parametrize("name, content", [("bad.jsonl", '{"text": "ok"}\n{"text": \n'), ("empty.jsonl", "")])
def test_a_malformed_or_empty_local_file_is_one_error_naming_it(tmp_path, name, content):
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=rf"dataset=hf:.*{name}: datasets could not read it"):
        load_source(f"hf:{tmp_path / name}", tmp_path)
