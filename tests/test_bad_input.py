"""Bad input -> a clear error naming the problem, before any training, with out_dir left as it was.

Every test here runs the real entry points (train.main, sample.main) in-process, and checks two
things: the message names what is wrong, and out_dir is unchanged (the same files, sizes and
mtimes; or still absent when it was absent). test_a_good_run_writes_out_dir is the positive control:
the same harness does see a run's writes.
"""

from __future__ import annotations

import ast
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

import sample
import train
from data import CharTokenizer
from model import GPTConfig
from training import CKPT_NAME, TrainConfig, load_checkpoint
from training.checkpoint import FORMAT

ROOT = Path(__file__).resolve().parent.parent
PANGRAMS = (  # the text of conftest's corpus_file, for the module-scoped run below
    "The quick brown fox jumps over the lazy dog.\n"
    "Pack my box with five dozen liquor jugs!\n"
    "How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow?\n"
)


def snapshot(out_dir: Path) -> dict[str, tuple[int, int]] | None:
    """Every path under out_dir with its size and mtime; None when out_dir does not exist."""
    if not out_dir.exists():
        return None
    return {str(p.relative_to(out_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(out_dir.rglob("*"))} | {".": (0, out_dir.stat().st_mtime_ns)}


def tiny_args(dataset: Path, out_dir: Path, cache: Path) -> list[str]:
    return [f"--dataset={dataset}", f"--out_dir={out_dir}", f"--cache_dir={cache}", "--device=cpu",
            "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--dropout=0", "--batch_size=4",
            "--max_iters=4", "--eval_interval=2", "--eval_iters=1", "--tensorboard=false", "--exact_val=false"]


def run_train(capsys, *argv: str) -> tuple[int, str]:
    rc = train.main(list(argv))
    return rc, capsys.readouterr().err


def run_sample(capsys, *argv: str) -> tuple[int, str]:
    rc = sample.main(["--device=cpu", "--max_new_tokens=5", *argv])
    return rc, capsys.readouterr().err


def assert_refused(rc: int, err: str, out_dir: Path, before, *needles: str) -> None:
    assert rc == 1, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in: {err}"
    assert snapshot(out_dir) == before, "out_dir changed"


@pytest.fixture
def paths(tmp_path, corpus_file):
    return corpus_file, tmp_path / "out", tmp_path / "cache"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A trained out_dir (ckpt.pt, config.json, summary.json) from the corpus below; copy before use."""
    tmp = tmp_path_factory.mktemp("finished")
    corpus = tmp / "corpus.txt"
    corpus.write_text(PANGRAMS * 120, encoding="utf-8")
    assert train.main(tiny_args(corpus, tmp / "out", tmp / "cache")) == 0
    return corpus, tmp / "out", tmp / "cache"


@pytest.fixture
def run_dir(finished_run, tmp_path):
    """A private copy of the finished run: (corpus, out_dir, cache_dir)."""
    corpus, out, cache = finished_run
    shutil.copytree(out, tmp_path / "out")
    return corpus, tmp_path / "out", cache


# --- the positive control --------------------------------------------------------------------

def test_a_good_run_writes_out_dir(paths, capsys):
    corpus, out, cache = paths
    assert snapshot(out) is None
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache))
    assert rc == 0, err
    assert {"ckpt.pt", "config.json", "summary.json"} <= set(snapshot(out))


# --- the corpus ------------------------------------------------------------------------------

def test_empty_corpus_is_refused(paths, capsys):
    corpus, out, cache = paths
    corpus.write_text("", encoding="utf-8")
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache))
    assert_refused(rc, err, out, None, f"corpus {corpus} is empty")


@pytest.mark.parametrize("length, split, size", [(12, "train", 10), (100, "val", 10)])
def test_corpus_too_short_for_one_block_names_the_split_its_size_and_the_need(paths, capsys, length, split, size):
    corpus, out, cache = paths
    corpus.write_text(("abcdefghij" * 10)[:length], encoding="utf-8")
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache))  # block_size=16 needs 17 tokens
    assert_refused(rc, err, out, None, f"the {split} split of {corpus} has {size} tokens",
                   "block_size=16 needs at least 17", "Use a longer corpus")


def test_non_utf8_corpus_names_the_byte_offset(paths, capsys):
    corpus, out, cache = paths
    corpus.write_bytes(PANGRAMS.encode() * 10 + b"caf\xe9")
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache))
    assert_refused(rc, err, out, None, "is not UTF-8", "invalid byte 0xe9",
                   f"byte offset {len(PANGRAMS.encode()) * 10 + 3}")


def test_more_distinct_symbols_than_uint16_holds_is_refused_before_encoding(paths, capsys, monkeypatch):
    corpus, out, cache = paths
    corpus.write_text("".join(chr(0x10000 + i) for i in range(65_537)), encoding="utf-8")  # all valid UTF-8

    def no_encoding(*args, **kwargs):
        raise AssertionError("the symbol count must be checked before any encoding")

    monkeypatch.setattr(CharTokenizer, "encode_array", no_encoding)
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache))
    assert_refused(rc, err, out, None, "has 65,537 distinct characters", "uint16 holds at most 65,536")


# --- the config ------------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("--n_layers=2", "unknown config key 'n_layers'; valid keys: dataset,"),
    ("--n_layer=two", "config key n_layer: 'two' is not a valid int"),
    ("--bias=maybe", "config key bias: 'maybe' is not a valid bool"),
    ("--n_embd=15", "n_embd=15 must be divisible by n_head=2"),
    ("--block_size=0", "block_size must be > 0, got 0"),
    ("--n_layer=-1", "n_layer must be > 0, got -1"),
    ("--batch_size=0", "batch_size must be > 0, got 0"),
    ("--max_iters=0", "max_iters must be > 0, got 0"),
    ("--learning_rate=0", "learning_rate must be > 0, got 0.0"),
    ("--learning_rate=-0.001", "learning_rate must be > 0, got -0.001"),
    ("--eval_iters=-5", "eval_iters must be > 0, got -5"),
    ("--warmup_iters=-1", "warmup_iters must be >= 0, got -1"),
    ("--learning_rate=nan", "learning_rate must be a finite number, got nan"),
    ("--grad_clip=inf", "grad_clip must be a finite number, got inf"),
    ("--beta1=1.5", "beta1 must be in [0, 1), got 1.5"),
    ("--beta2=-1", "beta2 must be in [0, 1), got -1.0"),
    ("--seed=-1", "seed must be in [0, 2**62], got -1"),
    ("--seed=18446744073709551615", "seed must be in [0, 2**62], got 18446744073709551615"),
    ("--device=cuda:x", "device='cuda:x' is not one of auto, cpu, cuda, cuda:N, mps"),
    ("--device=bogus", "device='bogus' is not one of"),
    ("--split=validation", "split='validation' applies to hf: datasets only"),
    ("--text_column=body", "text_column='body' applies to hf: datasets only"),
])
def test_bad_config_value_names_the_key(paths, capsys, override, message):
    corpus, out, cache = paths
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache), override)
    assert_refused(rc, err, out, None, message)


def test_unknown_or_ill_typed_key_in_a_toml_file_names_it(paths, capsys, tmp_path):
    corpus, out, cache = paths
    for text, message in (("lerning_rate = 0.1\n", "unknown config key 'lerning_rate'"),
                          ('bias = "yes"\n', "config field bias must be bool, got 'yes'")):
        toml = tmp_path / "bad.toml"
        toml.write_text(text)
        rc, err = run_train(capsys, str(toml), *tiny_args(corpus, out, cache))
        assert_refused(rc, err, out, None, message)


@pytest.mark.parametrize("field", ["sample_prompt", "attention_prompt"])
def test_a_tensorboard_prompt_outside_the_vocabulary_is_refused_before_out_dir_is_touched(run_dir, capsys, field):
    """Checked with the corpus, before config.json or the TensorBoard events of an old run are rewritten."""
    corpus, out, cache = run_dir
    before = snapshot(out)
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache), "--tensorboard=true", f"--{field}=The €")
    assert_refused(rc, err, out, before, f"config field {field}='The €'", "'€'")


def test_under_torchrun_a_config_error_is_printed_once_per_node(paths, capsys, monkeypatch):
    """Every rank parses the same argv: N copies of one error line would only bury it."""
    corpus, out, cache = paths
    monkeypatch.setenv("RANK", "1")  # set alone, as cluster tools do outside torchrun: still printed
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache), "--n_layers=2")
    assert rc == 1 and "unknown config key 'n_layers'" in err
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's full set: once per node, by local rank 0
    for local_rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        rc, err = run_train(capsys, *tiny_args(corpus, out, cache), "--n_layers=2")
        assert rc == 1 and ("unknown config key 'n_layers'" in err) == printed, (local_rank, err)


def test_a_fresh_run_over_an_earlier_checkpoint_says_it_will_replace_it(run_dir, capsys):
    corpus, out, cache = run_dir
    assert train.main(tiny_args(corpus, out, cache)) == 0
    captured = capsys.readouterr()
    assert f"note: {out / CKPT_NAME} is from an earlier run" in captured.out + captured.err
    assert train.main([*tiny_args(corpus, out, cache), "--resume", "--max_iters=6"]) == 0  # resuming: no note
    captured = capsys.readouterr()
    assert "is from an earlier run" not in captured.out + captured.err


def test_cuda_device_without_cuda_is_refused(paths, capsys, monkeypatch):
    corpus, out, cache = paths
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a machine with a GPU
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache), "--device=cuda")
    assert_refused(rc, err, out, None, "device='cuda' but CUDA is not available", "--device=cpu")


# --- --resume --------------------------------------------------------------------------------

def test_resume_without_out_dir_names_the_missing_directory(paths, capsys):
    corpus, out, cache = paths
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache), "--resume")
    assert_refused(rc, err, out, None, f"the directory {out} does not exist")


def test_resume_without_a_checkpoint_names_it(paths, capsys):
    corpus, out, cache = paths
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    before = snapshot(out)
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache), "--resume")
    assert_refused(rc, err, out, before, f"no checkpoint at {out / CKPT_NAME}",
                   "without --resume the run starts afresh")


@pytest.mark.parametrize("override, message", [
    ("--n_layer=2", "n_layer: checkpoint 1 vs config 2"),
    ("--n_embd=32", "n_embd: checkpoint 16 vs config 32"),
    ("--block_size=8", "block_size: checkpoint 16 vs config 8"),
    ("--pos_emb=rope", "pos_emb: checkpoint 'learned' vs config 'rope'"),
    ("--qk_norm", "qk_norm: checkpoint False vs config True"),
])
def test_resume_from_another_architecture_names_the_fields(run_dir, capsys, override, message):
    corpus, out, cache = run_dir
    before = snapshot(out)
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache), "--resume", "--max_iters=6", override)
    assert_refused(rc, err, out, before, "cannot resume: the checkpoint's architecture differs", message)


def test_resume_from_another_vocabulary_names_the_characters(run_dir, capsys, tmp_path):
    corpus, out, cache = run_dir
    other = tmp_path / "other.txt"
    other.write_text(PANGRAMS.replace("z", "Z") * 120, encoding="utf-8")
    before = snapshot(out)
    rc, err = run_train(capsys, *tiny_args(other, out, cache), "--resume", "--max_iters=6")
    assert_refused(rc, err, out, before, "cannot resume: the checkpoint was trained on another vocabulary",
                   "only in the checkpoint: 'z'", "only in the corpus: 'Z'")


def test_resume_of_a_finished_run_is_refused_and_keeps_its_summary(run_dir, capsys):
    """A checkpoint at max_iters with its summary written: nothing left to train, and a resume would
    overwrite summary.json with a run of 0 steps. Without the summary (killed before writing it) the
    same resume goes ahead and writes it: the positive control."""
    corpus, out, cache = run_dir  # its checkpoint is at step 4 = max_iters
    before = snapshot(out)
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache), "--resume")
    assert_refused(rc, err, out, before, "is at step 4 = max_iters: the run is finished",
                   f"{out / 'summary.json'}", "--max_iters > 4")
    (out / "summary.json").unlink()
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache), "--resume")
    assert rc == 0, err
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def test_config_that_is_not_a_readable_file_is_one_line(paths, capsys):
    corpus, out, cache = paths
    rc, err = run_train(capsys, str(corpus.parent), *tiny_args(corpus, out, cache))
    assert_refused(rc, err, out, None, f"config file {corpus.parent}: cannot read it", "configs/debug.toml")


def test_out_dir_that_is_a_file_is_named(paths, capsys, tmp_path):
    corpus, _, cache = paths
    taken = tmp_path / "taken"
    taken.write_text("a file, not a run directory")
    rc, err = run_train(capsys, *tiny_args(corpus, taken, cache))
    assert rc == 1 and f"out_dir={taken}: cannot create it as a directory" in err, err
    assert taken.read_text() == "a file, not a run directory"


def test_resume_past_max_iters_names_both_steps(run_dir, capsys):
    corpus, out, cache = run_dir  # its checkpoint is at step 4
    before = snapshot(out)
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache), "--resume", "--max_iters=3")
    assert_refused(rc, err, out, before, "is at step 4, past max_iters=3", "--max_iters > 4")


def test_resume_continues_from_a_good_checkpoint(run_dir, capsys):
    """The control for the resume refusals: the same copy resumes when nothing is wrong."""
    corpus, out, cache = run_dir
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache), "--resume", "--max_iters=6")
    assert rc == 0, err
    assert load_checkpoint(out / CKPT_NAME)["step"] == 6


# --- damaged and foreign checkpoints, for --resume and for sample.py --------------------------

def _largest_record_data_offset(path: Path) -> int:
    """Byte offset of the middle of the largest record's data (a tensor's bytes) in a checkpoint."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = path.read_bytes()
    name_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    return info.header_offset + 30 + name_len + extra_len + info.file_size // 2


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_weight_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[_largest_record_data_offset(path)] ^= 0xFF
    path.write_bytes(bytes(raw))


def tensor_only(path: Path) -> None:
    torch.save(torch.zeros(3), path)


def text_file(path: Path) -> None:
    path.write_text("this is not a checkpoint\n")


DAMAGE = [
    (truncate, "is not a checkpoint: not a complete PyTorch archive (truncated"),
    (flip_a_weight_byte, "is corrupt: record"),
    (tensor_only, "is not a checkpoint written by this project"),
    (text_file, "is not a checkpoint: not a complete PyTorch archive"),
]


@pytest.mark.parametrize("damage, message", DAMAGE, ids=[d.__name__ for d, _ in DAMAGE])
def test_damaged_or_foreign_checkpoint_is_refused_by_resume_and_sample(run_dir, capsys, damage, message):
    corpus, out, cache = run_dir
    damage(out / CKPT_NAME)
    before = snapshot(out)
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache), "--resume", "--max_iters=6")
    assert_refused(rc, err, out, before, message)
    rc, err = run_sample(capsys, f"--out_dir={out}")
    assert_refused(rc, err, out, before, message)


def test_sample_given_a_run_directory_as_ckpt_says_so(run_dir, capsys):
    """--ckpt=OUT_DIR (a directory) is an easy slip for --out_dir=OUT_DIR: the error says which it is."""
    _, out, _ = run_dir
    before = snapshot(out)
    rc, err = run_sample(capsys, f"--ckpt={out}")
    assert_refused(rc, err, out, before, f"{out} is a directory, not a checkpoint file")


def test_a_flipped_weight_byte_would_load_silently_without_the_crc_check(run_dir):
    """Why load_checkpoint checks CRCs: torch.load itself returns the wrong number without a word."""
    _, out, _ = run_dir
    good = torch.load(out / CKPT_NAME, weights_only=True)
    flip_a_weight_byte(out / CKPT_NAME)
    bad = torch.load(out / CKPT_NAME, weights_only=True)
    def tensors(x) -> list[torch.Tensor]:  # every tensor in the checkpoint (the flipped byte is in one)
        if isinstance(x, dict):
            return [t for v in x.values() for t in tensors(v)]
        return [x] if isinstance(x, torch.Tensor) else []

    assert any(not torch.equal(a, b) for a, b in zip(tensors(good), tensors(bad), strict=True))
    with pytest.raises(ValueError, match="is corrupt"):
        load_checkpoint(out / CKPT_NAME)


def _rewrite(path: Path, **changes) -> None:
    """Re-save a checkpoint with some entries changed (through torch.save, with valid CRCs)."""
    ckpt = torch.load(path, weights_only=True)
    torch.save({**ckpt, **changes}, path)


def test_sample_refuses_a_checkpoint_whose_weights_contradict_its_architecture(run_dir, capsys):
    _, out, _ = run_dir
    config = load_checkpoint(out / CKPT_NAME)["model_config"]
    _rewrite(out / CKPT_NAME, model_config={**config, "n_layer": 2})
    before = snapshot(out)
    rc, err = run_sample(capsys, f"--out_dir={out}")
    assert_refused(rc, err, out, before, "checkpoint weights do not match its architecture", "blocks.1")


def test_sample_refuses_a_checkpoint_whose_vocabulary_contradicts_its_vocab_size(run_dir, capsys):
    _, out, _ = run_dir
    chars = load_checkpoint(out / CKPT_NAME)["vocab"]["chars"]
    _rewrite(out / CKPT_NAME, vocab={"chars": chars + ["~"]})
    before = snapshot(out)
    rc, err = run_sample(capsys, f"--out_dir={out}")
    n = len(chars)
    assert_refused(rc, err, out, before, f"checkpoint vocab_size {n} != its vocabulary's {n + 1}")


# --- sample.py's own inputs ------------------------------------------------------------------

def test_sample_without_out_dir_names_the_missing_directory(tmp_path, capsys):
    rc, err = run_sample(capsys, f"--out_dir={tmp_path / 'nowhere'}")
    assert_refused(rc, err, tmp_path / "nowhere", None, f"the directory {tmp_path / 'nowhere'} does not exist")


def test_sample_prompt_characters_outside_the_vocabulary_are_named(run_dir, capsys):
    _, out, _ = run_dir
    before = snapshot(out)
    rc, err = run_sample(capsys, f"--out_dir={out}", "--prompt=The €uro fell 5%")  # '5' occurs nowhere
    assert_refused(rc, err, out, before, "prompt: characters not in the vocabulary", "'%'", "'5'", "'€'")
    assert "'T'" not in err


@pytest.mark.parametrize("option, message", [
    ("--max_new_tokens=-1", "--max_new_tokens must be >= 0, got -1"),
    ("--num_samples=0", "--num_samples must be >= 1, got 0"),
    ("--temperature=-0.5", "--temperature must be a finite number >= 0"),
    ("--temperature=nan", "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
    ("--temperature=inf", "--temperature must be a finite number >= 0 (0 = greedy), got inf"),
    ("--top_p=nan", "--top_p must be in (0, 1]"),
    ("--seed=-5", "--seed must be in [0, 2**62], got -5"),
    ("--device=cuda:x", "device='cuda:x' is not a device name"),
    ("--top_k=-3", "--top_k must be >= 0"),
    ("--top_p=0", "--top_p must be in (0, 1]"),
    ("--device=cuda", "device='cuda' but CUDA is not available"),
])
def test_sample_refuses_bad_options_before_generating(run_dir, capsys, monkeypatch, option, message):
    _, out, _ = run_dir
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = snapshot(out)
    rc = sample.main([f"--out_dir={out}", "--prompt=The", option])
    captured = capsys.readouterr()
    assert_refused(rc, captured.err, out, before, message)
    assert captured.out == ""  # refused before anything was generated


def test_sample_refuses_two_prompts_and_names_an_unwritable_png(run_dir, capsys, tmp_path):
    """--prompt with --prompt_file used to take the file silently; a PNG path under a file gave a
    traceback. Each is now one line; the same options one at a time work (the positive control)."""
    _, out, _ = run_dir
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the", encoding="utf-8")
    rc, err = run_sample(capsys, f"--out_dir={out}", "--prompt=a", f"--prompt_file={prompt}")
    assert rc == 1 and "error: give the prompt as --prompt or as --prompt_file, not both" in err, err
    assert run_sample(capsys, f"--out_dir={out}", f"--prompt_file={prompt}")[0] == 0
    png = prompt / "attention.png"  # under a file: no folder can be made there
    rc, err = run_sample(capsys, f"--out_dir={out}", "--prompt=the", f"--attention_png={png}")
    assert rc == 1 and f"error: --attention_png: cannot write {png}" in err, err
    assert run_sample(capsys, f"--out_dir={out}", "--prompt=the", f"--attention_png={tmp_path / 'a.png'}")[0] == 0


def test_sample_non_utf8_or_missing_prompt_file_is_named(run_dir, capsys, tmp_path):
    _, out, _ = run_dir
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"The \xff")
    rc, err = run_sample(capsys, f"--out_dir={out}", f"--prompt_file={bad}")
    assert rc == 1 and "invalid byte 0xff at byte offset 4" in err
    rc, err = run_sample(capsys, f"--out_dir={out}", f"--prompt_file={tmp_path / 'none.txt'}")
    assert rc == 1 and "cannot read" in err and "none.txt" in err


def test_a_prompt_longer_than_the_position_table_is_fine(run_dir, capsys):
    """No limit where none is needed: generation reads only the last block_size (16) tokens."""
    _, out, _ = run_dir
    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # 135 characters
    rc = sample.main(["--device=cpu", f"--out_dir={out}", f"--prompt={prompt}", "--max_new_tokens=40"])
    text = capsys.readouterr().out
    assert rc == 0
    assert text.startswith(prompt) and len(text.rstrip("\n")) == len(prompt) + 40


# --- nothing let in: no code from a file ever runs -------------------------------------------

class WritesMarker:
    """Unpickling this calls open(marker, 'w'): the file's existence shows that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_checkpoint_carrying_a_pickled_object_is_refused_and_its_code_never_runs(run_dir, capsys, tmp_path):
    corpus, out, cache = run_dir
    marker = tmp_path / "code_ran"
    ckpt = torch.load(out / CKPT_NAME, weights_only=True)
    torch.save({**ckpt, "vocab": WritesMarker(marker)}, out / CKPT_NAME)
    with pytest.raises(ValueError, match="holds pickled objects other than tensors and plain data; refused"):
        load_checkpoint(out / CKPT_NAME)
    before = snapshot(out)
    rc, err = run_train(capsys, *tiny_args(corpus, out, cache), "--resume", "--max_iters=6")
    assert_refused(rc, err, out, before, "refused")
    rc, err = run_sample(capsys, f"--out_dir={out}")
    assert_refused(rc, err, out, before, "refused")
    assert not marker.exists()
    # positive control: the payload is armed; a plain unpickler runs it
    torch.load(out / CKPT_NAME, weights_only=False)
    assert marker.exists()


def test_checkpoint_carrying_a_dataclass_instance_is_refused(run_dir):
    _, out, _ = run_dir
    ckpt = torch.load(out / CKPT_NAME, weights_only=True)
    torch.save({**ckpt, "model_config": GPTConfig(**ckpt["model_config"])}, out / CKPT_NAME)
    with pytest.raises(ValueError, match="refused"):
        load_checkpoint(out / CKPT_NAME)


def test_checkpoint_config_and_vocabulary_are_plain_data(finished_run):
    _, out, _ = finished_run
    ckpt = load_checkpoint(out / CKPT_NAME)
    assert ckpt["format"] == FORMAT

    def plain(x) -> bool:
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, list | tuple):
            return all(plain(v) for v in x)
        return x is None or isinstance(x, bool | int | float | str)

    for key in ("model_config", "config", "vocab", "step", "best_val_loss"):
        assert plain(ckpt[key]), key
    assert TrainConfig(**ckpt["config"]).out_dir == str(out)  # and it is a whole config


def test_every_torch_load_in_the_repository_passes_weights_only_true():
    calls = []
    for path in ROOT.rglob("*.py"):
        if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                calls.append((f"{path.relative_to(ROOT)}:{node.lineno}", safe))
    assert any(where.startswith("training/checkpoint.py") and safe for where, safe in calls)
    # the one deliberate weights_only=False: the positive control of the pickled-object test above
    # (so the scan also shows it can see an unsafe call)
    unsafe = [where for where, safe in calls if not safe]
    assert len(unsafe) == 1 and unsafe[0].startswith("tests/test_bad_input.py"), unsafe


def test_a_config_file_is_parsed_as_toml_never_executed(tmp_path, capsys):
    marker = tmp_path / "code_ran"
    toml = tmp_path / "evil.toml"
    toml.write_text(f"open({str(marker)!r}, 'w')\n")
    rc, err = run_train(capsys, str(toml))
    assert rc == 1 and "is not valid TOML" in err
    assert not marker.exists()

