"""data/: the bundled corpus, tokenizer, 90/10 split, batches, eval windows and text sources (files, .txt
folders, hf: datasets built offline in tmp_path). The label shift itself is causality.check_batch_shift's."""

import hashlib
import os
import re
import socket
import time
import traceback

import numpy as np
import pytest
import torch

import data.text
from data import CharTokenizer, Corpus, check_split_sizes, eval_windows, get_batch, load_corpus
from data.corpus import encode_corpus
from data.text import load_text
from tiny import TEXT
from training import exact_loss

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask

SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"  # of karpathy's input.txt
SEP = data.text.SEPARATOR
CORPUS = (TEXT * 25)[:2000]  # 1,800 / 100 / 100 characters, like the hub's tiny_shakespeare splits


def test_the_bundled_corpus_is_tiny_shakespeare_split_as_in_nanogpt_and_a_tampered_copy_refused(tmp_path, monkeypatch):
    raw = (data.text.CORPORA / "tinyshakespeare.txt").read_bytes()
    assert len(raw) == 1_115_394 and hashlib.sha256(raw).hexdigest() == SHAKESPEARE_SHA256
    assert (text := load_text("shakespeare_char")[0]).encode("utf-8") == raw
    corpus = encode_corpus(text, "shakespeare")
    tok, n = corpus.tokenizer, len(corpus.train)
    assert tok.vocab_size == 65 and (n, len(corpus.val)) == (1_003_854, 111_540)
    assert tok.decode(corpus.train[:14]) == "First Citizen:" and tok.decode(corpus.train[-50:]) == text[n - 50:n]
    assert tok.decode(corpus.val) == text[n:]
    for name, copy in (("intact", raw), ("tampered", raw[:1000] + bytes([raw[1000] ^ 1]) + raw[1001:])):  # 1 bit
        (tmp_path / name).mkdir()
        (tmp_path / name / "tinyshakespeare.txt").write_bytes(copy)
    monkeypatch.setattr(data.text, "CORPORA", tmp_path / "intact")
    assert load_text("shakespeare_char")[0].encode() == raw  # the control: the path is not what is refused
    monkeypatch.setattr(data.text, "CORPORA", tmp_path / "tampered")
    with pytest.raises(ValueError, match="is not the bundled Tiny Shakespeare"):
        load_text("shakespeare_char")


@pytest.mark.parametrize("length, n_train", [(1000, 900), (1009, 908)])
def test_the_split_is_the_first_90_percent_train_and_the_rest_val_with_no_gap_or_overlap(length, n_train):
    corpus = encode_corpus(text := "".join(chr(0x100 + i) for i in range(length)), "distinct")  # each its own
    assert len(corpus.train) == n_train
    assert np.concatenate([corpus.train, corpus.val]).tolist() == corpus.tokenizer.encode(text)
    assert corpus.tokenizer.decode(corpus.val) == text[n_train:]


def test_the_tokenizer_round_trips_sorts_its_vocabulary_names_unknown_characters_and_encode_array_is_encode():
    text = TEXT + "Äß€😀\t"  # beyond ASCII and beyond the BMP
    tok = encode_corpus(text, "t").tokenizer
    assert tok.chars == sorted(set(text)) and tok.decode(tok.encode(text)) == text
    assert (ids := tok.encode_array(text)).dtype == np.uint16 and ids.tolist() == tok.encode(text)
    assert tok.encode_array("").shape == (0,) and tok.encode("") == []
    assert CharTokenizer.from_dict(tok.to_dict()) == tok and CharTokenizer("ab") != CharTokenizer("ba")
    assert CharTokenizer("ba").encode("ab") == [1, 0]  # ids in the given order, which a checkpoint keeps
    with pytest.raises(ValueError, match=r"not in the vocabulary: 'x', 'z'; use these 3: 'abc'$"):
        CharTokenizer("abc").encode("abzx")
    with pytest.raises(ValueError, match=r"'q'"):
        CharTokenizer("abc").encode_array("aq")


@pytest.mark.parametrize("chars", [[], ["a", "b", "a"], ["a", ""], ["ab"]], ids=["empty", "dup", "blank", "pair"])
def test_a_vocabulary_that_is_empty_repeats_or_is_not_single_characters_is_refused(chars):
    for make in (CharTokenizer, lambda c: CharTokenizer.from_dict({"chars": c})):
        with pytest.raises(ValueError, match="CharTokenizer"):
            make(chars)  # from_dict: what a checkpoint's vocabulary goes through
    with pytest.raises(ValueError, match="'chars' list"):
        CharTokenizer.from_dict({"chars": "ab"})


def test_65536_distinct_characters_fit_a_token_and_one_more_is_refused():
    codes = [c for c in range(0x11000) if not 0xD800 <= c <= 0xDFFF]  # no surrogates
    corpus = encode_corpus(text := "".join(map(chr, codes[:65536])), "wide")
    assert corpus.tokenizer.vocab_size == 65536
    assert corpus.tokenizer.decode(np.concatenate([corpus.train, corpus.val])) == text
    with pytest.raises(ValueError, match="65,537 distinct characters"):
        encode_corpus(text + chr(codes[65536]), "wider")


def test_batches_draw_their_windows_from_the_generator_reaching_offset_n_minus_t_minus_1_and_need_t_plus_1_tokens():
    n, T, gen = 12, 8, lambda seed: torch.Generator().manual_seed(seed)
    ids = torch.arange(n, dtype=torch.int32)  # as train.py holds a split
    x, y = get_batch(ids, 2000, T, gen(0))
    assert torch.equal(x, get_batch(ids, 2000, T, gen(0))[0])  # the same generator, the same windows
    assert not torch.equal(x, get_batch(ids, 2000, T, gen(1))[0])  # the control: the generator decides
    assert set(x[:, 0].tolist()) == set(range(n - T)) and y.max().item() == n - 1  # offsets 0 .. n - T - 1
    assert x.dtype == y.dtype == torch.int64
    assert get_batch(torch.arange(9), 3, 8)[0][:, 0].tolist() == [0, 0, 0]  # T + 1: one window; no generator given
    with pytest.raises(ValueError, match=r"has 8 tokens; a batch needs at least block_size \+ 1 = 9"):
        get_batch(torch.arange(8), 1, 8, gen(0))


def test_eval_windows_cover_every_target_exactly_once_in_order_down_to_a_last_window_of_one():
    for n in range(6, 17):  # every N - 1 modulo T, twice
        windows = eval_windows(np.arange(n), 5)
        assert [t for s, length in windows for t in range(s + 1, s + 1 + length)] == list(range(1, n)), \
            f"N={n}, T=5: the windows {windows} do not score targets 1..{n - 1} once each, in order"
        assert all(0 < length <= 5 for _, length in windows)
    assert eval_windows(np.arange(12), 5) == [(0, 5), (5, 5), (10, 1)]  # (12 - 1) % 5 == 1
    assert eval_windows(np.arange(11), 5) == [(0, 5), (5, 5)]


class Bigram(torch.nn.Module):
    """Logits of each position from its own token alone: any window gives the same loss for a pair."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table  # (V, V)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.table[x], None  # (B, T, V)


def test_the_exact_loss_scores_each_target_of_a_long_split_once():
    """40,001 tokens, past int16's reach: a bigram model's exact loss is its mean cross-entropy over every pair."""
    table = torch.randn(7, 7, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(7, (40_001,), generator=torch.Generator().manual_seed(1))
    want = torch.nn.functional.cross_entropy(table[tokens[:-1]].double(), tokens[1:]).item()
    assert exact_loss(Bigram(table), tokens, 16, 64, "cpu") == pytest.approx(want, rel=1e-6)


def test_a_folder_is_its_txt_files_in_sorted_path_order_without_hidden_ones(tmp_path):
    folder = tmp_path / ".cache" / "texts"  # only names below the folder count as hidden; sub.txt/ is no file
    for name, text in [("b.txt", "second "), ("a.txt", "first "), ("sub.txt/0.txt", "third"), ("notes.md", "no"),
                       ("only_hidden/.draft.txt", "hidden"), (".ipynb_checkpoints/a-checkpoint.txt", "stale")]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    assert load_text(str(folder))[0] == SEP + "first " + SEP + "second " + SEP + "third"  # a document each
    with pytest.raises(ValueError, match="contains no .txt files"):
        load_text(str(folder / "only_hidden"))


def test_a_utf8_file_is_read_as_it_is_and_a_non_utf8_one_an_unknown_dataset_or_an_empty_corpus_is_refused(tmp_path):
    path, bad = tmp_path / "corpus.txt", tmp_path / "texts" / "b.txt"
    path.write_text(TEXT + "Äß\r\n", encoding="utf-8", newline="")
    assert load_text(str(path)) == (TEXT + "Äß\r\n", str(path))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("fine\n", encoding="utf-8")
    bad.write_bytes("café au lait\n".encode("latin-1"))
    for dataset in (bad, tmp_path / "texts"):
        with pytest.raises(ValueError, match=rf"{bad} is not UTF-8 text: invalid byte 0xe9 at byte offset 3\. "
                                             rf"Convert it first, e\.g\. iconv -f latin1 -t utf-8 {bad}"):
            load_text(str(dataset))  # named with the byte offset and how to convert it
    with pytest.raises(ValueError, match="neither one of shakespeare_char, surnames, 'hf:NAME', an existing file nor"):
        load_text(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match=r"corpus .*empty\.txt is empty"):
        load_corpus(str(tmp_path / "empty.txt"))


@pytest.mark.parametrize("n_train, n_val, split, suggestion", [
    (40, 5, "val", "--block_size=4 or less"), (3, 40, "train", "--block_size=2 or less"),
    (40, 2, "val", "--block_size=1 or less"), (40, 1, "val", "a smaller block_size"),  # the last that fits, none
    (40, 16, "val", "--block_size=15 or less")])
def test_a_split_too_short_is_named_with_the_largest_block_size_that_fits(n_train, n_val, split, suggestion):
    corpus = Corpus(np.zeros(n_train, np.uint16), np.zeros(n_val, np.uint16), CharTokenizer("a"), "x")
    n = min(n_train, n_val)
    with pytest.raises(ValueError, match=rf"^the {split} split of x has {n} tokens; block_size=16 needs at least "
                                         rf"17\. .* or {suggestion}$"):
        check_split_sizes(corpus, 16)
    check_split_sizes(corpus, n - 1)  # n tokens hold one window of n - 1 inputs and their targets


@pytest.fixture
def hf(tmp_path, monkeypatch):
    """Offline datasets (its flags too), a cache of the test's own, sockets that refuse: no test reaches the Hub."""
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))

    def refuse(self, address):
        raise OSError(f"test tried to connect to {address}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return datasets


@pytest.fixture
def saved(hf, tmp_path):
    """A DatasetDict shaped like karpathy/tiny_shakespeare, its splits stored out of order."""
    pieces = {"test": CORPUS[1900:], "train": CORPUS[:1800], "validation": CORPUS[1800:1900]}
    hf.DatasetDict({k: hf.Dataset.from_dict({"text": [v]}) for k, v in pieces.items()}).save_to_disk(tmp_path / "ts")
    return f"hf:{tmp_path / 'ts'}"


def single_error(e: pytest.ExceptionInfo) -> str:
    """The message, after checking the traceback shows one error (not "During handling ... another")."""
    assert len(traceback.format_exception(e.value)) == len(traceback.format_exception(e.value, chain=False))
    return str(e.value)


def test_saved_splits_read_back_as_train_validation_test_or_one_split_by_name(hf, saved, tmp_path):
    corpus = load_corpus(saved)  # each split's row is a document
    assert corpus.tokenizer.decode(corpus.train) == SEP + CORPUS[:1800] + SEP  # the hub's train split (90 %)
    assert corpus.tokenizer.decode(corpus.val) == CORPUS[1800:1900] + SEP + CORPUS[1900:]  # validation + test
    assert load_text(f"{saved}:validation")[0] == load_text(saved, split="validation")[0] == SEP + CORPUS[1800:1900]
    assert load_text(saved, split="test") == (SEP + CORPUS[1900:], f"{saved}:test")  # the name says which split
    one = load_corpus(saved, "validation", "text")  # (dataset, split, text_column), as a run passes them
    assert one.name == f"{saved}:validation" and set(one.tokenizer.chars) == set(SEP + CORPUS[1800:1900])
    with pytest.raises(ValueError, match="names split 'test' but config field split='train'"):
        load_text(f"{saved}:test", split="train")
    hf.DatasetDict({k: hf.Dataset.from_dict({"text": [k]}) for k in ("extra", "train")}).save_to_disk(tmp_path / "x")
    assert load_text(f"hf:{tmp_path / 'x'}")[0] == SEP + "train" + SEP + "extra"  # other splits after test


def test_a_data_file_or_a_folder_of_them_loads_train_split_first_and_txt_files_read_as_plain_text(hf, tmp_path):
    """A .txt file keeps its line breaks, and a folder of them reads the text the plain folder loader reads; either
    folder's documents are split into lines when asked."""
    rows = hf.Dataset.from_dict({"text": ["alpha\n", "beta\n"]})
    rows.to_parquet(tmp_path / "one.parquet")
    assert load_text(f"hf:{tmp_path / 'one.parquet'}")[0] == SEP + "alpha\n" + SEP + "beta\n"  # a row, a document
    (tmp_path / "repo" / "data").mkdir(parents=True)
    hf.Dataset.from_dict({"text": ["held out\n"]}).to_parquet(tmp_path / "repo" / "data" / "test.parquet")
    rows.to_parquet(tmp_path / "repo" / "data" / "train.parquet")
    assert load_text(f"hf:{tmp_path / 'repo'}")[0] == SEP + "alpha\n" + SEP + "beta\n" + SEP + "held out\n"  # train 1st
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("line one\n\nline two", encoding="utf-8")
    (tmp_path / "texts" / "b.txt").write_text("last line\n", encoding="utf-8")
    assert load_text(f"hf:{tmp_path / 'texts' / 'a.txt'}")[0] == SEP + "line one\n\nline two"  # a file, a document
    assert load_text(f"hf:{tmp_path / 'texts'}")[0] == load_text(str(tmp_path / "texts"))[0]  # as plain text
    for source in (str(tmp_path / "texts"), f"hf:{tmp_path / 'texts'}"):  # documents= splits each document further
        assert load_text(source, documents="lines")[0] == SEP + "line one" + SEP + "line two" + SEP + "last line"


def test_the_text_column_is_text_or_the_only_string_column_or_the_one_named(hf, tmp_path):
    for name, columns in [("texty", {"title": ["A"], "text": ["body\n"]}),
                          ("one", {"content": ["only ", None, "strings"], "id": [1, 2, 3]}),
                          ("two", {"title": ["A", "B"], "body": ["first\n", "second\n"], "n": [1, 2]}),
                          ("none", {"n": [1, 2], "x": [0.5, 1.5]})]:
        hf.Dataset.from_dict(columns).save_to_disk(tmp_path / name)
    assert load_text(f"hf:{tmp_path / 'texty'}")[0] == SEP + "body\n"
    for documents in ("", "lines"):  # a null row adds nothing
        assert load_text(f"hf:{tmp_path / 'one'}", documents=documents)[0] == SEP + "only " + SEP + "strings"
    assert load_text(f"hf:{tmp_path / 'two'}", text_column="body")[0] == SEP + "first\n" + SEP + "second\n"
    with pytest.raises(ValueError, match=r"set text_column to one of its string columns \['title', 'body'\]"):
        load_text(f"hf:{tmp_path / 'two'}")
    with pytest.raises(ValueError, match=r"none has no text column \(its columns: n, x\); give one of text"):
        load_text(f"hf:{tmp_path / 'none'}")


@pytest.mark.parametrize("field, value", [("split", "dev"), ("text_column", "content")])
def test_an_unknown_split_or_column_is_one_error_naming_it(saved, hf, tmp_path, field, value):
    hf.Dataset.from_dict({"text": ["a\n"]}).to_parquet(tmp_path / "one.parquet")
    for dataset in (saved, f"hf:{tmp_path / 'one.parquet'}"):
        with pytest.raises(ValueError) as e:
            load_text(dataset, **{field: value})
        assert re.search(rf"['\"]{value}['\"]", single_error(e)), (dataset, str(e.value))
        assert field != "split" or dataset != saved or "; it has ['test', 'train', 'validation']" in str(e.value)


def test_a_dataset_path_may_start_at_home_and_a_text_column_be_a_large_string(hf, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "mine.txt").write_text("abc", encoding="utf-8")
    hf.Dataset.from_dict({"body": ["de"]}, features=hf.Features({"body": hf.Value("large_string")})).to_parquet(
        tmp_path / "mine.parquet")  # arrow's 64-bit-offset strings: what big exports hold
    assert load_text("~/mine.txt")[0] == "abc" and load_text("hf:~/mine.parquet")[0] == SEP + "de"


def test_a_file_that_hf_cannot_read_is_one_error_naming_it_and_why(hf, tmp_path):
    (tmp_path / "notes.xml").write_text("<a/>")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    expected = "ValueError: expected a .parquet, .json, .jsonl, .csv, .txt file; for plain text drop hf:"
    for name, why in (("notes.xml", re.escape(expected)), ("broken.parquet", r"\w+: \S")):  # pyarrow's own words
        with pytest.raises(ValueError) as e:
            load_text(f"hf:{tmp_path / name}")
        assert re.match(re.escape(f"dataset=hf:{tmp_path / name}: ") + why, single_error(e)), str(e.value)


def test_an_uncached_hub_id_offline_fails_in_seconds_saying_how_to_pass_a_local_copy(hf, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")  # hf_text must set it: `datasets` reads it when first imported
    monkeypatch.setattr(data.text, "hub_reachable", lambda timeout=3.0: False)
    t0 = time.perf_counter()
    with pytest.raises(ConnectionError) as e:
        load_text("hf:nobody-has/this-dataset-gpt-char")
    assert time.perf_counter() - t0 < 5  # not ~20 s of retries
    assert "nobody-has/this-dataset-gpt-char" in single_error(e)
    assert "Pass a local copy instead: a folder written by save_to_disk" in str(e.value)
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_the_hub_is_reachable_when_hf_endpoint_accepts_a_connection(monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as server:  # a local endpoint: no network
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert data.text.hub_reachable()
    assert not data.text.hub_reachable()  # closed: refused


def test_documents_are_lines_or_paragraphs_each_opened_by_the_separator_which_predicts_their_first_char(tmp_path):
    """documents="lines"/"paragraphs" (non-empty lines, blank-line-separated blocks; without it a file is one text);
    one holding the separator is refused; at a boundary the last character predicts the separator."""
    (path := tmp_path / "docs.txt").write_text("ab\n\n  cd\nef\n", encoding="utf-8")  # indentation is text
    assert [load_text(str(path), documents=d)[0] for d in ("lines", "paragraphs", "")] == [
        SEP + "ab" + SEP + "  cd" + SEP + "ef", SEP + "ab" + SEP + "  cd\nef", "ab\n\n  cd\nef\n"]
    path.write_bytes(b"ab\r\n \r\ncd\r\nef\r\n")  # Windows line ends; a blank line that holds a space
    assert [load_text(str(path), documents=d)[0] for d in ("lines", "paragraphs")] == [
        SEP + "ab" + SEP + " " + SEP + "cd" + SEP + "ef", SEP + "ab" + SEP + "cd\r\nef"]
    path.write_text("ab\nc" + SEP + "d\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape("document 2 (of the non-empty ones, beginning 'c\\x1ed') contains "
                                                   "U+001E, the document separator; remove it first, e.g. tr -d "
                                                   "'\\036' < FILE > FILE.clean")):
        load_text(str(path), documents="lines")
    path.write_text("ann\nbo\ncyd\n", encoding="utf-8")
    corpus = load_corpus(str(path), documents="lines")
    x, y = data.inputs_and_targets(torch.from_numpy(np.concatenate([corpus.train, corpus.val]).astype(np.int64))[None])
    pairs = list(zip(corpus.tokenizer.decode(x[0]), corpus.tokenizer.decode(y[0]), strict=True))
    assert [(a, b) for a, b in pairs if SEP in (a, b)] == [(SEP, "a"), ("n", SEP), (SEP, "b"), ("o", SEP), (SEP, "c")]
