"""Tokenizer, text sources, the encoded cache, the 90/10 split and batching."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from data import CharTokenizer, encode_corpus, eval_windows, get_batch, load_corpus, load_source, write_atomic

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask


def test_tokenizer_round_trip_and_sorted_vocabulary():
    text = "hello, world!\nÄß"
    tok = CharTokenizer.from_text(text)
    assert tok.chars == sorted(set(text))
    assert tok.decode(tok.encode(text)) == text
    assert list(tok.encode_array(text)) == tok.encode(text)
    assert CharTokenizer.from_dict(json.loads(json.dumps(tok.to_dict()))) == tok


def test_encoding_unknown_characters_names_them():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"'x', 'z'"):
        tok.encode("abzx")
    with pytest.raises(ValueError, match=r"'q'"):
        tok.encode_array("aq")


def test_targets_are_inputs_shifted_by_one():
    data = np.arange(1000, dtype=np.uint16)  # token i has id i: y must be x + 1 everywhere
    x, y = get_batch(data, 16, 10, torch.Generator().manual_seed(0))
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16, 10)
    assert torch.equal(y, x + 1)
    assert torch.equal(y[:, :-1], x[:, 1:])


def test_tensor_data_batches_like_numpy_data():
    data = np.arange(50, dtype=np.uint16)
    a = get_batch(data, 4, 5, torch.Generator().manual_seed(3))
    b = get_batch(torch.from_numpy(data.astype(np.int64)), 4, 5, torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_batch_offsets_reach_the_last_window_and_never_run_past_the_end():
    data = np.arange(12, dtype=np.uint16)  # block 8: valid offsets are 0..3
    x, y = get_batch(data, 2000, 8, torch.Generator().manual_seed(0))
    starts = set(x[:, 0].tolist())
    assert starts == {0, 1, 2, 3}
    assert y.max().item() == 11  # the last token is a target, nothing beyond it is read


def test_batch_needs_block_size_plus_one_tokens():
    with pytest.raises(ValueError, match="at least block_size \\+ 1 = 9"):
        get_batch(np.arange(8, dtype=np.uint16), 1, 8)


def test_eval_windows_cover_every_target_once_in_order():
    windows = eval_windows(np.arange(23), 5)
    targets = [i for s, n in windows for i in range(s + 1, s + 1 + n)]
    assert targets == list(range(1, 23))


def test_split_is_first_90_percent_train():
    corpus = encode_corpus("abcdefghij" * 10, "test")
    assert len(corpus.train) == 90 and len(corpus.val) == 10
    assert corpus.tokenizer.decode(corpus.val) == "abcdefghij"


def test_empty_corpus_is_refused():
    with pytest.raises(ValueError, match="empty"):
        encode_corpus("", "nothing")


def test_encoded_cache_is_reused_and_rebuilt_when_the_file_changes(tmp_path, corpus_file):
    cache = tmp_path / "cache"
    first = load_corpus(str(corpus_file), cache)
    entries = list((cache / "encoded").iterdir())
    assert len(entries) == 1
    # a second load reads the cache entry (same arrays) without re-encoding
    marker = entries[0] / "train.bin"
    mtime = marker.stat().st_mtime_ns
    second = load_corpus(str(corpus_file), cache)
    assert marker.stat().st_mtime_ns == mtime
    assert np.array_equal(first.train, second.train) and first.tokenizer == second.tokenizer
    corpus_file.write_text(corpus_file.read_text() + "#", encoding="utf-8")
    third = load_corpus(str(corpus_file), cache)
    assert len(list((cache / "encoded").iterdir())) == 2
    assert "#" in third.tokenizer.chars


def test_folder_of_text_files_is_concatenated_in_path_order(tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second ", encoding="utf-8")
    (folder / "a.txt").write_text("first ", encoding="utf-8")
    (folder / "sub" / "c.txt").write_text("third", encoding="utf-8")
    (folder / "skip.md").write_text("not text", encoding="utf-8")
    assert load_source(str(folder), tmp_path).text == "first second third"


def test_non_utf8_file_names_the_byte_offset(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"caf" + b"\xe9 au lait")
    with pytest.raises(ValueError, match="byte offset 3"):
        load_source(str(path), tmp_path)


def test_unknown_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="neither 'shakespeare_char'"):
        load_source(str(tmp_path / "missing.txt"), tmp_path)


def test_shakespeare_offline_fails_at_once_and_says_how_to_pass_a_local_copy(tmp_path, monkeypatch):
    import urllib.request

    def offline(*a, **k):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(ConnectionError, match="--dataset=PATH/TO/input.txt"):
        load_source("shakespeare_char", tmp_path)


def test_shakespeare_cache_with_wrong_content_is_refused(tmp_path):
    target = tmp_path / "tinyshakespeare" / "input.txt"
    target.parent.mkdir()
    target.write_text("not shakespeare", encoding="utf-8")
    with pytest.raises(ValueError, match="is not Tiny Shakespeare"):
        load_source("shakespeare_char", tmp_path)


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    write_atomic(target, b"old")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("data.files.os.replace", full_disk)
    with pytest.raises(OSError):
        write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    monkeypatch.undo()
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomically_written_files_get_the_umask_permissions_not_mkstemps_0600(tmp_path, umask, mode):
    """ckpt.pt, summary.json and the corpus cache are read by other tools (and users of a shared
    cache_dir): they get what open() would give, 0666 minus the umask."""
    import os

    from training import save_checkpoint

    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "summary.json", b"{}")
        save_checkpoint(tmp_path / "ckpt.pt", {"step": 0})
    finally:
        os.umask(old)
    for name in ("summary.json", "ckpt.pt"):
        assert (tmp_path / name).stat().st_mode & 0o777 == mode, name


def test_replacing_a_file_keeps_its_mode_and_a_refused_chmod_still_writes(tmp_path, monkeypatch):
    """Like open(): a file the user restricted stays restricted when it is saved again; and where the
    filesystem refuses chmod, the write still succeeds (at mkstemp's private 0600), leaving no temp."""
    import os

    target = tmp_path / "ckpt.json"
    write_atomic(target, b"old")
    target.chmod(0o600)
    write_atomic(target, b"new")
    assert target.stat().st_mode & 0o777 == 0o600 and target.read_bytes() == b"new"

    def refuse(fd, mode):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchmod", refuse)
    write_atomic(tmp_path / "other.json", b"x")
    assert (tmp_path / "other.json").read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.json", "other.json"]


def test_a_txt_folder_skips_hidden_copies_and_never_shares_a_key_with_a_file(tmp_path):
    """.ipynb_checkpoints holds stale copies of a notebook folder's files: not part of the corpus.
    A file whose bytes spell a folder's hash input must not reuse the folder's encoded cache."""
    folder = tmp_path / "texts"
    (folder / ".ipynb_checkpoints").mkdir(parents=True)
    (folder / "a.txt").write_text("real text\n", encoding="utf-8")
    (folder / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("stale draft\n", encoding="utf-8")
    src = load_source(str(folder), tmp_path)
    assert src.text == "real text\n"
    forged = tmp_path / "forged.txt"
    forged.write_bytes(b"a.txt\0real text\n\0")
    assert load_source(str(forged), tmp_path).key != src.key


def test_a_txt_folder_reads_a_file_whose_name_is_not_utf8(tmp_path):
    import os

    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("first\n", encoding="utf-8")
    with open(os.path.join(os.fsencode(folder), b"b\xff.txt"), "wb") as f:
        f.write(b"second\n")
    assert load_source(str(folder), tmp_path).text == "first\nsecond\n"
