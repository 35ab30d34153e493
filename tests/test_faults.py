"""Faults: SIGINT/SIGTERM, SIGKILL during saves, a non-finite loss, a full disk.

Signals and kills go to real, separate processes: `python train.py` for the end-to-end signal test,
and, where a test needs many processes (20+ kills) or to tamper with one from inside, a fork of this
test process running train.main (torch is already imported, so a child starts in milliseconds instead
of the ~2 s a fresh interpreter takes on a 2-core machine).
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_runs import tiny_config

import train
from model import GPT
from training import CKPT_NAME, load_checkpoint
from training.faults import RunGuard

ROOT = Path(__file__).resolve().parent.parent
FORK = multiprocessing.get_context("fork")
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n" * 200


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def args(corpus: Path, out: Path, *extra: str) -> list[str]:
    """A tiny CPU run that never ends on its own (tests stop it or set max_iters)."""
    return [f"--dataset={corpus}", f"--out_dir={out}", f"--cache_dir={corpus.parent / 'cache'}", "--device=cpu",
            "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--dropout=0", "--batch_size=4",
            "--max_iters=100000", "--warmup_iters=2", "--lr_decay_iters=100000", "--eval_interval=100000",
            "--eval_iters=1", "--log_interval=1", "--tensorboard=false", "--exact_val=false", *extra]


def temp_files(out: Path) -> set[str]:
    return {p.name for p in out.glob(f".{CKPT_NAME}.*.tmp")} if out.exists() else set()


def identity(path: Path) -> tuple[int, int]:
    """(inode, mtime): changes when a save renames a new file over path."""
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def wait_for(condition, timeout: float = 30.0, what: str = "", log: Path | None = None) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}" + (f"; log:\n{log.read_text()}" if log else ""))
        time.sleep(0.001)


def _child(argv: list[str], log: str, setup=None) -> None:
    """Body of a forked training process: output to `log`, optional tampering, then train.main."""
    f = open(log, "w", buffering=1)
    os.dup2(f.fileno(), 1)
    os.dup2(f.fileno(), 2)
    sys.stdout = sys.stderr = f
    if setup is not None:
        setup()
    sys.exit(train.main(argv))


def fork_train(argv: list[str], log: Path, setup=None) -> multiprocessing.Process:
    proc = FORK.Process(target=_child, args=(argv, str(log), setup))
    proc.start()
    return proc


# --- SIGINT / SIGTERM ------------------------------------------------------------------------

def test_signal_handlers_note_the_first_signal_and_hand_the_second_to_the_previous_handler():
    calls = []
    previous = signal.signal(signal.SIGINT, lambda s, f: calls.append(s))
    try:
        guard = RunGuard(torch.device("cpu"), "ckpt.pt", announce=False)
        guard.arm()
        os.kill(os.getpid(), signal.SIGINT)
        assert guard.signum == signal.SIGINT and calls == []  # noted, nothing else
        assert guard.poll(step=3, sync=False) == signal.SIGINT
        os.kill(os.getpid(), signal.SIGINT)
        assert calls == [signal.SIGINT]  # the second one acts as it would have without train()
        assert signal.getsignal(signal.SIGINT) is not guard._on_signal
        guard.disarm()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_train_restores_the_previous_signal_handlers_however_it_ends(corpus, tmp_path, monkeypatch):
    def mine(s, f):
        raise AssertionError("the test's handler must not run")

    previous = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert train.main(args(corpus, tmp_path / "out", "--max_iters=3")) == 0
        assert all(signal.getsignal(s) is mine for s in previous)
        monkeypatch.setattr(GPT, "forward", _forward_poisoned_at(1, float("nan")))
        assert train.main(args(corpus, tmp_path / "out2", "--max_iters=3")) == 1  # FloatingPointError
        assert all(signal.getsignal(s) is mine for s in previous)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_at_the_end_of_a_step_saves_and_resume_continues_exactly(corpus, tmp_path, sig, code):
    """`python train.py` gets the signal mid-run: it saves the state after the step it was in, writes
    summary.json marked interrupted, says so, and exits 128 + signal. Resuming from that checkpoint
    then gives bit-identical weights to a run that was never interrupted."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "train.py", *args(corpus, out, "--always_save_checkpoint")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in proc.stdout:
        if line.startswith("step") and "|" in line and int(line.split()[1]) >= 5:
            proc.send_signal(sig)
            break
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    name = signal.Signals(sig).name
    assert f"received {name}: stopping at the end of this step" in stderr
    summary = json.loads((out / "summary.json").read_text())
    n = summary["steps"]
    assert summary["interrupted"] == name and n >= 6 and summary["final_val_loss"] is None
    assert f"interrupted by {name} after step {n - 1}: saved {out / CKPT_NAME} at step {n}" in stdout
    ckpt = load_checkpoint(out / CKPT_NAME)
    assert ckpt["step"] == n and ckpt["interrupted"] == name

    assert train.main(args(corpus, out, "--always_save_checkpoint", "--resume", f"--max_iters={n + 3}")) == 0
    reference = tmp_path / "reference"
    assert train.main(args(corpus, reference, "--always_save_checkpoint", f"--max_iters={n + 3}")) == 0
    resumed, straight = load_checkpoint(out / CKPT_NAME), load_checkpoint(reference / CKPT_NAME)
    assert resumed["step"] == straight["step"] == n + 3
    for key, value in straight["model"].items():
        assert torch.equal(resumed["model"][key], value), key


def test_the_printed_summary_is_strict_json_when_a_figure_is_missing(corpus, tmp_path, monkeypatch, capsys):
    """A resumed run stopped before its first eval has no val estimate of its own (NaN inside):
    summary.json writes null, and so must the printed summary line, which said NaN (strict JSON
    readers refuse it). The signal comes from inside a training forward, in this process."""
    out = tmp_path / "out"
    forward, calls = GPT.forward, []

    def interrupting_forward(self, *a, **k):
        if self.training:
            calls.append(1)
            if len(calls) in (3, 4):  # step 2 of the first run; step 3, the first of the resumed one
                os.kill(os.getpid(), signal.SIGINT)
        return forward(self, *a, **k)

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    monkeypatch.setattr(GPT, "forward", interrupting_forward)
    assert train.main(args(corpus, out)) == 130
    assert load_checkpoint(out / CKPT_NAME)["step"] == 3
    capsys.readouterr()
    assert train.main(args(corpus, out, "--resume")) == 130
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("summary: "))
    printed = json.loads(line.removeprefix("summary: "), parse_constant=refuse)
    written = json.loads((out / "summary.json").read_text(), parse_constant=refuse)
    assert printed["last_val_estimate"] is None and printed["steps"] == 4
    assert printed == {k: v for k, v in written.items() if k != "history"}


def test_a_second_ctrl_c_exits_at_once_leaving_the_last_checkpoint(corpus, tmp_path):
    """The first SIGINT starts the final save, which is made to hang; the second ends the process
    at once, and the temporary file of the abandoned save is removed on the way out."""
    out = tmp_path / "out"
    log = tmp_path / "log.txt"
    proc = fork_train(args(corpus, out, "--always_save_checkpoint", "--eval_interval=2"), log, _hang_final_save)
    wait_for(lambda: (out / CKPT_NAME).exists() and "step      3 |" in log.read_text(), what="a first save", log=log)
    os.kill(proc.pid, signal.SIGINT)
    wait_for(lambda: "HANGING IN SAVE" in log.read_text(), what="the final save", log=log)
    saved_before = (out / CKPT_NAME).read_bytes()
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    # "at once" = long before the 60 s the save hangs for; generous, as a loaded CI machine can take
    # seconds to tear the process down (5 s was exceeded under load)
    proc.join(timeout=40)
    assert proc.exitcode == 130 and time.monotonic() - t0 < 30, log.read_text()
    assert "interrupted: exited at once without saving" in log.read_text()
    assert (out / CKPT_NAME).read_bytes() == saved_before and temp_files(out) == set()
    assert not (out / "summary.json").exists()


def _hang_final_save() -> None:
    real_save = torch.save

    def save(obj, f, *a, **k):
        if isinstance(obj, dict) and "interrupted" in obj:
            f.write(b"partial")
            print("HANGING IN SAVE", flush=True)
            time.sleep(60)
        return real_save(obj, f, *a, **k)

    torch.save = save


# --- SIGKILL at random moments during saves ---------------------------------------------------

KILLS = 24


def test_sigkill_during_saves_always_leaves_a_checkpoint_that_loads_and_resumes(corpus, tmp_path):
    """A training process that saves a ~5 MB checkpoint at every step is SIGKILLed KILLS times, each
    time at a random moment (0-30 ms) after a save was seen starting, and restarted with --resume.
    After every kill ckpt.pt loads and the next process resumes from exactly its step; temporary files
    of torn saves are removed when the next run starts. The count of kills that did tear a save (a
    temporary file left behind) shows the kills landed inside saves."""
    out = tmp_path / "out"
    ckpt_path = out / CKPT_NAME
    base = args(corpus, out, "--n_layer=2", "--n_head=4", "--n_embd=128", "--block_size=32",
                "--eval_interval=1", "--always_save_checkpoint", "--log_interval=100000")
    rng = random.Random(0)
    torn, step = 0, 0
    for kill in range(KILLS):
        log = tmp_path / f"log{kill}.txt"
        leftovers = temp_files(out)
        proc = fork_train(base + (["--resume"] if kill else []), log)
        if kill == 0:
            wait_for(ckpt_path.exists, what="the first checkpoint")
        last = identity(ckpt_path)
        wait_for(lambda leftovers=leftovers, last=last: temp_files(out) - leftovers or identity(ckpt_path) != last,
                 what=f"a save to start (kill {kill})", log=log)
        time.sleep(rng.uniform(0, 0.03))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        torn += bool(temp_files(out) - leftovers)
        if kill:
            assert f"resumed at step {step}" in log.read_text()
        ckpt = load_checkpoint(ckpt_path)  # raises if the kill left a bad checkpoint
        assert ckpt["step"] >= step
        step = ckpt["step"]
    print(f"{KILLS} kills, {torn} inside a save; last checkpoint at step {step}")
    assert torn >= 1, "no kill landed inside a save: the test did not test what it says"
    assert train.main(base + ["--resume", f"--max_iters={step + 2}"]) == 0
    assert load_checkpoint(ckpt_path)["step"] == step + 2
    assert temp_files(out) == set()


# --- a non-finite loss -----------------------------------------------------------------------

def _forward_poisoned_at(call: int, value: float):
    """GPT.forward whose `call`-th training forward (1-based) returns loss * value (nan or inf)."""
    real_forward = GPT.forward
    count = [0]

    def forward(self, idx, targets=None, cache=None):
        logits, loss = real_forward(self, idx, targets, cache)
        if self.training and targets is not None:
            count[0] += 1
            if count[0] == call:
                loss = loss * value
        return logits, loss

    return forward


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("caught_at", ["save", "log"])
def test_non_finite_loss_stops_naming_its_step_and_leaves_the_last_checkpoint_untouched(
        corpus, tmp_path, monkeypatch, capsys, value, caught_at):
    """Steps 0-4 run and save; the loss of step 7 is made non-finite. The run stops naming step 7,
    whether the next thing to happen is a save (always_save_checkpoint at the eval of step 10, before
    the log step) or the log step 10; ckpt.pt stays the step-5 file, byte for byte."""
    out = tmp_path / "out"
    assert train.main(args(corpus, out, "--max_iters=5", "--always_save_checkpoint", "--eval_interval=5")) == 0
    good = (out / CKPT_NAME).read_bytes()
    assert load_checkpoint(out / CKPT_NAME)["step"] == 5
    capsys.readouterr()
    monkeypatch.setattr(GPT, "forward", _forward_poisoned_at(7 - 5 + 1, value))  # resumed at step 5
    extra = ["--eval_interval=5", "--always_save_checkpoint"] if caught_at == "save" else ["--eval_interval=1000"]
    rc = train.main(args(corpus, out, "--resume", "--max_iters=20", "--log_interval=5", *extra))
    err = capsys.readouterr().err
    assert rc == 1
    assert f"loss is {value} at step 7; stopped without saving anything from that step on" in err
    assert f"{out / CKPT_NAME} is untouched" in err
    assert (out / CKPT_NAME).read_bytes() == good


def test_a_non_finite_loss_before_any_save_says_no_checkpoint_was_written(corpus, tmp_path, monkeypatch, capsys):
    """A fresh float32 run that goes nan at step 2, before its first checkpoint: the message must not
    claim a ckpt.pt is 'untouched' when there is none, nor suggest leaving float16 it never used."""
    out = tmp_path / "out"
    monkeypatch.setattr(GPT, "forward", _forward_poisoned_at(3, float("nan")))  # call 3 = step 2
    assert train.main(args(corpus, out, "--max_iters=20", "--log_interval=5", "--dtype=float32")) == 1
    err = capsys.readouterr().err
    assert "loss is nan at step 2" in err
    assert f"no checkpoint was written ({out / CKPT_NAME} does not exist)" in err
    assert "untouched" not in err and "float16" not in err
    assert not (out / CKPT_NAME).exists()


def test_a_non_finite_loss_reaching_an_eval_before_a_log_step_is_named_not_a_traceback(
        corpus, tmp_path, monkeypatch, capsys):
    """Step 7's loss is nan; the eval of step 8 comes before the log step 10 and would draw the
    TensorBoard sample from nan weights: the run stops there, naming step 7."""
    out = tmp_path / "out"
    monkeypatch.setattr(GPT, "forward", _forward_poisoned_at(7 + 1, float("nan")))
    rc = train.main(args(corpus, out, "--max_iters=20", "--log_interval=5", "--eval_interval=4",
                         "--tensorboard=true", "--sample_tokens=5"))
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "loss is nan at step 7; stopped without saving anything from that step on" in err
    assert "Traceback" not in err and "probability tensor" not in err
    assert load_checkpoint(out / CKPT_NAME)["step"] == 4  # the last good eval's save


def test_weights_made_non_finite_by_the_last_update_fail_the_run_instead_of_a_nan_summary(
        corpus, tmp_path, monkeypatch, capsys):
    """Every loss is finite, but the last optimizer step leaves a nan weight: the final eval sees it,
    the run exits 1, and no summary.json with NaN in it is written."""
    from training.optim import AdamW

    real_step, calls = AdamW.step, [0]

    def step(self):
        real_step(self)
        calls[0] += 1
        if calls[0] == 6:
            self.param_groups[0]["params"][0].data.fill_(float("nan"))

    monkeypatch.setattr(AdamW, "step", step)
    out = tmp_path / "out"
    rc = train.main(args(corpus, out, "--max_iters=6", "--eval_interval=3", "--exact_val=true"))
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "the model's weights are no longer finite; stopped without saving" in err
    assert not (out / "summary.json").exists()
    assert load_checkpoint(out / CKPT_NAME)["step"] == 3


def test_the_first_bad_step_is_kept_without_a_sync_until_poll():
    guard = RunGuard(torch.device("cpu"), "ckpt.pt", announce=False)
    guard.observe(torch.tensor(2.0), 1)
    guard.observe(torch.tensor(float("inf")), 3)
    guard.observe(torch.tensor(float("nan")), 5)
    assert guard.poll(step=5, sync=False) is None  # not a log step: not even looked at
    with pytest.raises(FloatingPointError, match="loss is inf at step 3"):
        guard.poll(step=6, sync=True)


def test_non_finite_weights_are_never_saved():
    model = torch.nn.Linear(2, 2)
    guard = RunGuard(torch.device("cpu"), "ckpt.pt", announce=False)
    guard.check_before_save(model)  # finite: fine
    with torch.no_grad():
        model.weight[0, 1] = float("nan")
    with pytest.raises(FloatingPointError, match="weights are no longer finite"):
        guard.check_before_save(model)


# --- a full disk -----------------------------------------------------------------------------

def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("fails", ["write", "fsync"])
def test_a_full_disk_leaves_the_previous_checkpoint_intact_and_no_temp_file(corpus, tmp_path, monkeypatch,
                                                                            capsys, fails):
    out = tmp_path / "out"
    assert train.main(args(corpus, out, "--max_iters=4", "--always_save_checkpoint", "--eval_interval=2")) == 0
    good = (out / CKPT_NAME).read_bytes()
    capsys.readouterr()
    if fails == "write":
        def half_then_full(obj, f, *a, **k):
            f.write(b"x" * 4096)  # some bytes made it to the temporary file before the disk filled
            _disk_full()

        monkeypatch.setattr(torch, "save", half_then_full)
    else:
        monkeypatch.setattr(os, "fsync", _disk_full)
    rc = train.main(args(corpus, out, "--resume", "--max_iters=8", "--always_save_checkpoint", "--eval_interval=2"))
    err = capsys.readouterr().err
    assert rc == 1
    assert f"could not write checkpoint {out / CKPT_NAME}: No space left on device" in err
    assert "the previous checkpoint there (if any) is intact" in err
    monkeypatch.undo()
    assert (out / CKPT_NAME).read_bytes() == good and load_checkpoint(out / CKPT_NAME)["step"] == 4
    assert temp_files(out) == set()


def test_temp_files_of_killed_saves_are_ignored_by_load_and_removed_by_the_next_run(corpus, tmp_path):
    out = tmp_path / "out"
    assert train.main(args(corpus, out, "--max_iters=2", "--always_save_checkpoint", "--eval_interval=1")) == 0
    stale = out / f".{CKPT_NAME}.killed.tmp"
    stale.write_bytes(b"half a checkpoint")
    assert load_checkpoint(out / CKPT_NAME)["step"] == 2
    assert train.main(args(corpus, out, "--resume", "--max_iters=3")) == 0
    assert not stale.exists()


def test_a_new_run_tidies_what_killed_writes_of_its_files_left_behind(tmp_path):
    """A SIGKILL during any atomic write leaves `.NAME.<random>.tmp` in out_dir: the checkpoint's, and
    config.json's and summary.json's. The next run in that out_dir removes all three kinds."""
    cfg = tiny_config(tmp_path, max_iters=2, eval_interval=2, tensorboard=False, exact_val=False)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True)
    stale = [out / f".{name}.k1ll3d.tmp" for name in (CKPT_NAME, "config.json", "summary.json")]
    keep = out / ".notes.txt.k1ll3d.tmp"  # not a file the trainer writes: not its business
    for p in [*stale, keep]:
        p.write_bytes(b"torn")
    train.train(cfg, verbose=False)
    assert not any(p.exists() for p in stale)
    assert keep.exists()
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
