"""Contracts a second mutation run found unpinned: data caching and encoding, checkpoints and resume,
which split and seed each loss comes from, what the monitor logs, config refusals and signal
handling (its sample.py findings are in test_sample.py). Each docstring names the bug (a single-line
change to the code) it was shown to catch."""

from __future__ import annotations

import json
import signal
import threading
import urllib.request

import numpy as np
import pytest
import torch
from tiny_runs import TEXT, tiny_config

import train
from data import CharTokenizer, Corpus, atomic_file, check_split_sizes, encode_corpus, load_corpus, sources
from data import corpus as corpus_mod
from model import GPT
from training import (
    TrainConfig,
    estimate_loss,
    exact_loss,
    faults,
    load_checkpoint,
    model_from_checkpoint,
    parse_args,
    save_checkpoint,
)
from training.checkpoint import check_resumable
from training.evaluate import evaluating
from training.monitor import RunLog, resolve_prompts

CPU = torch.device("cpu")


# --- data ------------------------------------------------------------------------------------

def test_a_split_of_exactly_block_size_tokens_is_refused_up_front():
    """Catches (check_split_sizes `< block_size + 1` -> `< block_size`)."""
    tok = CharTokenizer("ab")
    ok = Corpus(np.zeros(17, np.uint16), np.zeros(17, np.uint16), tok, "x")
    check_split_sizes(ok, 16)  # 17 tokens: one window of 16 inputs + 1 target
    short = Corpus(np.zeros(17, np.uint16), np.zeros(16, np.uint16), tok, "x")
    with pytest.raises(ValueError, match="the val split of x has 16 tokens; block_size=16 needs at least 17"):
        check_split_sizes(short, 16)


def test_a_cache_entry_with_a_damaged_vocab_is_rebuilt(tmp_path, corpus_file):
    """Catches (only OSError caught: a vocab.json that is not JSON crashed every later load)."""
    cache = tmp_path / "cache"
    first = load_corpus(str(corpus_file), cache)
    (vocab,) = (cache / "encoded").glob("*/vocab.json")
    vocab.write_text("{truncated", encoding="utf-8")
    again = load_corpus(str(corpus_file), cache)
    assert again.tokenizer == first.tokenizer and np.array_equal(again.val, first.val)
    assert json.loads(vocab.read_text(encoding="utf-8")) == first.tokenizer.to_dict()  # rewritten


def test_encoding_in_chunks_equals_encoding_in_one_piece():
    """Catches (chunks that skip or overlap characters: corpora over 4M characters)."""
    text = TEXT * 3
    tok = CharTokenizer.from_text(text)
    chunked = corpus_mod._encode_with_progress(tok, text, chunk=7)
    assert chunked.dtype == np.uint16 and np.array_equal(chunked, tok.encode_array(text))


def test_exactly_65536_distinct_characters_fit_the_token_dtype():
    """Catches (`>` -> `>=` in encode_corpus) and (encode_array's `max + 1` -> `max`)."""
    codes = [c for c in range(0x11000) if not 0xD800 <= c <= 0xDFFF][:65536]  # no surrogates
    text = "".join(map(chr, codes)) * 2
    corpus = encode_corpus(text, "wide")
    assert corpus.tokenizer.vocab_size == 65536
    assert corpus.tokenizer.decode(np.concatenate([corpus.train, corpus.val])) == text


def test_editing_a_file_of_a_txt_folder_changes_its_cache_key(tmp_path):
    """Catches (folder key hashed file names only: an edited file kept its stale encoded cache)."""
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT * 20, encoding="utf-8")
    (folder / "b.txt").write_text(TEXT * 20, encoding="utf-8")
    before = load_corpus(str(folder), tmp_path / "cache")
    (folder / "b.txt").write_text(TEXT.upper() * 20, encoding="utf-8")
    after = load_corpus(str(folder), tmp_path / "cache")
    assert "R" in before.tokenizer.chars and "z" not in after.tokenizer.chars  # the edit was read
    assert after.tokenizer != before.tokenizer


def test_a_tiny_shakespeare_file_of_the_right_size_but_wrong_bytes_is_refused(tmp_path):
    """Catches (only the size checked: a same-size corrupt download was trained on)."""
    target = tmp_path / "tinyshakespeare" / "input.txt"
    target.parent.mkdir()
    target.write_bytes(b"a" * sources.SHAKESPEARE_BYTES)
    with pytest.raises(ValueError, match="is not Tiny Shakespeare"):
        sources.tiny_shakespeare(tmp_path)


def test_a_download_cut_off_midway_leaves_no_file_behind(tmp_path, monkeypatch):
    """Catches (download written straight to the target: a partial file then looks finished)."""
    class Cut:
        headers = {"Content-Length": "100"}
        sent = False

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self, n):
            if not self.sent:
                self.sent = True
                return b"First Citizen:\n"
            raise TimeoutError("read timed out")

    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: Cut())
    with pytest.raises(ConnectionError, match="could not download Tiny Shakespeare"):
        sources.tiny_shakespeare(tmp_path)
    assert list((tmp_path / "tinyshakespeare").iterdir()) == []


def test_a_vocabulary_with_a_repeated_character_is_refused():
    """Catches (the duplicate check dropped: a damaged vocab.json/checkpoint vocab loads)."""
    with pytest.raises(ValueError, match="duplicate"):
        CharTokenizer.from_dict({"chars": ["a", "b", "a"]})


def test_ctrl_c_during_an_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
    """Catches (`except BaseException` -> `except Exception`: KeyboardInterrupt left a .tmp)."""
    path = tmp_path / "train.bin"
    path.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_file(path) as f:
            f.write(b"new, half")
            raise KeyboardInterrupt
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["train.bin"]


# --- checkpoints and resume ------------------------------------------------------------------

def _half_run(tmp_path, **overrides):
    cfg = tiny_config(tmp_path, max_iters=2, eval_interval=2, always_save_checkpoint=True, exact_val=False,
                      tensorboard=False, **overrides)
    train.train(cfg, verbose=False)
    return cfg


def test_resume_may_change_dropout_and_attn_backend_and_the_new_values_apply(tmp_path, monkeypatch):
    """Catches (dropout no longer in RESUME_MAY_CHANGE), (overrides lose to the checkpoint's
    model_config) and (train.py passes no overrides on resume)."""
    cfg = _half_run(tmp_path)  # dropout 0.0, attn_backend manual
    built = []
    real = train.model_from_checkpoint
    monkeypatch.setattr(train, "model_from_checkpoint", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    train.train(cfg.replace(resume=True, max_iters=3, dropout=0.25, attn_backend="sdpa"), verbose=False)
    (model, _), = built
    assert (model.config.dropout, model.config.attn_backend) == (0.25, "sdpa")


def test_a_checkpoint_lacking_a_later_architecture_field_is_not_resumed(tmp_path):
    """Catches (fields missing from an older checkpoint's model_config skipped instead of compared)."""
    cfg = _half_run(tmp_path)
    ckpt = load_checkpoint(tmp_path / "out" / "ckpt.pt")
    del ckpt["model_config"]["qk_norm"]
    corpus = load_corpus(cfg.dataset, cfg.cache_dir)
    with pytest.raises(ValueError, match="qk_norm: checkpoint None vs config False"):
        check_resumable(ckpt, cfg.model_config(corpus.tokenizer.vocab_size), corpus.tokenizer)


def test_a_file_without_our_format_tag_or_without_a_step_is_refused(tmp_path):
    """Catches (format tag not checked) and ('step' not required: a KeyError traceback later)."""
    _half_run(tmp_path)
    ckpt = load_checkpoint(tmp_path / "out" / "ckpt.pt")
    foreign = tmp_path / "foreign.pt"
    torch.save({k: v for k, v in ckpt.items() if k != "format"}, foreign)
    with pytest.raises(ValueError, match="not a checkpoint written by this project"):
        load_checkpoint(foreign)
    stepless = tmp_path / "stepless.pt"
    save_checkpoint(stepless, {k: v for k, v in ckpt.items() if k not in ("format", "step")})
    with pytest.raises(ValueError, match="lacks 'step'"):
        load_checkpoint(stepless)


def test_a_resumed_run_keeps_the_best_val_loss_and_never_saves_a_worse_model(tmp_path):
    """Catches (best_val_loss not restored: the resumed run starts from inf)."""
    cfg = _half_run(tmp_path)
    path = tmp_path / "out" / "ckpt.pt"
    ckpt = load_checkpoint(path)
    save_checkpoint(path, {**{k: v for k, v in ckpt.items() if k != "format"}, "best_val_loss": 0.5})
    summary = train.train(cfg.replace(resume=True, max_iters=4, always_save_checkpoint=False), verbose=False)
    assert summary["best_val_loss"] == 0.5
    assert load_checkpoint(path)["step"] == 2  # no eval beat 0.5, so nothing replaced it


# --- evaluation ------------------------------------------------------------------------------

def test_evaluating_puts_back_eval_mode_too():
    """Catches (evaluating ends with model.train(): an eval-mode model left in training mode)."""
    model = torch.nn.Dropout(0.5).eval()
    with evaluating(model):
        pass
    assert not model.training


def test_losses_come_from_their_own_split_with_the_eval_seed(tmp_path):
    """Catches (estimates seeded with cfg.seed, not cfg.seed + 1), (val estimate drawn from the
    train split) and (the exact val loss computed over the train split)."""
    cfg = tiny_config(tmp_path, max_iters=2, eval_interval=2, always_save_checkpoint=True, tensorboard=False)
    summary = train.train(cfg, verbose=False)
    corpus = load_corpus(cfg.dataset, cfg.cache_dir)
    splits = {"train": torch.from_numpy(corpus.train.astype(np.int32)),
              "val": torch.from_numpy(corpus.val.astype(np.int32))}
    group = max(1, train.EVAL_TOKENS_PER_FORWARD // (cfg.batch_size * cfg.block_size))

    def estimates(model):
        return estimate_loss(model, splits, cfg.batch_size, cfg.block_size, cfg.eval_iters, cfg.seed + 1, "cpu",
                             batches_per_forward=group)

    torch.manual_seed(cfg.seed)
    initial = GPT(cfg.model_config(corpus.tokenizer.vocab_size))
    final, _ = model_from_checkpoint(load_checkpoint(tmp_path / "out" / "ckpt.pt"))  # saved at step 2
    for entry, model in zip(summary["history"], (initial, final), strict=True):
        got = estimates(model)
        assert (entry["train_loss"], entry["val_loss"]) == pytest.approx((got["train"], got["val"]), abs=1e-6)
    exact = exact_loss(final, corpus.val, cfg.block_size, 64, "cpu")
    assert summary["final_val_loss"] == pytest.approx(exact, abs=1e-6)


# --- monitor -----------------------------------------------------------------------------------

def _snapshot(tmp_path, **overrides):
    cfg = tiny_config(tmp_path, **overrides)
    corpus = load_corpus(cfg.dataset, cfg.cache_dir)
    model = GPT(cfg.model_config(corpus.tokenizer.vocab_size))
    log = RunLog(tmp_path / "tb", cfg.max_iters, 0, tensorboard=True)
    return cfg, corpus, model, log


def test_the_text_sample_puts_the_thread_count_back(tmp_path):
    """Catches (set_num_threads(threads) dropped: a CPU run trained on one thread after its first eval)."""
    cfg, corpus, model, log = _snapshot(tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        log.snapshot(0, model, corpus, cfg)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
        log.close()


def test_sample_tokens_zero_writes_no_text_sample(tmp_path, monkeypatch):
    """Catches (`> 0` -> `>= 0`: an empty "sample" every eval although 0 means no sample)."""
    cfg, corpus, model, log = _snapshot(tmp_path, sample_tokens=0)
    texts = []
    monkeypatch.setattr(RunLog, "text", lambda self, step, tag, value: texts.append(tag))
    log.snapshot(0, model, corpus, cfg)
    log.close()
    assert texts == []


def test_a_long_attention_prompt_keeps_its_last_block_size_characters(tmp_path):
    """Catches (the first block_size characters kept instead of the last)."""
    cfg = tiny_config(tmp_path, attention_prompt=TEXT[:40])
    corpus = load_corpus(cfg.dataset, cfg.cache_dir)
    assert resolve_prompts(cfg, corpus)[1] == corpus.tokenizer.encode(TEXT[40 - cfg.block_size:40])


def test_an_interrupted_run_skips_the_exact_val_and_ends_its_session_at_its_last_step(tmp_path, monkeypatch):
    """Catches (the exact val loss computed after a signal) and (hparams at max_iters)."""
    monkeypatch.setattr(faults.RunGuard, "poll",
                        lambda self, step, sync: signal.SIGTERM if step == 1 else None)
    exact_calls, hparams_steps = [], []
    monkeypatch.setattr(train, "exact_loss", lambda *a, **k: exact_calls.append(1) or 1.0)
    monkeypatch.setattr(RunLog, "hparams", lambda self, step, h: hparams_steps.append(step))
    summary = train.train(tiny_config(tmp_path, max_iters=6, tensorboard=False), verbose=False)
    assert (summary["interrupted"], summary["steps"], summary["final_val_loss"]) == ("SIGTERM", 2, None)
    assert exact_calls == [] and hparams_steps == [1]


# --- config ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    (dict(dropout=1.0), "dropout must be in \\[0, 1\\), got 1.0"),
    (dict(min_lr=2e-3, learning_rate=1e-3), "min_lr=0.002 exceeds learning_rate=0.001"),
    (dict(eval_interval=0), "eval_interval must be > 0, got 0"),
    (dict(log_interval=0), "log_interval must be > 0, got 0"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps must be > 0, got 0"),
    (dict(n_layer=True), "n_layer must be int, got True"),
    (dict(learning_rate=True), "learning_rate must be float, got True"),
    (dict(cooldown_frac=1.5), "cooldown_frac must be in \\[0, 1\\], got 1.5"),
    (dict(muon_momentum=-0.1), "muon_momentum must be in \\[0, 1\\], got -0.1"),
    (dict(muon_lr=-0.02), "muon_lr must be >= 0, got -0.02"),
])
def test_each_config_refusal(fields, message):
    """Catches any of these bound or type checks dropped or widened."""
    with pytest.raises(ValueError, match=message):
        TrainConfig(**fields)


def test_min_lr_equal_to_learning_rate_is_a_constant_schedule_and_allowed():
    """Catches (`>` -> `>=` in the min_lr check: min_lr == learning_rate refused)."""
    assert TrainConfig(min_lr=1e-3, learning_rate=1e-3).min_lr == 1e-3


def test_command_line_forms(tmp_path):
    """Catches (a bare --compile not taken as true), (a config file after overrides accepted, so
    it overrode them) and (--bias=1 not read as true)."""
    cfg, _ = parse_args(["--compile", "--n_layer=3", "--bias=1", "--qk_norm=0"])
    assert (cfg.compile, cfg.n_layer, cfg.bias, cfg.qk_norm) == ("true", 3, True, False)
    path = tmp_path / "c.toml"
    path.write_text("n_layer = 2\n")
    with pytest.raises(ValueError, match="only the config file may come without --"):
        parse_args(["--n_layer=5", str(path)])


# --- signals (single process) ----------------------------------------------------------------

def test_handlers_are_not_installed_from_another_thread():
    """Catches (arm() from a non-main thread raised ValueError from signal.signal)."""
    errors = []

    def body():
        try:
            faults.RunGuard(CPU, "ckpt.pt", announce=False).arm()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert errors == []


def test_a_second_sigterm_takes_the_default_action(monkeypatch):
    """Catches (the SIG_DFL branch never re-sent the signal: a second SIGTERM was swallowed)."""
    kills = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        guard = faults.RunGuard(CPU, "ckpt.pt", announce=False)
        guard.arm()
        signal.raise_signal(signal.SIGTERM)
        assert guard.signum == signal.SIGTERM and kills == []
        signal.raise_signal(signal.SIGTERM)
        assert kills == [(faults.os.getpid(), signal.SIGTERM)]
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # our handler is gone
    finally:
        signal.signal(signal.SIGTERM, previous)
