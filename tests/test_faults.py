"""Faults: SIGINT/SIGTERM between steps and inside evaluations, a second Ctrl-C, SIGKILL during saves, a
non-finite loss, a full disk.

Signals from outside go to real processes: one `python train.py` (SIGTERM; started when this module
starts, so it boots while the other tests run, and checked last) and forks of this process running
train.main (torch is imported already: a child starts in milliseconds). A signal at an exact moment
is sent by the model's own forward, in this process.
"""

from __future__ import annotations

import collections
import errno
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import train
from model import GPT
from tiny import ROOT, TEXT, cli_args, tiny_config
from training import CKPT_NAME, load_checkpoint

FORK = multiprocessing.get_context("fork")
BIG = 100_000  # max_iters, eval_interval of a run only a signal ends
M = 30  # the step every signalled run is resumed to (the signal comes at step ~6)


def endless(folder: Path, **overrides):
    fields = dict(max_iters=BIG, lr_decay_iters=BIG, eval_interval=BIG, always_save_checkpoint=True, tensorboard=False,
                  exact_val=False)
    return tiny_config(folder, **{**fields, **overrides})


def text(log: Path) -> str:
    return log.read_text() if log.exists() else ""  # a forked child creates its log


def wait_for(condition, what: str, log: Path | None = None, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}" + (f"; log:\n{text(log)}" if log else ""))
        time.sleep(0.002)


def signal_at_step(pid: int, alive, log: Path, sig: int, step: int = 5) -> None:
    """Send sig once the run's log shows the progress line of `step` (mid-training), unless it has died."""
    wait_for(lambda: not alive() or f"step {step:6d} |" in text(log), f"step {step}", log)
    if alive():
        os.kill(pid, sig)


def child(argv: list[str], log: str, setup=None) -> None:
    """A forked training process: output to log, the signal handlers of a fresh interpreter, train.main."""
    f = open(log, "w", buffering=1)
    os.dup2(f.fileno(), 1)
    os.dup2(f.fileno(), 2)
    sys.stdout = sys.stderr = f
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if setup is not None:
        setup()
    sys.exit(train.main(argv))


@pytest.fixture
def fork_train():
    """fork_train(argv, log, setup=None) -> a started child (child above); any left alive is killed after."""
    children = []
    # torch.optim imports torch._dynamo on its first use (~1.5 s here): paid once, in this process, and
    # not by every child
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])

    def start(argv: list[str], log: Path, setup=None) -> multiprocessing.Process:
        children.append(FORK.Process(target=child, args=(argv, str(log), setup)))
        children[-1].start()
        return children[-1]

    yield start
    for proc in children:
        if proc.is_alive():
            proc.kill()
            proc.join()


def temp_files(out: Path) -> set[str]:
    return {p.name for p in out.glob(f".{CKPT_NAME}.*.tmp")}


@pytest.fixture(scope="module", autouse=True)
def sigterm_run(tmp_path_factory):
    """`python train.py`, sent SIGTERM at step 5 by a thread: (cfg, future of its return code, log)."""
    folder = tmp_path_factory.mktemp("SIGTERM")
    cfg, log = endless(folder), folder / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "train.py", *cli_args(cfg)], cwd=ROOT, stdout=f, stderr=f,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    with ThreadPoolExecutor(1) as pool:
        alive = lambda: proc.poll() is None
        done = pool.submit(lambda: signal_at_step(proc.pid, alive, log, signal.SIGTERM) or proc.wait(timeout=60))
        yield cfg, done, log
        proc.kill()  # a no-op unless a failure left it running


@pytest.fixture
def own_handlers():
    """Handlers of the test's own that fail if run: a signal train() misses fails the test, not pytest."""
    def mine(signum, frame):
        raise AssertionError(f"{signal.Signals(signum).name} reached the test's own handler")

    previous = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    yield mine
    for s, h in previous.items():
        signal.signal(s, h)


def instrument(monkeypatch, act) -> collections.Counter:
    """Route GPT.forward through act(model, kind, counts, loss) -> loss, counting calls by kind: "train",
    "estimate" (eval mode, with targets) and "other" (eval mode, no targets: the duration probe, exact val)."""
    real, counts = GPT.forward, collections.Counter()

    def forward(self, idx, targets=None, cache=None):
        kind = "train" if self.training else "estimate" if targets is not None else "other"
        counts[kind] += 1
        logits, loss = real(self, idx, targets, cache)
        return logits, act(self, kind, counts, loss)

    monkeypatch.setattr(GPT, "forward", forward)
    return counts


def kill_self(sig: int) -> None:
    os.kill(os.getpid(), sig)  # its Python handler runs before the next bytecode


# --- SIGINT / SIGTERM ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run of M steps: what every signalled run must resume to."""
    cfg = endless(tmp_path_factory.mktemp("straight"), max_iters=M)
    train.train(cfg, verbose=False)
    return load_checkpoint(Path(cfg.out_dir) / CKPT_NAME)


def check_stopped_by(name: str, code: int, rc: int, cfg, log: Path, straight) -> None:
    """rc, the messages, ckpt.pt and summary.json of a run stopped by `name`; then resume it to M."""
    out, text = Path(cfg.out_dir), log.read_text()
    assert rc == code, text
    summary = json.loads((out / "summary.json").read_text())
    n = summary["steps"]
    assert summary["interrupted"] == name and 6 <= n < M and summary["final_val_loss"] is None
    assert f"received {name}: stopping at the end of this step" in text
    assert f"interrupted by {name} after {n} steps: saved {out / CKPT_NAME} at step {n}" in text
    ckpt = load_checkpoint(out / CKPT_NAME)
    assert ckpt["step"] == n and ckpt["interrupted"] == name
    assert train.train(cfg.replace(resume=True, max_iters=M), verbose=False)["steps_this_run"] == M - n
    resumed = load_checkpoint(out / CKPT_NAME)
    assert resumed["step"] == straight["step"] == M
    for key, value in straight["model"].items():
        assert torch.equal(resumed["model"][key], value), key


def test_sigint_mid_training_saves_its_last_step_exits_130_and_resumes_to_the_same_weights(tmp_path, straight,
                                                                                           fork_train):
    cfg, log = endless(tmp_path), tmp_path / "log.txt"
    proc = fork_train(cli_args(cfg), log)
    signal_at_step(proc.pid, proc.is_alive, log, signal.SIGINT)
    proc.join(timeout=60)
    check_stopped_by("SIGINT", 130, proc.exitcode, cfg, log, straight)


@pytest.mark.parametrize("when", ["first_estimate", "exact_val"])
def test_sigterm_inside_an_evaluation_ends_the_run_at_once_saving_the_last_completed_step(
        tmp_path, monkeypatch, capsys, own_handlers, when):
    """The step-0 estimate (64 forwards here) or the final exact val pass (3) is cut at the next forward:
    exit 143, the state of the last completed step saved, and nothing of the cut evaluation recorded."""
    (tmp_path / "corpus.txt").write_text(TEXT * 1000, encoding="utf-8")  # 9.4k val tokens: 3 exact forwards
    cfg = tiny_config(tmp_path, max_iters=6, tensorboard=False, exact_val=True,
                      eval_iters=2048 if when == "first_estimate" else 2)
    at_signal = {}

    def act(model, kind, counts, loss):
        if not at_signal and ((when == "first_estimate" and kind == "estimate" and counts[kind] == 3)
                              or (when == "exact_val" and kind == "other" and counts["train"] == 6)):
            at_signal.update(counts)
            kill_self(signal.SIGTERM)
        return loss

    counts = instrument(monkeypatch, act)
    assert train.main(cli_args(cfg)) == 143
    assert at_signal and counts == at_signal  # not one forward after the signal
    out, step = Path(cfg.out_dir), 0 if when == "first_estimate" else 6
    summary, ckpt = json.loads((out / "summary.json").read_text()), load_checkpoint(out / CKPT_NAME)
    assert summary["interrupted"] == ckpt["interrupted"] == "SIGTERM" and summary["steps"] == ckpt["step"] == step
    evals = [] if when == "first_estimate" else [0, 3, 6]
    assert [h["step"] for h in ckpt["history"]] == [h["step"] for h in summary["history"]] == evals
    assert summary["final_val_loss"] is None
    assert f"interrupted by SIGTERM after {step} steps" in capsys.readouterr().out
    if when == "first_estimate":  # the step-0 state is the initial model
        torch.manual_seed(cfg.seed)
        init = GPT(cfg.model_config(len(ckpt["vocab"]["chars"]))).state_dict()
        assert all(torch.equal(ckpt["model"][k], v) for k, v in init.items())
    monkeypatch.undo()  # and the cut run is not "finished": --resume completes it
    assert train.main(cli_args(cfg.replace(resume=True, eval_iters=2))) == 0
    assert json.loads((out / "summary.json").read_text())["final_val_loss"] is not None


def test_a_second_ctrl_c_inside_a_step_exits_at_once_without_saving_that_step(tmp_path, fork_train):
    """Two SIGINTs in one training step: the first asks for a stop at the step's end, the second exits at once
    (130) from inside the step, so no interrupted state is saved."""
    cfg, log = endless(tmp_path), tmp_path / "log.txt"

    def setup():
        real_forward, calls = GPT.forward, [0]

        def forward(self, idx, targets=None, cache=None):
            calls[0] += self.training
            if self.training and calls[0] == 3:
                kill_self(signal.SIGINT)
                kill_self(signal.SIGINT)
            return real_forward(self, idx, targets, cache)

        GPT.forward = forward

    proc = fork_train(cli_args(cfg), log, setup)
    proc.join(timeout=60)
    assert proc.exitcode == 130, log.read_text()
    assert "exited at once without saving; no checkpoint was written" in log.read_text()
    assert "interrupted by" not in log.read_text()
    assert not (Path(cfg.out_dir) / CKPT_NAME).exists()


def test_a_second_ctrl_c_exits_at_once_leaving_the_last_checkpoint_as_it_was(tmp_path, fork_train):
    """The first SIGINT (from the model, at step 5) starts the final save, made to hang; a second one from
    outside ends the process at once, and the abandoned save's temporary file is removed."""
    cfg, log = endless(tmp_path, eval_interval=2), tmp_path / "log.txt"
    out = Path(cfg.out_dir)

    def setup():
        real_forward, real_save, calls = GPT.forward, torch.save, [0]

        def forward(self, idx, targets=None, cache=None):
            calls[0] += self.training
            if self.training and calls[0] == 6:
                kill_self(signal.SIGINT)
            return real_forward(self, idx, targets, cache)

        def save(obj, f, *args, **kwargs):
            if "interrupted" in obj:
                f.write(b"partial")
                print("HANGING IN THE FINAL SAVE", flush=True)
                time.sleep(60)
            return real_save(obj, f, *args, **kwargs)

        GPT.forward, torch.save = forward, save

    proc = fork_train(cli_args(cfg), log, setup)
    wait_for(lambda: "HANGING IN THE FINAL SAVE" in text(log), "the final save", log)
    saved_before, t0 = (out / CKPT_NAME).read_bytes(), time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    proc.join(timeout=30)
    assert proc.exitcode == 130 and time.monotonic() - t0 < 10, log.read_text()
    assert f"interrupted: exited at once without saving; {out / CKPT_NAME} is untouched" in log.read_text()
    assert (out / CKPT_NAME).read_bytes() == saved_before and load_checkpoint(out / CKPT_NAME)["step"] == 4
    assert temp_files(out) == set() and not (out / "summary.json").exists()


def test_train_puts_the_signal_handlers_back_however_it_ends(tmp_path, monkeypatch, own_handlers):
    during = []

    def act(model, kind, counts, loss):
        if kind == "train" and counts[kind] == 2:
            during.append(signal.getsignal(signal.SIGTERM))
            if ending == "sigterm":
                kill_self(signal.SIGTERM)
            return loss * (float("nan") if ending == "nan" else 1.0)
        return loss

    counts = instrument(monkeypatch, act)
    for ending in ("done", "nan", "sigterm"):
        counts.clear()
        cfg = tiny_config(tmp_path, out_dir=str(tmp_path / ending), max_iters=3, exact_val=False)
        if ending == "nan":
            with pytest.raises(FloatingPointError):
                train.train(cfg, verbose=False)
        else:
            assert train.train(cfg, verbose=False)["interrupted"] == (None if ending == "done" else "SIGTERM")
        assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM) is own_handlers, ending
    assert len(during) == 3 and own_handlers not in during  # positive control: train() had its own in place


# --- SIGKILL at random moments during saves ---------------------------------------------------

KILLS = 10


def test_sigkill_at_random_moments_during_saves_always_leaves_a_checkpoint_that_loads_and_resumes(tmp_path, fork_train):
    """A run saving a ~5 MB checkpoint every step is SIGKILLed at a random moment (0-20 ms) after a save
    is seen starting, then resumed: every time ckpt.pt loads, and the next run resumes from its step.
    The kills that left a temporary file show that they landed inside a save."""
    cfg = endless(tmp_path, n_layer=2, n_head=4, n_embd=128, block_size=32, eval_interval=1, log_interval=BIG)
    out = Path(cfg.out_dir)
    path, rng, torn, step = out / CKPT_NAME, random.Random(0), 0, 0
    identity = lambda: (path.stat().st_ino, path.stat().st_mtime_ns)  # a rename over path changes it
    for kill in range(KILLS):
        log, leftovers = tmp_path / f"log{kill}.txt", temp_files(out)
        proc = fork_train(cli_args(cfg.replace(resume=kill > 0)), log)
        wait_for(path.exists, "the first checkpoint", log)
        last = identity()
        wait_for(lambda leftovers=leftovers, last=last: temp_files(out) - leftovers or identity() != last,
                 f"a save (kill {kill})", log)
        time.sleep(rng.uniform(0, 0.02))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        torn += bool(temp_files(out) - leftovers)
        assert kill == 0 or f"resumed at step {step}" in log.read_text()
        step, previous = load_checkpoint(path)["step"], step  # raises if the kill tore ckpt.pt
        assert step >= previous
    assert torn >= 1, "no kill landed inside a save: the test did not test what it says"
    assert train.main(cli_args(cfg.replace(resume=True, max_iters=step + 2))) == 0
    assert load_checkpoint(path)["step"] == step + 2 and temp_files(out) == set()


# --- a non-finite loss, a full disk ------------------------------------------------------------

@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A run finished at step 4 with a checkpoint (always saved, every 2 steps); copy before use."""
    cfg = tiny_config(tmp_path_factory.mktemp("good"), max_iters=4, eval_interval=2, always_save_checkpoint=True,
                      tensorboard=False, exact_val=False)
    assert train.main(cli_args(cfg)) == 0
    return cfg


@pytest.fixture
def resumable(good_run, tmp_path):
    shutil.copytree(good_run.out_dir, tmp_path / "out")
    out = tmp_path / "out"
    return good_run.replace(out_dir=str(out), resume=True), out / CKPT_NAME, (out / CKPT_NAME).read_bytes()


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("caught_at", ["estimate", "log_step"])
def test_a_non_finite_loss_stops_naming_its_step_and_leaves_the_last_checkpoint_byte_identical(
        resumable, monkeypatch, capsys, value, caught_at):
    """Resumed at step 4, step 7's loss is made non-finite: caught by the estimate of step 8 or by the
    log step 10, the run names step 7 and exits 1, and ckpt.pt stays the step-4 file byte for byte."""
    cfg, path, good = resumable
    instrument(monkeypatch, lambda model, kind, counts, loss: loss * value if (kind, counts[kind]) == ("train", 4)
               else loss)
    rc = train.main(cli_args(cfg.replace(max_iters=20, log_interval=5, eval_interval=4 if caught_at == "estimate"
                                         else BIG)))
    err = capsys.readouterr().err
    assert rc == 1, err
    assert f"loss is {value} at step 7; stopped without saving anything from that step on: {path} is untouched" in err
    assert path.read_bytes() == good


def test_a_non_finite_loss_before_any_save_says_no_checkpoint_was_written(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, max_iters=20, log_interval=5, exact_val=False)
    nan = float("nan")
    instrument(monkeypatch, lambda model, kind, counts, loss: loss * nan if (kind, counts[kind]) == ("train", 3)
               else loss)
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 2; .*: no checkpoint was written"):
        train.train(cfg, verbose=False)
    assert not (tmp_path / "out" / CKPT_NAME).exists()


def test_non_finite_weights_are_never_saved(resumable, monkeypatch, capsys):
    """The last forward of step 6's estimate leaves a weight nan (its own loss finite): the save refuses."""
    cfg, path, good = resumable

    def act(model, kind, counts, loss):
        if (kind, counts[kind]) == ("estimate", 4):  # resumed at 4: estimates at 4 and 6, of 2 forwards each
            with torch.no_grad():
                model.tok_emb.weight[0, 0] = float("nan")
        return loss

    instrument(monkeypatch, act)
    assert train.main(cli_args(cfg.replace(max_iters=8))) == 1
    assert "the model's weights are no longer finite; stopped without saving" in capsys.readouterr().err
    assert path.read_bytes() == good


def test_a_full_disk_during_a_save_stops_with_one_error_line_and_the_previous_checkpoint_intact(
        resumable, monkeypatch, capsys):
    cfg, path, good = resumable

    def disk_fills(obj, f, *args, **kwargs):
        f.write(b"x" * 4096)  # some bytes reached the temporary file first
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", disk_fills)
    assert train.main(cli_args(cfg.replace(max_iters=8))) == 1
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.strip()]  # one line, no traceback
    assert line.startswith("error: ") and "intact" in line
    assert f"could not write checkpoint {path}: No space left on device; the previous checkpoint" in line
    assert path.read_bytes() == good and temp_files(path.parent) == set()


def test_sigterm_mid_training_from_outside_python_train_py_exits_143_and_resumes_to_the_same_weights(
        sigterm_run, straight):
    """Last in the module: the `python train.py` started with it has had time to boot meanwhile."""
    cfg, done, log = sigterm_run
    check_stopped_by("SIGTERM", 143, done.result(timeout=60), cfg, log, straight)
