"""The benchmark tools' figures and train.py's entry point, pinned with everything slow faked.

benchmarks/vs_nanogpt.py, ablate.py, summarize.py, nanogpt_exact_val.py and micro.py turn runs into
the numbers benchmarks/RESULTS.md and the README publish: a median of nanoGPT's log, a ratio of
walls, a step budget, a mean over seeds. A wrong regex group, a swapped ratio or a dropped seed
still prints plausible numbers, so each figure is computed here from inputs the test controls (a
canned nanoGPT log, a faked subprocess, clock or training run) and compared with the value worked
out by hand. No test needs nanoGPT, a network or a real benchmark run: the file takes a few seconds.

The tests were written against hand-made mutants of the code (mutation testing): each mutant that
passed the rest of the suite and would change a published figure or what a user sees fails here.
"""

from __future__ import annotations

import json
import math
import pickle
import statistics
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_runs import write_corpus

import ablate
import micro
import nanogpt_exact_val
import summarize
import train
import vs_nanogpt
from data import load_corpus
from model import GPT, GPTConfig
from training import TrainConfig, configure_optimizer, exact_loss, help_text, parse_args

ROOT = Path(__file__).resolve().parent.parent


# --- benchmarks/vs_nanogpt.py -------------------------------------------------------------------------

# nanoGPT's laptop command as the module docstring (and nanoGPT's README) gives it: the published
# comparison is against exactly this recipe, so a changed flag is a different benchmark
NANOGPT_ARGV = ["train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
                "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4",
                "--n_head=4", "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]


def nanogpt_log(iter_ms: list[float]) -> str:
    """A log in nanoGPT's format (its train.py's print statements): config echo, an eval at step 0
    and at the last step, one `iter` line per step with its ms. No loss equals any time, and no train
    loss its val loss, so a regex that reads the wrong group gives other numbers."""
    last = len(iter_ms) - 1
    lines = ["Overriding config with config/train_shakespeare_char.py:",
             "eval_interval = 250 # keep frequent because we'll overfit", "number of parameters: 0.80M",
             "step 0: train loss 4.1676, val loss 4.1649"]
    for i, ms in enumerate(iter_ms):
        if i == last:
            lines += [f"step {last}: train loss 1.7648, val loss 1.8857", "saving checkpoint to out"]
        lines.append(f"iter {i}: loss {3.5 - i / 100:.4f}, time {ms:.2f}ms, mfu 0.04%")
    return "\n".join(lines) + "\n"


def test_timed_returns_the_wall_the_exit_status_and_the_peak_rss_in_mib(tmp_path, monkeypatch):
    """A real child process (python -c: milliseconds) in the given cwd; its stdout *and* stderr land in
    the log (nanoGPT's traceback must be there to report a failure), its exit status comes back (not 0
    whatever happened), and ru_maxrss, KiB on Linux, becomes MiB: 1536 * 1024 KiB -> 1536.0. The
    clock is faked so that the wall is exact."""
    monkeypatch.setattr(sys, "platform", "linux")  # Linux's unit; macOS reports ru_maxrss in bytes
    real_wait4 = vs_nanogpt.os.wait4
    monkeypatch.setattr(vs_nanogpt.os, "wait4", lambda pid, options: (
        *real_wait4(pid, options)[:2], types.SimpleNamespace(ru_maxrss=1536 * 1024)))
    ticks = iter([100.0, 102.5])
    monkeypatch.setattr(vs_nanogpt, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    code = "import os, sys; print('out', os.getcwd()); print('err', file=sys.stderr, flush=True); sys.exit(3)"
    log = tmp_path / "child.log"
    wall, rss, rc = vs_nanogpt.timed([sys.executable, "-c", code], tmp_path, log)
    assert (wall, rss, rc) == (2.5, 1536.0, 3)
    assert sorted(log.read_text().splitlines()) == ["err", f"out {tmp_path}"]


def fake_timed(monkeypatch, write, status: int = 0) -> list[tuple[list[str], Path]]:
    """Replace vs_nanogpt.timed: write(cmd, log) produces the program's files, wall 64.0 s, peak RSS
    512.0 MB, exit `status`. Returns the (command, cwd) of every call."""
    calls = []

    def timed(cmd, cwd, log):
        calls.append((cmd, cwd))
        write(cmd, log)
        return 64.0, 512.0, status

    monkeypatch.setattr(vs_nanogpt, "timed", timed)
    return calls


def test_run_nanogpt_runs_the_laptop_recipe_and_reads_its_log(tmp_path, monkeypatch):
    """Steps 0-9 are warm-up (500 ms each, the eval at step 0 among them) and left out; steps 10-14
    take 20, 21, 22, 23 and 90 ms: the median is 22 (the mean 35.2, and 500 with the warm-up, 22.5
    from step 11). The val loss is the last eval's val loss (1.8857; 1.7648 is its train loss, 4.1649
    the first eval's). The recipe runs in the nanoGPT checkout, writing under tmp."""
    checkout = tmp_path / "nanoGPT"
    calls = fake_timed(monkeypatch, lambda cmd, log: log.write_text(nanogpt_log([500.0] * 10 + [20, 21, 22, 23, 90])))
    row = vs_nanogpt.run_nanogpt(checkout, tmp_path)
    assert row == {"program": "nanoGPT", "dtype": "float32", "wall_seconds": 64.0, "peak_rss_mb": 512.0,
                   "ms_per_step_median": 22.0, "val_loss_estimate": 1.8857, "final_step": 14}
    assert calls == [([sys.executable, *NANOGPT_ARGV, f"--out_dir={tmp_path / 'nanogpt_out'}"], checkout)]


def test_a_failing_nanogpt_run_is_reported_with_its_output(tmp_path, monkeypatch):
    """Exit status 1 (nanoGPT's data not prepared, say) raises with the end of its log, instead of a
    median of nothing (or of a partial log) in the comparison."""
    fake_timed(monkeypatch, lambda cmd, log: log.write_text(
        nanogpt_log([30.0] * 12) + "FileNotFoundError: data/shakespeare_char/train.bin\n"), status=1)
    with pytest.raises(RuntimeError, match=r"nanoGPT failed:\n(.|\n)*FileNotFoundError: data/shakespeare_char"):
        vs_nanogpt.run_nanogpt(tmp_path, tmp_path)


def write_our_run(cmd: list[str], log: Path) -> None:
    """What train.py leaves in --out_dir: summary.json and config.json (dtype as resolved: config.json's
    own "dtype", not the config's "auto"). Every figure differs from the ones near it."""
    out = Path(next(a for a in cmd if a.startswith("--out_dir=")).removeprefix("--out_dir="))
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({
        "best_val_loss": 1.70, "final_val_loss": 1.72, "last_val_estimate": 1.74, "steps": 2000,
        "steps_this_run": 2000, "ms_per_step_median": 17.5, "train_seconds": 40.0, "wall_seconds": 45.0}))
    (out / "config.json").write_text(json.dumps({"config": {"dtype": "auto"}, "dtype": "bfloat16"}))
    log.write_text("step 2000: train loss 1.6, val loss 1.74\n")


def test_run_ours_reads_the_figures_from_summary_json_and_the_resolved_dtype(tmp_path, monkeypatch):
    """Our run: train.py on the config, in this checkout, on the given dataset (without --dataset the
    config's own dataset would be trained on), outputs under tmp, the extra arguments last (they
    override the rest). The row's val estimate is last_val_estimate (not best_val_loss), the exact
    val is final_val_loss, and dtype is the one auto resolved to."""
    calls = fake_timed(monkeypatch, write_our_run)
    row = vs_nanogpt.run_ours("configs/x.toml", ["--seed=3"], "data/input.txt", tmp_path)
    assert row == {"program": "ours:configs/x.toml", "dtype": "bfloat16", "wall_seconds": 64.0,
                   "peak_rss_mb": 512.0, "ms_per_step_median": 17.5, "val_loss_estimate": 1.74,
                   "final_val_loss_exact": 1.72, "final_step": 2000}
    assert calls == [([sys.executable, "train.py", "configs/x.toml", "--dataset=data/input.txt",
                       f"--out_dir={tmp_path / 'ours_out'}", f"--cache_dir={tmp_path / 'cache'}", "--seed=3"], ROOT)]


def test_a_failing_run_of_ours_is_reported_with_its_output(tmp_path, monkeypatch):
    """A failed train.py raises with its last output, instead of reading a summary.json it never wrote
    (or one an earlier run left in the shared out_dir)."""
    fake_timed(monkeypatch, lambda cmd, log: log.write_text("error: config key n_layer: 'x' is not a valid int\n"),
               status=1)
    with pytest.raises(RuntimeError, match=r"ours failed:\nerror: config key n_layer"):
        vs_nanogpt.run_ours("configs/x.toml", [], "input.txt", tmp_path)


# per round: nanoGPT's and each config's rows, as run_nanogpt and run_ours return them. Three rounds,
# so that a median differs from a mean (with two rounds they agree), and values out of order, so
# that the median differs from the first and the last round's
NANO_ROWS = [dict(wall_seconds=64.0, ms_per_step_median=30.0, peak_rss_mb=100.0, val_loss_estimate=1.90),
             dict(wall_seconds=80.0, ms_per_step_median=20.0, peak_rss_mb=110.0, val_loss_estimate=1.88),
             dict(wall_seconds=60.0, ms_per_step_median=24.0, peak_rss_mb=90.0, val_loss_estimate=1.87)]
OURS_ROWS = {
    "configs/a.toml": [dict(wall_seconds=48.0, ms_per_step_median=16.0, peak_rss_mb=300.0, val_loss_estimate=1.85,
                            final_val_loss_exact=1.80),
                       dict(wall_seconds=40.0, ms_per_step_median=12.0, peak_rss_mb=310.0, val_loss_estimate=1.86,
                            final_val_loss_exact=1.82),
                       dict(wall_seconds=100.0, ms_per_step_median=15.0, peak_rss_mb=290.0, val_loss_estimate=1.84,
                            final_val_loss_exact=1.81)],
    "configs/b.toml": [dict(wall_seconds=30.0, ms_per_step_median=8.0, peak_rss_mb=200.0, val_loss_estimate=1.75,
                            final_val_loss_exact=1.70),
                       dict(wall_seconds=36.0, ms_per_step_median=10.0, peak_rss_mb=220.0, val_loss_estimate=1.76,
                            final_val_loss_exact=1.72),
                       dict(wall_seconds=32.0, ms_per_step_median=6.0, peak_rss_mb=210.0, val_loss_estimate=1.74,
                            final_val_loss_exact=1.71)]}


def test_vs_nanogpt_alternates_the_programs_and_reports_medians_and_ratios(tmp_path, monkeypatch, capsys):
    """Three rounds of nanoGPT then configs a and b, after one warm-up run of a (5 steps, no exact val,
    not reported). Every run gets --ours_args, split like a shell (a quoted space stays inside its
    argument). The medians: nanoGPT wall 64, ms 24; a: wall 48, ms 15; b: wall 32, ms 8. The wall ratio
    is ours over nanoGPT's (a: 48/64 = 0.75, < 1: ours is faster), the step-throughput ratio
    nanoGPT's ms over ours (a: 24/15 = 1.6, > 1: ours is faster); --json holds every run too."""
    checkout = tmp_path / "nanoGPT"
    checkout.mkdir()
    (checkout / "train.py").write_text("")  # main only checks that the checkout has one
    dataset = tmp_path / "input.txt"
    dataset.write_text("text")
    calls, left = [], {c: list(rows) for c, rows in OURS_ROWS.items()}
    nano_left = list(NANO_ROWS)

    def run_nanogpt(path, tmp, extra=()):
        calls.append(("nanoGPT", path))
        return {"program": "nanoGPT", "dtype": "float32", **nano_left.pop(0), "final_step": 2000}

    def run_ours(config, extra, dataset_arg, tmp):
        calls.append((config, extra, dataset_arg))
        if "--max_iters=5" in extra:  # the warm-up: its figures must not be reported
            return {"program": f"ours:{config}", "dtype": "float32", "wall_seconds": 1e6, "ms_per_step_median": 1e6,
                    "peak_rss_mb": 1e6, "val_loss_estimate": 9.0, "final_val_loss_exact": None, "final_step": 5}
        return {"program": f"ours:{config}", "dtype": "float32", **left[config].pop(0), "final_step": 2000}

    monkeypatch.setattr(vs_nanogpt, "run_nanogpt", run_nanogpt)
    monkeypatch.setattr(vs_nanogpt, "run_ours", run_ours)
    monkeypatch.setattr(vs_nanogpt, "time", types.SimpleNamespace(strftime=lambda fmt: "2025-01-02"))
    out = tmp_path / "vs.json"
    assert vs_nanogpt.main([f"--nanogpt={checkout}", f"--dataset={dataset}", "--rounds=3", "--ours",
                            "configs/a.toml", "configs/b.toml", "--ours_args=--seed=3 --sample_prompt='To be'",
                            f"--json={out}"]) == 0
    extra = ["--seed=3", "--sample_prompt=To be"]
    one_round = [("nanoGPT", checkout), *((config, extra, str(dataset)) for config in OURS_ROWS)]
    assert calls == [("configs/a.toml", [*extra, "--max_iters=5", "--exact_val=false"], str(dataset)), *one_round * 3]

    result = json.loads(out.read_text())
    runs = [{"round": r, "program": "nanoGPT", "dtype": "float32", **NANO_ROWS[r], "final_step": 2000}
            for r in range(3)]
    runs = [row for r in range(3) for row in (
        runs[r], *({"round": r, "program": f"ours:{c}", "dtype": "float32", **OURS_ROWS[c][r], "final_step": 2000}
                   for c in OURS_ROWS))]
    assert result == {
        "machine": vs_nanogpt.os.uname().machine, "cores": vs_nanogpt.os.cpu_count(), "date": "2025-01-02",
        "runs": runs,
        "nanoGPT": {"wall_seconds": 64.0, "ms_per_step_median": 24.0, "peak_rss_mb": 100.0, "val_loss_estimate": 1.88},
        "ours:configs/a.toml": {"wall_seconds": 48.0, "wall_ratio_vs_nanogpt": 48 / 64,
                                "step_throughput_ratio_vs_nanogpt": 24 / 15, "ms_per_step_median": 15.0,
                                "peak_rss_mb": 300.0, "final_val_loss_exact": 1.81},
        "ours:configs/b.toml": {"wall_seconds": 32.0, "wall_ratio_vs_nanogpt": 32 / 64,
                                "step_throughput_ratio_vs_nanogpt": 24 / 8, "ms_per_step_median": 8.0,
                                "peak_rss_mb": 210.0, "final_val_loss_exact": 1.71},
    }
    # printed: one line per run as it finishes, then the summary without the runs
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert [json.loads(line) for line in lines[:9]] == runs
    assert json.loads("\n".join(lines[9:])) == {k: v for k, v in result.items() if k != "runs"}


def test_vs_nanogpt_refuses_a_missing_dataset_before_running_anything(tmp_path, monkeypatch, capsys):
    """A typo in --dataset is an argparse error (status 2) at once, not a failure of the first of many
    minutes-long runs."""
    (tmp_path / "train.py").write_text("")
    monkeypatch.setattr(vs_nanogpt, "run_ours", lambda *args: pytest.fail("ran before checking the dataset"))
    with pytest.raises(SystemExit) as exit_info:
        vs_nanogpt.main([f"--nanogpt={tmp_path}", f"--dataset={tmp_path / 'missing.txt'}"])
    assert exit_info.value.code == 2
    assert f"--dataset={tmp_path / 'missing.txt'}: no such file" in capsys.readouterr().err


# --- benchmarks/ablate.py ---------------------------------------------------------------------------

def test_ablate_overrides_become_arguments_train_py_reads_back_as_the_same_values():
    """A plan's TOML values (bools, floats, strings) pass through the command line of a fresh process:
    what train.py parses must be what the plan said."""
    overrides = {"qk_norm": True, "tensorboard": False, "learning_rate": 3e-3, "lr_schedule": "wsd",
                 "batch_size": 24, "sample_prompt": "To be"}
    cfg, _ = parse_args([str(ROOT / "configs" / "debug.toml"), *ablate._args(overrides)])
    assert {k: getattr(cfg, k) for k in overrides} == overrides


def test_ablate_run_train_runs_train_py_in_this_checkout_and_refuses_a_failed_run(tmp_path, monkeypatch):
    """The run: train.py here (not the caller's directory), the overrides, then its own out_dir and no
    TensorBoard; the wall is the whole process's. A run that fails must stop the plan, even where an
    earlier run left a summary.json in the same out_dir (ablate reuses run-SEED between variants):
    that stale summary would otherwise be reported as this variant's."""
    out = tmp_path / "run-1"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"final_val_loss": 1.5}))
    calls, status = [], [0]

    def fake_run(cmd, cwd, capture_output, text):
        calls.append((cmd, cwd))
        return types.SimpleNamespace(returncode=status[0], stdout="step 1 ...", stderr="Traceback ...\nboom")

    ticks = iter([10.0, 13.5, 20.0, 21.0])
    monkeypatch.setattr(ablate.subprocess, "run", fake_run)
    monkeypatch.setattr(ablate, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert ablate.run_train("configs/debug.toml", {"seed": 2}, out) == ({"final_val_loss": 1.5}, 3.5)
    assert calls == [([sys.executable, "train.py", "configs/debug.toml", "--seed=2", f"--out_dir={out}",
                       "--tensorboard=false"], ablate.ROOT)]
    status[0] = 1
    with pytest.raises(SystemExit, match=r"failed \(exit 1\):\nTraceback \.\.\.\nboom"):
        ablate.run_train("configs/debug.toml", {"seed": 2}, out)


def test_ablate_times_a_variant_with_a_short_run_logged_every_step(tmp_path, monkeypatch):
    """The timing run: 80 steps with the schedule over those 80, a log line (an ms/step sample) every
    step, one eval at the end and no exact val (it would cost time and measure nothing here); the
    figure is the run's median ms/step (25.5), not train_seconds / steps (12.5)."""
    calls = []

    def run_train(base, overrides, out_dir):
        calls.append((base, overrides, out_dir))
        return {"ms_per_step_median": 25.5, "train_seconds": 1.0}, 9.0

    monkeypatch.setattr(ablate, "run_train", run_train)
    assert ablate.ms_per_step("configs/debug.toml", {"n_layer": 2}, "input.txt", tmp_path) == 25.5
    assert calls == [("configs/debug.toml", {"n_layer": 2, "dataset": "input.txt", "max_iters": 80,
                                             "lr_decay_iters": 80, "log_interval": 1, "eval_interval": 80,
                                             "eval_iters": 1, "exact_val": False}, tmp_path / "timing")]


PLAN = """
base = "configs/debug.toml"
budget_seconds = 2.0
timing_rounds = 3
overrides = { eval_iters = 4, n_layer = 1 }
[[variant]]
name = "a"
[[variant]]
name = "b"
overrides = { batch_size = 8, eval_iters = 2 }
[[variant]]
name = "c"
steps = 7
overrides = { batch_size = 6 }
"""

# the timing runs' ms/step, per variant, in the order of the rounds
TIMINGS = {"a": [20.0, 25.0, 40.0], "b": [30.0, 24.0, 26.0], "c": [50.0, 60.0, 55.0]}


def fake_ablation(monkeypatch) -> list[tuple[str, dict]]:
    """Replace ablate.run_train: a timing run (out_dir "timing") returns the variant's next TIMINGS
    entry (the variant is known by its batch size), a training run a summary whose figures derive
    from the variant and the seed. Returns (kind, overrides) of every call."""
    calls, left = [], {name: list(ms) for name, ms in TIMINGS.items()}
    names = {4: "a", 8: "b", 6: "c"}  # debug.toml's batch size is 4

    def run_train(base, overrides, out_dir):
        assert base == "configs/debug.toml"
        name = names[overrides.get("batch_size", 4)]
        if out_dir.name == "timing":
            calls.append(("timing", name))
            return {"ms_per_step_median": left[name].pop(0)}, 5.0
        calls.append(("run", overrides))
        assert out_dir.name == f"run-{overrides.get('seed')}"
        val = {"a": 2.0, "b": 1.9, "c": 1.8}[name] + overrides.get("seed", 0) / 100
        return {"final_val_loss": val, "train_seconds": 11.0, "wall_seconds": 12.0, "tokens_per_second": 1000.0,
                "params": 1234}, 13.0

    monkeypatch.setattr(ablate, "run_train", run_train)
    monkeypatch.setattr(ablate, "time", types.SimpleNamespace(strftime=lambda fmt: "2025-01-02 03:04"))
    return calls


def test_ablate_turns_the_budget_into_steps_and_trains_every_seed(tmp_path, monkeypatch, capsys):
    """Timing: three interleaved rounds (a, b, c, a, b, c, ...). The budget, 2 s, becomes
    int(2000 ms / median ms): a 2000/25 = 80 steps (the mean, 28.3, would give 70; the first round's
    20 ms, 100), b 2000/26 = 76.9 -> 76 (a step count inside the budget, not rounded up to 77); c has
    its own steps = 7, which the budget does not override. Each run: the variant's overrides over
    the plan's (b's eval_iters 2 wins over the plan's 4), its seed, and max_iters, lr decay and the
    one eval at those steps; a log line every steps // 10 (at least 1). Rows are appended to --out
    (an earlier row stays) and printed."""
    calls = fake_ablation(monkeypatch)
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    out = tmp_path / "rows.jsonl"
    out.write_text('{"name": "an earlier run"}\n')
    assert ablate.main([str(plan), "--dataset=input.txt", "--seeds=3,5", f"--out={out}"]) == 0

    assert calls[:9] == [("timing", name) for _ in range(3) for name in "abc"]
    merged = {"a": {"eval_iters": 4, "n_layer": 1}, "b": {"eval_iters": 2, "n_layer": 1, "batch_size": 8},
              "c": {"eval_iters": 4, "n_layer": 1, "batch_size": 6}}
    steps, ms = {"a": 80, "b": 76, "c": 7}, {"a": 25.0, "b": 26.0, "c": 55.0}
    log_interval = {"a": 8, "b": 7, "c": 1}
    expected_runs = [("run", {**merged[n], "dataset": "input.txt", "seed": seed, "max_iters": steps[n],
                              "lr_decay_iters": steps[n], "eval_interval": steps[n], "log_interval": log_interval[n]})
                     for n in "abc" for seed in (3, 5)]
    assert calls[9:] == expected_runs
    rows = [{"name": n, "seed": seed, "overrides": merged[n], "steps": steps[n], "ms_per_step_timing_run": ms[n],
             "timings": TIMINGS[n], "final_val_loss": {"a": 2.0, "b": 1.9, "c": 1.8}[n] + seed / 100,
             "train_seconds": 11.0, "wall_seconds": 13.0, "tokens_per_second": 1000.0, "params": 1234,
             "time": "2025-01-02 03:04"} for n in "abc" for seed in (3, 5)]
    assert [json.loads(line) for line in out.read_text().splitlines()] == [{"name": "an earlier run"}, *rows]
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == rows


def test_ablate_only_runs_the_named_variants(tmp_path, monkeypatch):
    """--only=c,a times and trains a and c (in the plan's order), and nothing of b."""
    calls = fake_ablation(monkeypatch)
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    out = tmp_path / "rows.jsonl"
    assert ablate.main([str(plan), "--dataset=input.txt", "--seeds=1", f"--out={out}", "--only=c,a"]) == 0
    assert [c for c in calls if c[0] == "timing"] == [("timing", name) for _ in range(3) for name in "ac"]
    assert [json.loads(line)["name"] for line in out.read_text().splitlines()] == ["a", "c"]


def test_check_plan_refuses_true_as_a_step_count():
    """TOML's `steps = true` is a bool, which Python also counts as the int 1: a one-step variant."""
    plan = {"base": "configs/debug.toml", "variant": [{"name": "odd", "steps": True}]}
    with pytest.raises(ValueError, match="steps must be a positive integer, got True"):
        ablate.check_plan(plan)


def test_check_plan_checks_the_variants_overrides_over_the_plans():
    """A variant's overrides win over the plan's in the runs, so in the check too: a plan-wide n_head=5
    (debug.toml's 32 wide is not divisible by it) that the variant sets back to 4 is a valid run, and
    a variant's n_head=5 over a plan-wide 4 is not."""
    plan = {"base": "configs/debug.toml", "budget_seconds": 1.0, "overrides": {"n_head": 5},
            "variant": [{"name": "fixed", "overrides": {"n_head": 4}}]}
    ablate.check_plan(plan)
    plan = {**plan, "overrides": {"n_head": 4}, "variant": [{"name": "broken", "overrides": {"n_head": 5}}]}
    with pytest.raises(ValueError, match="variant 'broken': .*divisible by n_head=5"):
        ablate.check_plan(plan)


# --- benchmarks/summarize.py ------------------------------------------------------------------------

def rows_of(name: str, vals, train_s, wall_s, tok_s, steps: int, ms: float) -> list[dict]:
    return [{"name": name, "seed": i, "final_val_loss": v, "train_seconds": t, "wall_seconds": w,
             "tokens_per_second": k, "steps": steps, "ms_per_step_timing_run": ms}
            for i, (v, t, w, k) in enumerate(zip(vals, train_s, wall_s, tok_s, strict=True))]


# three seeds each, so that every mean differs from the median and from the first seed's value;
# "classic" comes first in the files but not in sorted order
CLASSIC = rows_of("classic", [1.50, 1.60, 1.90], [10, 11, 15], [20, 21, 25], [1000, 2000, 6000], 80, 25.0)
MUON = rows_of("+muon", [1.40, 1.45, 1.80], [9, 9, 12], [18, 19, 23], [1500, 1500, 4500], 70, 28.57)
HEADER = ["| variant | val (per seed) | mean | vs baseline | steps | ms/step | train s | wall s | tok/s |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]


def test_summarize_table_is_the_mean_over_seeds_of_every_column_in_file_order():
    """classic: val mean 5.0 / 3 = 1.6667 (median 1.6), train 12.0 s (median 11, first 10), wall 22.0 s,
    3,000 tok/s (median 2,000). +muon: 1.55 (median 1.45), 1.55 - 1.6667 = -0.1167 against the first
    variant in the file (sorted, +muon would come first and be the baseline)."""
    assert summarize.table(CLASSIC + MUON).splitlines() == [
        *HEADER,
        "| classic | 1.5000, 1.6000, 1.9000 | 1.6667 | +0.0000 | 80 | 25.0 | 12.0 | 22.0 | 3,000 |",
        "| +muon | 1.4000, 1.4500, 1.8000 | 1.5500 | -0.1167 | 70 | 28.6 | 10.0 | 20.0 | 2,500 |"]


def test_summarize_pools_rows_from_every_file_and_checks_the_baseline(tmp_path, capsys):
    """Two files (e.g. two machines' or two days' runs) make one table; --baseline names a variant of
    them or is refused with the names there are (not a KeyError); files without rows are refused."""
    first, second, empty = tmp_path / "1.jsonl", tmp_path / "2.jsonl", tmp_path / "empty.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in CLASSIC))
    second.write_text("\n" + "".join(json.dumps(r) + "\n" for r in MUON))  # a blank line is skipped
    empty.write_text("")
    assert summarize.main([str(first), str(second), "--baseline=+muon"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        *HEADER,
        "| classic | 1.5000, 1.6000, 1.9000 | 1.6667 | +0.1167 | 80 | 25.0 | 12.0 | 22.0 | 3,000 |",
        "| +muon | 1.4000, 1.4500, 1.8000 | 1.5500 | +0.0000 | 70 | 28.6 | 10.0 | 20.0 | 2,500 |"]
    for argv, message in [([str(first), "--baseline=muon"], "--baseline='muon' is not a variant in the files; "
                                                            "they have: ['classic']"),
                          ([str(empty)], "the files hold no rows")]:
        with pytest.raises(SystemExit) as exit_info:
            summarize.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {message}" in err and "Traceback" not in err


# --- benchmarks/nanogpt_exact_val.py ---------------------------------------------------------------------

# our parameter names -> nanoGPT's (its model.py), written out here rather than derived from the
# module's tables, so that a wrong entry there cannot agree with itself
OURS_TO_NANOGPT = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
                   "ln_f.weight": "transformer.ln_f.weight", "lm_head.weight": "lm_head.weight"}
BLOCK_TO_NANOGPT = {"ln_1.weight": "ln_1.weight", "attn.qkv.weight": "attn.c_attn.weight",
                    "attn.proj.weight": "attn.c_proj.weight", "ln_2.weight": "ln_2.weight",
                    "mlp.fc.weight": "mlp.c_fc.weight", "mlp.proj.weight": "mlp.c_proj.weight"}


def random_model(vocab_size: int) -> GPT:
    """A 2-layer GPT whose every parameter is random: same-shaped tensors (ln_1 and ln_2, say) differ,
    so a conversion that swaps them changes the model."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=16, attn_backend="sdpa"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.eval()


def nanogpt_state(model: GPT, prefix: str = "") -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("blocks."):
            _, layer, rest = name.split(".", 2)
            state[f"{prefix}transformer.h.{layer}.{BLOCK_TO_NANOGPT[rest]}"] = tensor.clone()
        else:
            state[prefix + OURS_TO_NANOGPT[name]] = tensor.clone()
    return state


def test_convert_maps_every_nanogpt_parameter_to_ours_and_refuses_biases():
    """Each nanoGPT tensor lands under our name for the same weight (random weights: ln_1 and ln_2,
    same shape, are told apart), nothing is left out, and a bias (bias=True models) is refused."""
    model = random_model(vocab_size=11)
    converted = nanogpt_exact_val.convert(nanogpt_state(model))
    ours = model.state_dict()
    assert sorted(converted) == sorted(ours)
    assert all(torch.equal(converted[name], ours[name]) for name in ours)
    with pytest.raises(ValueError, match=r"unknown nanoGPT parameter transformer\.h\.0\.attn\.c_attn\.bias"):
        nanogpt_exact_val.convert({"transformer.h.0.attn.c_attn.bias": torch.zeros(3)})


def nanogpt_checkpoint(path: Path, model: GPT, **model_args) -> None:
    """A checkpoint as nanoGPT's train.py saves one (a compiled model's names, best_val_loss a tensor)."""
    cfg = model.config
    args = dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size, bias=False,
                vocab_size=cfg.vocab_size, dropout=0.0) | model_args
    torch.save({"model": nanogpt_state(model, prefix="_orig_mod."), "optimizer": {}, "model_args": args,
                "iter_num": 250, "best_val_loss": torch.tensor(1.5), "config": {"dataset": "shakespeare_char"}}, path)


def test_nanogpt_exact_val_scores_the_checkpoints_weights_on_our_val_split(tmp_path, corpus_file, capsys):
    """The printed exact val loss is our exact_loss of the very weights in the checkpoint, over the val
    split in windows of the checkpoint's block size; nanoGPT's own figures are passed through."""
    corpus = load_corpus(str(corpus_file), tmp_path / "cache")
    model = random_model(corpus.tokenizer.vocab_size)
    ckpt = tmp_path / "ckpt.pt"
    nanogpt_checkpoint(ckpt, model)
    assert nanogpt_exact_val.main([str(ckpt), f"--dataset={corpus_file}", f"--cache_dir={tmp_path / 'cache'}"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = exact_loss(model, corpus.val.astype(np.int64), 16, 64, "cpu")
    assert result == {"ckpt": str(ckpt), "iter_num": 250, "nanogpt_best_val_estimate": 1.5,
                      "exact_val_loss": pytest.approx(expected, abs=1e-6)}
    # the model is far from uniform: a wrong window or split would move the loss by more than that
    assert abs(expected - math.log(corpus.tokenizer.vocab_size)) > 0.1


def test_nanogpt_exact_val_refuses_what_it_cannot_score(tmp_path, corpus_file):
    """A file torch cannot read, a model with biases, and a vocabulary that is not the dataset's: each a
    one-line error, not a traceback (or a load_state_dict shape error)."""
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    corpus = load_corpus(str(corpus_file), tmp_path / "cache")
    argv = [f"--dataset={corpus_file}", f"--cache_dir={tmp_path / 'cache'}"]
    with pytest.raises(SystemExit, match=f"error: cannot read {garbage}"):
        nanogpt_exact_val.main([str(garbage), *argv])
    ckpt = tmp_path / "ckpt.pt"
    nanogpt_checkpoint(ckpt, random_model(corpus.tokenizer.vocab_size), bias=True)
    with pytest.raises(SystemExit, match="error: only nanoGPT models with bias=False are converted"):
        nanogpt_exact_val.main([str(ckpt), *argv])
    nanogpt_checkpoint(ckpt, random_model(corpus.tokenizer.vocab_size + 1))
    with pytest.raises(SystemExit, match=f"error: the dataset has {corpus.tokenizer.vocab_size} symbols, "
                                         f"the checkpoint {corpus.tokenizer.vocab_size + 1}$"):
        nanogpt_exact_val.main([str(ckpt), *argv])



def nanogpt_meta(path: Path, chars: list[str]) -> Path:
    """A meta.pkl as nanoGPT's data/shakespeare_char/prepare.py writes one."""
    with open(path, "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                     "stoi": {c: i for i, c in enumerate(chars)}}, f)
    return path


def test_nanogpt_exact_val_checks_the_characters_of_nanogpts_meta(tmp_path, corpus_file, capsys):
    """--meta: nanoGPT's own vocabulary is accepted; the same characters in another order (as many
    symbols, so the size check passes) are refused, and so is a pickle that would call a function."""
    corpus = load_corpus(str(corpus_file), tmp_path / "cache")
    chars = corpus.tokenizer.chars
    ckpt = tmp_path / "ckpt.pt"
    nanogpt_checkpoint(ckpt, random_model(len(chars)))
    argv = [str(ckpt), f"--dataset={corpus_file}", f"--cache_dir={tmp_path / 'cache'}"]
    assert nanogpt_exact_val.main([*argv, f"--meta={nanogpt_meta(tmp_path / 'meta.pkl', chars)}"]) == 0
    assert "exact_val_loss" in json.loads(capsys.readouterr().out)
    swapped = nanogpt_meta(tmp_path / "swapped.pkl", [chars[1], chars[0], *chars[2:]])
    with pytest.raises(SystemExit, match=f"error: {swapped} maps ids to other characters"):
        nanogpt_exact_val.main([*argv, f"--meta={swapped}"])
    hostile = tmp_path / "hostile.pkl"
    hostile.write_bytes(pickle.dumps({"itos": math.sqrt}))  # names a global: must not be imported
    with pytest.raises(SystemExit, match=r"error: cannot read nanoGPT's vocabulary .*refusing to load math\.sqrt"):
        nanogpt_exact_val.main([*argv, f"--meta={hostile}"])
    with pytest.raises(SystemExit, match="error: cannot read nanoGPT's vocabulary"):
        nanogpt_exact_val.main([*argv, f"--meta={tmp_path / 'missing.pkl'}"])

# --- benchmarks/micro.py ------------------------------------------------------------------------------

def test_median_seconds_warms_up_then_takes_the_median_of_the_per_call_means(monkeypatch):
    """A fake clock that each call of fn advances: the warm-up (1000 s) is not timed; three repeats of
    two calls take 1+3, 4+4 and 10+20 s, means 2, 4 and 15, median 4 (8 without the division by
    `number`, 2 for the fastest)."""
    clock, durations = [0.0], iter([1000.0, 1.0, 3.0, 4.0, 4.0, 10.0, 20.0])
    monkeypatch.setattr(micro, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def fn():
        clock[0] += next(durations)

    assert micro.median_seconds(fn, repeats=3, number=2) == 4.0
    assert next(durations, None) is None  # exactly 1 + 3 * 2 calls


def fake_median(monkeypatch, seconds) -> list[tuple]:
    """Replace micro.median_seconds: call fn once (so that what it runs can be recorded), then return
    seconds(fn). Returns (repeats, number) of every call."""
    calls = []

    def median_seconds(fn, repeats=5, number=1):
        calls.append((repeats, number))
        fn()
        return seconds(fn)

    monkeypatch.setattr(micro, "median_seconds", median_seconds)
    return calls


def test_micro_figures_are_in_their_units_and_the_speedups_the_right_way_round(monkeypatch):
    """causal_mask: 25.7 us is 25.7 microseconds and 0.1 % of the 25.7 ms laptop step. Newton-Schulz:
    each dtype's time is that dtype's (recorded from orthogonalize's calls), speedup_bf16 = float32
    time / bfloat16 time (0.5: bf16 slower). TensorBoard: ratio = four events' time / one event's."""
    calls = fake_median(monkeypatch, lambda fn: 25.7e-6)
    result = micro.causal_mask_cost()
    assert calls == [(7, 2000)]
    assert result["microseconds"] == pytest.approx(25.7, rel=1e-12)
    assert result["share_of_25.7_ms_laptop_step"] == pytest.approx(1e-3, rel=1e-12)

    dtypes = []
    monkeypatch.setattr(micro, "orthogonalize", lambda g, dtype: dtypes.append(dtype))
    fake_median(monkeypatch, lambda fn: {torch.bfloat16: 4e-3, torch.float32: 2e-3}[dtypes[-1]])
    assert micro.newton_schulz_dtype() == {"comment": "training/muon.py orthogonalize: bfloat16 vs float32",
                                           "bfloat16_ms": 4.0, "float32_ms": 2.0, "speedup_bf16": 0.5}
    assert dtypes == [torch.bfloat16] * 2 + [torch.float32] * 2

    class FakeRunLog:
        def __init__(self, *args, **kwargs):
            self.writer = types.SimpleNamespace(add_scalar=lambda *args: None)

        def scalars(self, step, values):
            pass

        def close(self):
            pass

    import training.monitor

    monkeypatch.setattr(training.monitor, "RunLog", FakeRunLog)
    monkeypatch.setattr(micro, "render_attention", lambda *args, **kwargs: np.zeros((8, 16, 3), dtype=np.uint8))
    png = iter([1e-3, 6e-3])
    fake_median(monkeypatch, lambda fn: {"one_event": 1e-4, "four_events": 4e-4}.get(fn.__name__) or next(png))
    result = micro.tensorboard_writes(Path("unused"))
    assert result["one_event_us"] == pytest.approx(100.0, rel=1e-12)
    assert result["add_scalar_x4_us"] == pytest.approx(400.0, rel=1e-12)
    assert result["ratio"] == 4.0
    assert (result["png_level1_ms"], result["png_level6_ms"]) == (1.0, 6.0)


def test_micro_tokenizer_speedup_is_loop_time_over_vectorised_time(monkeypatch):
    """The speedup the tokenizer's comment quotes: the Python loop's time over encode_array's (50x
    here), not its inverse (0.02)."""
    times = iter([0.01, 0.5])  # encode_array first, then the loop
    monkeypatch.setattr(micro, "median_seconds", lambda fn, repeats=5, number=1: next(times))
    assert micro.tokenizer_speed()["speedup"] == 50.0


def test_micro_tensorboard_import_is_the_median_of_three_fresh_interpreters(monkeypatch):
    """Import time in three fresh interpreters (an import in this one would be cached): the median,
    0.7 s, not the first (0.9 s, the one most likely to pay for cold file caches)."""
    outputs, commands = iter(["0.9\n", "0.5\n", "0.7\n"]), []

    def run(cmd, capture_output, text, check):
        commands.append(cmd)
        return types.SimpleNamespace(stdout=next(outputs))

    monkeypatch.setattr(micro.subprocess, "run", run)
    assert micro.tensorboard_import()["seconds"] == 0.7
    assert len(commands) == 3 and all(c[:2] == [sys.executable, "-c"] for c in commands)


def test_micro_json_file_is_what_was_printed(tmp_path, monkeypatch, capsys):
    """--json gets exactly the printed text (one trailing newline), with every entry in its order;
    the measurements themselves are faked (they take minutes)."""
    for i, name in enumerate(["causal_mask_cost", "tokenizer_speed", "newton_schulz_dtype", "tensorboard_import",
                              "sample_threads", "attention_variants"]):
        monkeypatch.setattr(micro, name, lambda i=i: {"entry": i})
    monkeypatch.setattr(micro, "tensorboard_writes", lambda tmp: {"entry": "tb"})
    out = tmp_path / "micro.json"
    assert micro.main([f"--json={out}"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed)["entries"] == [{"entry": 0}, {"entry": 1}, {"entry": 2}, {"entry": 3},
                                             {"entry": "tb"}, {"entry": 4}, {"entry": 5}]
    assert out.read_text() == printed


# --- train.py: main()'s exit statuses, the checkpoint's state, summary.json ---------------------------

@pytest.mark.parametrize("error, status, message", [
    (ValueError("dataset='x' does not exist"), 1, "error: dataset='x' does not exist\n"),
    (FloatingPointError("the loss is not finite"), 1, "error: the loss is not finite\n"),
    # an hf: dataset without the datasets package, or the optional tensorboard missing
    (ImportError("hf: datasets need the datasets package"), 1, "error: hf: datasets need the datasets package\n"),
    # torchrun's rendezvous or a download that cannot connect
    (ConnectionError("cannot reach the rendezvous"), 1, "error: cannot reach the rendezvous\n"),
    (OSError(28, "No space left on device"), 1, "error: [Errno 28] No space left on device\n"),
    (KeyboardInterrupt(), 130, "interrupted: exited at once without saving; the last checkpoint is as it was\n"),
])
def test_main_turns_each_failure_into_one_line_and_its_exit_status(monkeypatch, capsys, error, status, message):
    """Every failure a user can cause or meet ends in one line on stderr and status 1 (130 for a
    Ctrl-C during set-up), never a traceback: an exception type missing from main's list escapes."""
    def fail(cfg, argv):
        raise error

    monkeypatch.setattr(train, "train", fail)
    assert train.main(["--device=cpu"]) == status
    assert capsys.readouterr().err == message


@pytest.mark.parametrize("interrupted, status", [(None, 0), ("SIGTERM", 143), ("SIGINT", 130)])
def test_main_exits_128_plus_the_signal_that_stopped_the_run(monkeypatch, interrupted, status):
    """A run that SIGTERM stopped (and saved) exits 143, as the shell reports a killed process, so that
    a scheduler or script can tell it from a finished run (0) and resubmit with --resume."""
    monkeypatch.setattr(train, "train", lambda cfg, argv: {"interrupted": interrupted})
    assert train.main(["--device=cpu"]) == status


@pytest.mark.parametrize("argv", [["-h"], ["--help"], ["configs/debug.toml", "--max_iters=5", "-h"]])
def test_main_prints_the_help_for_h_and_help_anywhere(monkeypatch, capsys, argv):
    """-h as well as --help, also after a config and overrides, prints the help and trains nothing."""
    monkeypatch.setattr(train, "train", lambda *args: pytest.fail("trained instead of printing the help"))
    assert train.main(argv) == 0
    text = capsys.readouterr().out
    assert text == help_text() + "\n"
    # string defaults quoted: an empty one reads '' rather than nothing at all
    assert "--dataset=str  (default: 'shakespeare_char')" in text and "--split=str  (default: '')" in text


def test_help_into_a_closed_pipe_is_a_quiet_success(monkeypatch):
    """`python train.py --help | head -1`: the reader leaves early; that is not an error of train.py
    (exit 0), and stdout is sent to /dev/null so that Python's flush at exit stays quiet."""
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    discarded = []
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    monkeypatch.setattr(train, "discard_stdout", lambda: discarded.append(True))
    assert train.main(["--help"]) == 0
    assert discarded == [True]


def test_rng_state_holds_the_global_the_batch_and_the_runs_own_cuda_stream(monkeypatch):
    """--resume restores these: the batch generator's own state (not the global one again) and, on
    CUDA, the state of the device the run trains on (cuda:1 here, not the default cuda:0), without
    which dropout on a GPU would not continue as the uninterrupted run does."""
    batch_gen = torch.Generator().manual_seed(123)
    state = train._rng_state(batch_gen, torch.device("cpu"))
    assert sorted(state) == ["batch", "torch"]
    assert torch.equal(state["torch"], torch.get_rng_state())
    assert torch.equal(state["batch"], batch_gen.get_state())
    assert not torch.equal(state["batch"], state["torch"])
    asked = []
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda device="cuda": asked.append(device) or torch.tensor([7], dtype=torch.uint8))
    state = train._rng_state(batch_gen, torch.device("cuda:1"))
    assert sorted(state) == ["batch", "cuda", "torch"] and state["cuda"].tolist() == [7]
    assert asked == [torch.device("cuda:1")]


def same(a, b) -> bool:
    """Equal nested dicts/lists whose leaves may be tensors (== on tensors is elementwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_checkpoint_state_holds_what_resume_and_sample_read(tmp_path, corpus_file):
    """Every field, each from its own source: the step as given (the number of steps taken), the
    optimizer's state (moments: without them a resumed run is a different run), the run's config and
    vocabulary, and a copy of the evals so far."""
    cfg = TrainConfig(dataset=str(corpus_file), cache_dir=str(tmp_path / "cache"), device="cpu", n_layer=1, n_head=2,
                      n_embd=16, block_size=16, batch_size=4)
    corpus = load_corpus(cfg.dataset, cfg.cache_dir)
    model = GPT(cfg.model_config(corpus.tokenizer.vocab_size))
    optimizer = configure_optimizer(model, cfg)
    model(torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 16, dtype=torch.long))[1].backward()
    optimizer.step()  # moments to save
    batch_gen = torch.Generator().manual_seed(5)
    history = [{"step": 0, "train_loss": 4.0, "val_loss": 4.1, "train_seconds": 0.0, "wall_seconds": 0.5}]
    state = train._checkpoint_state(model, optimizer, cfg, corpus, 7, 2.5, batch_gen, torch.device("cpu"), history)
    assert sorted(state) == ["best_val_loss", "config", "history", "model", "model_config", "optimizer", "rng",
                             "step", "vocab"]
    assert (state["step"], state["best_val_loss"], state["history"]) == (7, 2.5, history)
    assert state["config"] == cfg.to_dict() and state["model_config"] == model.config.to_dict()
    assert state["vocab"] == corpus.tokenizer.to_dict()
    assert same(state["model"], model.state_dict())
    assert same(state["optimizer"], optimizer.state_dict()) and state["optimizer"]["state"]  # moments, not {}
    assert torch.equal(state["rng"]["batch"], batch_gen.get_state())


def test_summary_json_holds_every_figure_of_the_run(tmp_path, monkeypatch):
    """A 5-step run through main, its clock faked: step i's batch takes 1, 2, 6, 3, 10 s and each eval
    0.5 s, nothing else takes time. So train_seconds = 22 (evals excluded), wall_seconds = 23 (evals
    included), ms/step median 3000 (the mean is 4400), tokens/s = 5 steps x 64 tokens / 22 s, MFU
    from the last log line at a 2 TFLOP/s peak. device and dtype "auto" are recorded as what they
    resolved to (cpu, float32 for this small model), never as "auto"; the best val estimate is the
    lowest (2.25), the last one the final eval's (2.5); no exact val was asked for (null). config.json
    records the command line the run came from."""
    clock, batch_seconds = [0.0], iter([1.0, 2.0, 6.0, 3.0, 10.0])
    estimates = iter([{"train": 3.0, "val": 2.25}, {"train": 2.0, "val": 2.5}])
    real_get_batch = train.get_batch

    def get_batch(*args, **kwargs):
        clock[0] += next(batch_seconds)
        return real_get_batch(*args, **kwargs)

    def estimate_loss(*args, **kwargs):
        clock[0] += 0.5
        return next(estimates)

    monkeypatch.setattr(train, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(train, "get_batch", get_batch)
    monkeypatch.setattr(train, "estimate_loss", estimate_loss)
    monkeypatch.setattr(train, "peak_memory_mb", lambda device: {"cpu_rss_mb": 512.0, "asked": str(device)})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # device=auto is the CPU, on any machine
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    out = tmp_path / "out"
    argv = [f"--dataset={write_corpus(tmp_path)}", f"--out_dir={out}", f"--cache_dir={tmp_path / 'cache'}",
            "--device=auto", "--dtype=auto", "--compile=false", "--n_layer=1", "--n_head=2", "--n_embd=16",
            "--block_size=16", "--batch_size=4", "--max_iters=5", "--eval_interval=5", "--log_interval=1",
            "--exact_val=false", "--tensorboard=false", "--peak_tflops=2"]
    assert train.main(argv) == 0

    summary = json.loads((out / "summary.json").read_text())
    cfg, _ = parse_args(argv)
    model = GPT(cfg.model_config(json.loads((out / "config.json").read_text())["vocab_size"]))
    tok_s = 5 * 64 / 22.0
    assert summary == {
        "best_val_loss": 2.25, "final_val_loss": None, "last_val_estimate": 2.5, "steps": 5, "steps_this_run": 5,
        "train_seconds": 22.0, "tokens_per_second": tok_s, "ms_per_step_median": 3000.0,
        "mfu": model.flops_per_token(16) * tok_s / 2e12, "wall_seconds": 23.0, "params": model.num_params(),
        "device": "cpu", "dtype": "float32", "peak_memory_mb": {"cpu_rss_mb": 512.0, "asked": "cpu"},
        "world_size": 1, "interrupted": None,
        "history": [{"step": 0, "train_loss": 3.0, "val_loss": 2.25, "train_seconds": 0.0, "wall_seconds": 0.5},
                    {"step": 5, "train_loss": 2.0, "val_loss": 2.5, "train_seconds": 22.0, "wall_seconds": 23.0}],
    }
    assert statistics.mean([1000.0, 2000.0, 6000.0, 3000.0, 10000.0]) != summary["ms_per_step_median"]
    facts = json.loads((out / "config.json").read_text())
    assert facts["run"]["argv"][1:] == argv and (facts["device"], facts["dtype"]) == ("cpu", "float32")


def test_summary_json_writes_non_finite_figures_as_null():
    """JSON has no NaN or Infinity (strict readers refuse Python's), at any depth."""
    value = {"a": [1.0, math.inf, {"b": -math.inf, "c": math.nan}], "d": "x", "e": 2, "f": None}
    assert train._json_safe(value) == {"a": [1.0, None, {"b": None, "c": None}], "d": "x", "e": 2, "f": None}


def test_ablate_refuses_a_budget_shorter_than_one_step_before_training_anything(tmp_path, monkeypatch):
    """0.01 s of budget at 25 ms per step is 0 steps: refused by name once the timings are known,
    before any variant trains (train.py would refuse max_iters=0 only after earlier variants ran)."""
    calls = fake_ablation(monkeypatch)
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN.replace("budget_seconds = 2.0", "budget_seconds = 0.01"))
    with pytest.raises(SystemExit, match=r"error: variant 'a': budget_seconds=0.01 is shorter than one step "
                                         r"\(25.0 ms\)"):
        ablate.main([str(plan), "--dataset=input.txt", "--seeds=1", f"--out={tmp_path / 'rows.jsonl'}"])
    assert all(kind == "timing" for kind, _ in calls)


def test_vs_nanogpt_summary_survives_runs_without_an_exact_val(tmp_path, monkeypatch):
    """--ours_args=--exact_val=false leaves final_val_loss_exact null in every run: the summary says
    null instead of dying on a median of Nones after all the runs, and peak RSS on macOS (bytes)
    comes out in MiB as on Linux (KiB)."""
    checkout = tmp_path / "nanoGPT"
    checkout.mkdir()
    (checkout / "train.py").write_text("")
    dataset = tmp_path / "input.txt"
    dataset.write_text("text")
    row = dict(wall_seconds=10.0, ms_per_step_median=5.0, peak_rss_mb=1.0, val_loss_estimate=2.0, final_step=5)
    monkeypatch.setattr(vs_nanogpt, "run_nanogpt",
                        lambda path, tmp, extra=(): {"program": "nanoGPT", "dtype": "float32", **row})
    monkeypatch.setattr(vs_nanogpt, "run_ours", lambda config, extra, data, tmp: {
        "program": f"ours:{config}", "dtype": "float32", **row, "final_val_loss_exact": None})
    out = tmp_path / "vs.json"
    assert vs_nanogpt.main([f"--nanogpt={checkout}", f"--dataset={dataset}", "--rounds=2", "--ours",
                            "configs/a.toml", "--ours_args=--exact_val=false", f"--json={out}"]) == 0
    assert json.loads(out.read_text())["ours:configs/a.toml"]["final_val_loss_exact"] is None

    monkeypatch.setattr(sys, "platform", "darwin")
    real_wait4 = vs_nanogpt.os.wait4
    monkeypatch.setattr(vs_nanogpt.os, "wait4", lambda pid, options: (
        *real_wait4(pid, options)[:2], types.SimpleNamespace(ru_maxrss=1536 * 2**20)))
    _, rss, rc = vs_nanogpt.timed([sys.executable, "-c", "pass"], tmp_path, tmp_path / "log")
    assert (rss, rc) == (1536.0, 0)
