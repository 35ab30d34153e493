"""Faults: SIGINT/TERM/HUP/PIPE between steps and in evaluations, a second Ctrl-C, SIGKILL during saves, a non-finite
loss or weight, a full disk. Signals from outside go to one `python train.py` (started with this module, so it boots
meanwhile; checked last) and to forks of this process running train.main (torch imported: they start in ms). A signal
at an exact moment comes from the model's own forward (patched before a fork, in the child too)."""

import collections
import ctypes
import errno
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

import train
from data import load_corpus
from model import GPT
from tiny import ROOT, TEXT, cli_args, tiny_config
from training import CKPT_NAME, load_checkpoint
from training.faults import RunGuard

FORK = multiprocessing.get_context("fork")
BIG = 100_000  # max_iters, eval_interval of a run only a signal ends
M = 30  # the step every signalled run is resumed to (the signal comes at step ~6)
NAN, INF = float("nan"), float("inf")
endless = lambda folder, **overrides: tiny_config(folder, **{**dict(  # a run only a signal ends
    max_iters=BIG, lr_decay_iters=BIG, eval_interval=BIG, always_save_checkpoint=True, tensorboard=False,
    exact_val=False), **overrides})
text = lambda log: log.read_text() if log.exists() else ""  # a forked child creates its log
temp_files = lambda out: {p.name for p in out.glob(f".{CKPT_NAME}.*.tmp")}  # of write_atomic
train_py = lambda cfg, **streams: subprocess.Popen([sys.executable, "train.py", *cli_args(cfg)], cwd=ROOT,
                                                   env={**os.environ, "OMP_NUM_THREADS": "1"}, **streams)


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


@pytest.fixture
def fork_train():
    """fork_train(argv, log) -> a started fork running train.main(argv) (output to log, a new process's handlers)."""
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # imports torch._dynamo (~1.5 s) here, not in each child
    children = []

    def child(argv: list[str], log: str) -> None:
        f = open(log, "w", buffering=1)
        for fd in (1, 2):
            os.dup2(f.fileno(), fd)
        sys.stdout = sys.stderr = open(1, "w", buffering=1)  # through fd 1, as a terminal's (a hangup redirects fd 1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        tqdm.set_lock(threading.RLock())  # not the parent's semaphore: a SIGKILL mid-bar would hang the parent's bars
        sys.exit(train.main(argv))

    def start(argv: list[str], log: Path) -> multiprocessing.Process:
        children.append(FORK.Process(target=child, args=(argv, str(log))))
        children[-1].start()
        return children[-1]
    yield start
    for proc in children:
        proc.kill()  # a no-op unless it is still running
        proc.join()


@pytest.fixture(scope="module", autouse=True)
def sigterm_run(tmp_path_factory):
    """`python train.py`, sent SIGTERM at step 5 by a thread: (cfg, future of its return code, log)."""
    folder = tmp_path_factory.mktemp("SIGTERM")
    cfg, log = endless(folder), folder / "log.txt"
    with open(log, "w") as f:
        proc = train_py(cfg, stdout=f, stderr=f)
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


def signals_at(n: int, times: int = 1, sig: int | tuple[int, ...] = signal.SIGINT, gap: float = 0.0):
    """An act (instrument) sending its process `times` sig (or sig[i] the i-th time), gap s apart, in the n-th training
    forward (step n - 1)."""
    def act(model, kind, counts, loss):
        for i in range(times if (kind, counts[kind]) == ("train", n) else 0):
            time.sleep(gap * (i > 0))
            os.kill(os.getpid(), sig if isinstance(sig, int) else sig[i])  # its handler runs before the next bytecode
        return loss
    return act


def loss_times(value: float, n: int, of: str = "train"):
    """An act (instrument) multiplying the loss of the n-th `of` forward (instrument's kinds) by value."""
    return lambda model, kind, counts, loss: loss * value if (kind, counts[kind]) == (of, n) else loss


# --- SIGINT / SIGTERM ------------------------------------------------------------------------

@pytest.mark.parametrize("when", ["first_estimate", "exact_val"])
def test_sigterm_inside_an_evaluation_ends_the_run_at_once_saving_the_last_completed_step(
        tmp_path, monkeypatch, capsys, own_handlers, when):
    """The step-0 estimate (64 forwards here) or the final exact val pass (3) is cut at the next forward: exit 143,
    the last completed step saved, nothing of the cut evaluation recorded; --resume then completes the run."""
    (tmp_path / "corpus.txt").write_text(TEXT * 1000, encoding="utf-8")  # 9.4k val tokens: 3 exact forwards
    first, at_signal = when == "first_estimate", {}
    cfg = tiny_config(tmp_path, max_iters=6, tensorboard=False, exact_val=True, eval_iters=2048 if first else 2)

    def act(model, kind, counts, loss):
        hit = (kind, counts[kind]) == ("estimate", 3) if first else (kind, counts["train"]) == ("other", 6)
        if hit and not at_signal:
            at_signal.update(counts)
            os.kill(os.getpid(), signal.SIGTERM)
        return loss
    counts = instrument(monkeypatch, act)
    assert train.main(cli_args(cfg)) == 143
    assert at_signal and counts == at_signal  # not one forward after the signal
    out, step, evals = Path(cfg.out_dir), 0 if first else 6, [] if first else [0, 3, 6]
    summary, ckpt = json.loads((out / "summary.json").read_text()), load_checkpoint(out / CKPT_NAME)
    assert summary["interrupted"] == ckpt["interrupted"] == "SIGTERM" and summary["steps"] == ckpt["step"] == step
    assert [h["step"] for h in ckpt["history"]] == [h["step"] for h in summary["history"]] == evals
    text = capsys.readouterr().out
    assert summary["final_val_loss"] is None and f"interrupted by SIGTERM after {step} steps: saved " \
        f"{out / CKPT_NAME} at step {step}; run the same command with --resume to continue\n" in text
    assert ("best val estimate" in text) != first  # the done line names it where one was made (not "inf")
    if first:  # the step-0 state is the initial model
        torch.manual_seed(cfg.seed)
        init = GPT(cfg.model_config(len(ckpt["vocab"]["chars"]))).state_dict()
        assert all(torch.equal(ckpt["model"][k], v) for k, v in init.items())
    monkeypatch.undo()  # and the cut run is not "finished": --resume completes it
    assert train.main(cli_args(cfg.replace(resume=True, eval_iters=2))) == 0
    final, val = json.loads((out / "summary.json").read_text())["final_val_loss"], load_corpus(cfg.dataset).val
    assert f"exact val loss over all {len(val) - 1:,} val targets: {final:.4f} (" in capsys.readouterr().out
    (guard := RunGuard(out / CKPT_NAME, distributed=True, announce=False)).signum = signal.SIGTERM
    assert not guard.stopping()  # under torchrun an evaluation runs on: the other ranks wait in it
    assert guard.kept(0) == f"{out / CKPT_NAME} (step 0) is untouched"  # a checkpoint of step 0 is one too


@pytest.mark.parametrize("second", ["inside_the_step", "after_a_sigterm", "inside_the_final_save"])
def test_a_second_ctrl_c_exits_at_once_with_130_saving_nothing(second, tmp_path, monkeypatch, fork_train):
    """A second SIGINT exits at once: from the model in the first one's step (no checkpoint yet; the first a SIGINT or
    a SIGTERM), or from outside in the final save, made to hang (ckpt.pt untouched, the abandoned save's temporary
    file removed)."""
    in_step, first = second != "inside_the_final_save", signal.SIGTERM if second == "after_a_sigterm" else signal.SIGINT
    cfg, log = endless(tmp_path, eval_interval=BIG if in_step else 2), tmp_path / "log.txt"
    path, real_save = Path(cfg.out_dir) / CKPT_NAME, torch.save

    def save(obj, f, *args, **kwargs):
        if "interrupted" in obj:
            f.write(b"partial")
            print("HANGING IN THE FINAL SAVE", flush=True)
            time.sleep(60)
        return real_save(obj, f, *args, **kwargs)
    monkeypatch.setattr(torch, "save", save)
    instrument(monkeypatch, signals_at(3, times=2, gap=0.2, sig=(first, signal.SIGINT)) if in_step  # in step 2,
               else signals_at(6))  # or step 5
    proc = fork_train(cli_args(cfg), log)
    if not in_step:
        wait_for(lambda: "HANGING IN THE FINAL SAVE" in text(log), "the final save", log)
        saved_before, t0 = path.read_bytes(), time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
    proc.join(timeout=60 if in_step else 30)
    assert proc.exitcode == 130 and (in_step or time.monotonic() - t0 < 10), log.read_text()
    kept = "no checkpoint was written" if in_step else f"{path} (step 4) is untouched"
    assert f"interrupted: exited at once without saving; {kept}" in log.read_text()
    assert "interrupted by" not in log.read_text() and not (path.parent / "summary.json").exists()
    assert not path.exists() if in_step else (path.read_bytes() == saved_before and load_checkpoint(path)["step"] == 4)
    assert temp_files(path.parent) == set()


def test_the_same_signal_twice_at_once_is_one_stop_that_saves(tmp_path, monkeypatch, own_handlers):
    """timeout signals the process, then its group: two SIGTERMs microseconds apart stop the run as one does."""
    instrument(monkeypatch, signals_at(3, times=2, sig=signal.SIGTERM))  # the second finds the first handled
    assert train.main(cli_args(cfg := endless(tmp_path))) == 143
    assert load_checkpoint(Path(cfg.out_dir) / CKPT_NAME)["step"] == 3


def test_a_stopped_run_saves_without_the_exact_val_pass_where_evaluations_run_on(tmp_path, monkeypatch, own_handlers):
    """Under torchrun stopping() is False (the ranks wait in an evaluation), yet a stop skips the final pass."""
    monkeypatch.setattr(RunGuard, "stopping", lambda self: False)
    instrument(monkeypatch, signals_at(3, sig=signal.SIGTERM))
    assert train.main(cli_args(cfg := endless(tmp_path, exact_val=True))) == 143
    assert json.loads((Path(cfg.out_dir) / "summary.json").read_text())["final_val_loss"] is None


def test_train_puts_the_signal_handlers_back_however_it_ends(tmp_path, monkeypatch, own_handlers):
    during = []

    def act(model, kind, counts, loss):
        if kind == "train" and counts[kind] == 2:
            during.append(signal.getsignal(signal.SIGTERM))
            if ending == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            return loss * (NAN if ending == "nan" else 1.0)
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

def test_sigkill_at_random_moments_during_saves_always_leaves_a_checkpoint_that_loads_and_resumes(tmp_path, fork_train):
    """A run saving a ~5 MB checkpoint every step is SIGKILLed 0-20 ms after a save is seen starting, 10 times, and
    resumed: ckpt.pt always loads and the next run resumes from its step; some kill must leave a temporary file."""
    cfg = endless(tmp_path, n_layer=2, n_head=4, n_embd=128, block_size=32, eval_interval=1, log_interval=BIG)
    out = Path(cfg.out_dir)
    path, rng, torn, step = out / CKPT_NAME, random.Random(0), 0, 0
    identity = lambda: (path.stat().st_ino, path.stat().st_mtime_ns)  # a rename over path changes it
    for kill in range(10):
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


# --- a non-finite loss or weight, a full disk --------------------------------------------------

def nan_weight(model, kind, counts, loss):
    """An act: the last forward of step 6's estimate (resumed at 4: 2 each) makes a weight nan; its loss is finite."""
    if (kind, counts[kind]) == ("estimate", 4):
        with torch.no_grad():
            model.tok_emb.weight[0, 0] = NAN
    return loss


def disk_fills(obj, f, *args, **kwargs):
    f.write(b"x" * 4096)  # some bytes reached the temporary file first
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("fault, fields, says", [
    *((loss_times(v, 4), dict(max_iters=20, log_interval=5, eval_interval=every),
       [f"loss is {v} at step 7; stopped without saving anything from that step on: {{path}} (step 4) is untouched"])
      for v in (NAN, INF) for every in (4, BIG)),
    (nan_weight, dict(max_iters=8), ["the model's weights are no longer finite; stopped without saving"]),
    (loss_times(NAN, 4, of="estimate"), dict(max_iters=8),  # step 6's val estimate; weights and train losses finite
     ["the loss estimate at step 6 is not finite", "'val': nan", "saving: {path} (step 4) is untouched"]),
    (disk_fills, dict(max_iters=8), ["intact", "could not write checkpoint {path}: No space left on device; the "
                                     "previous checkpoint"])],
    ids=["nan-estimate", "nan-log_step", "inf-estimate", "inf-log_step", "nan-weight", "nan-val-estimate", "full-disk"])
def test_a_fault_stops_the_run_with_one_error_line_and_the_last_checkpoint_byte_identical(
        run_dir, monkeypatch, capsys, fault, fields, says):
    """Resumed at step 4: step 7's loss non-finite (training stops at step 8's estimate or log step 10), a weight nan,
    step 6's val estimate nan, or the disk full: exit 1, one error line naming it (and the step ckpt.pt holds), ckpt.pt
    the step-4 file byte for byte, no temp file."""
    cfg, path = run_dir[0], run_dir[1] / CKPT_NAME  # a copy of conftest.py's finished run
    good = path.read_bytes()
    counts = monkeypatch.setattr(torch, "save", disk_fills) if fault is disk_fills else instrument(monkeypatch, fault)
    rc, err = train.main(cli_args(cfg.replace(**fields))), capsys.readouterr().err
    assert rc == 1, err
    assert "log_interval" not in fields or counts["train"] == (4 if fields["eval_interval"] == 4 else 7), counts
    (line,) = [line for line in err.splitlines() if line.strip()]  # one line, no traceback
    assert line.startswith("error: ") and all(s.format(path=path) in line for s in says), line
    assert path.read_bytes() == good and temp_files(path.parent) == set()


@pytest.mark.parametrize("bug", [IndexError, RuntimeError])  # RuntimeError: torch's, unless it is out of memory
def test_a_bug_mid_run_shows_its_traceback_and_then_that_the_last_checkpoint_is_untouched(run_dir, monkeypatch, bug):
    cfg, path = run_dir[0], run_dir[1] / CKPT_NAME
    good = path.read_bytes()
    monkeypatch.setattr(train, "train_step", lambda run, step: (_ for _ in ()).throw(bug(f"a bug at step {step}")))
    with pytest.raises(bug, match="a bug at step 4") as raised:
        train.main(cli_args(cfg))
    assert raised.value.__notes__ == [f"the run stopped at this error, saving nothing: {path} (step 4) is untouched"]
    assert path.read_bytes() == good


def test_a_non_finite_loss_before_any_save_says_no_checkpoint_was_written(tmp_path, monkeypatch):
    instrument(monkeypatch, loss_times(NAN, 3))
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 2; .*: no checkpoint was written"):
        train.train(tiny_config(tmp_path, max_iters=20, log_interval=5, exact_val=False), verbose=False)
    assert not (tmp_path / "out" / CKPT_NAME).exists()


def test_a_run_that_fails_before_its_first_step_leaves_no_folder_so_its_retry_takes_the_same_name(
        tmp_path, monkeypatch, capsys):
    """Out of memory in the first step: exit 1, no out/ left (so no out-2 next time); an existing run's folder stays."""
    cfg = tiny_config(tmp_path, max_iters=2, exact_val=False)
    real = train.train_step
    monkeypatch.setattr(train, "train_step", lambda run, step: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...")))
    assert train.main(cli_args(cfg)) == 1 and "out of memory (Tried to allocate 2.00 GiB)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(train, "train_step", real)
    assert train.main(cli_args(cfg)) == 0 and (tmp_path / "out" / CKPT_NAME).exists()  # the name it was given
    monkeypatch.setattr(train, "train_step", lambda run, step: [][step])  # a bug, in --overwrite of that run
    with pytest.raises(IndexError):
        train.main(cli_args(cfg.replace(overwrite=True)))
    assert (tmp_path / "out" / "config.json").exists()


# --- last: the `python train.py` started with this module has had time to boot ------------------

@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run of M steps: what every signalled run must resume to."""
    cfg = endless(tmp_path_factory.mktemp("straight"), max_iters=M)
    train.train(cfg, verbose=False)
    return load_checkpoint(Path(cfg.out_dir) / CKPT_NAME)


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM", "SIGHUP", "SIGPIPE"])
def test_a_signal_mid_training_saves_its_last_step_exits_128_plus_n_and_resumes_to_the_same_weights(
        name, sigterm_run, straight, tmp_path, fork_train, monkeypatch):
    """SIGINT or SIGHUP (its stdout a terminal, which goes; a resumed run) to a forked train.main whose handler a
    library replaced; SIGTERM, or SIGPIPE (stdout's reader gone), to `python train.py`: exit 128 + N, its step saved;
    resumed to M: the uninterrupted weights."""
    cfg, done, log = sigterm_run if name == "SIGTERM" else (endless(tmp_path), None, tmp_path / "log.txt")
    if name == "SIGTERM":
        rc = done.result(timeout=60)
    elif name == "SIGPIPE":  # `python train.py 2>log | head`: head exits after step 6 (stderr no tty: lines on stdout)
        with open(log, "w") as f:
            proc = train_py(cfg, stdout=subprocess.PIPE, stderr=f)
        try:
            next(line for line in proc.stdout if line.startswith(b"step      6 |"))
            proc.stdout.close()  # head exits
            rc = proc.wait(timeout=60)
        finally:
            proc.kill()  # a no-op unless a failure left it running
    else:  # and in the first step a C library swaps in its own handler, as Triton's LLVM does compiling
        if name == "SIGHUP":  # in a resumed run: its first step is not step 0, and must re-arm all the same
            train.train(cfg.replace(max_iters=2), verbose=False)
            cfg = cfg.replace(resume=True)
        libc, sig = ctypes.CDLL(None), signal.Signals[name]
        instrument(monkeypatch, lambda model, kind, counts, loss: (kind == "train" and counts[kind] == 1 and
                   libc.signal(sig, signal.SIG_DFL), loss)[1])
        monkeypatch.setattr(os, "isatty", lambda fd: fd == 1 and name == "SIGHUP")  # the fork inherits it
        proc = fork_train(cli_args(cfg), log)
        signal_at_step(proc.pid, proc.is_alive, log, signal.Signals[name])
        proc.join(timeout=60)
        rc = proc.exitcode
        monkeypatch.undo()  # the resume below runs in this process: no foreign handler, no terminal
    out, said = Path(cfg.out_dir), log.read_text()
    assert rc == 128 + signal.Signals[name], said
    summary, ckpt = json.loads((out / "summary.json").read_text()), load_checkpoint(out / CKPT_NAME)
    assert summary["interrupted"] == name and 6 <= (n := summary["steps"]) < M and summary["final_val_loss"] is None
    again = {"SIGINT": "Ctrl-C again", "SIGPIPE": "Ctrl-C"}.get(name, f"{name} again")  # how to exit at once
    assert f"received {name}: stopping at the end of this step and saving a checkpoint ({again} to exit" in said
    saved = f"interrupted by {name} after {n} steps: saved {out / CKPT_NAME} at step {n}"
    assert (saved in said) == (name in ("SIGINT", "SIGTERM"))  # after SIGHUP or SIGPIPE stdout reaches no one
    assert ckpt["step"] == n and ckpt["interrupted"] == name
    assert train.train(cfg.replace(resume=True, max_iters=M), verbose=False)["steps_this_run"] == M - n
    assert (resumed := load_checkpoint(out / CKPT_NAME))["step"] == straight["step"] == M
    for key, value in straight["model"].items():
        assert torch.equal(resumed["model"][key], value), key
