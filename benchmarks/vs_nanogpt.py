"""Side by side with nanoGPT on this machine: the laptop recipe, alternating runs, one sitting.

    python benchmarks/vs_nanogpt.py --nanogpt=PATH --dataset=PATH/input.txt [--rounds=2] [--json=FILE]
        [--ours configs/shakespeare_char_cpu.toml "configs/shakespeare_char_cpu.toml --attn_backend=sdpa" ...]
        [--ours_args="--field=value ..."] [--gpu]

PATH is a nanoGPT checkout whose data/shakespeare_char/ has been prepared (its prepare.py, run on
the same input.txt). Nothing of nanoGPT is part of this project: this script only runs it, with
the command its README gives for a laptop:

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
        --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
        --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0

or, with --gpu, its GPU command (`python train.py config/train_shakespeare_char.py`: the baby GPT,
compiled, bf16) against `configs/shakespeare_char.toml` by default; both compile once in a warm-up
first, so every timed run finds its compile cache warm.

Every program runs as a fresh process, in turn (nanoGPT, then each of our configs, then again), so
drift in the machine's speed hits all alike. Reported per run: whole-process wall seconds, median ms per
training step (nanoGPT's per-iteration log lines; our per-step log), peak RSS of the process, and
the final and best val loss (nanoGPT's estimates over 20 batches, 200 on the GPU; ours exact over the
whole split, and our estimates too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NANOGPT_CMD = ("train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 "
               "--log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 "
               "--max_iters=2000 --lr_decay_iters=2000 --dropout=0.0")
NANOGPT_GPU_CMD = "train.py config/train_shakespeare_char.py"


def timed(cmd: list[str], cwd: Path, log: Path) -> tuple[float, float, int]:
    """Run cmd; returns (wall seconds, peak RSS in MB of that process, exit status)."""
    with open(log, "w") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    rss_unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, KiB on Linux
    return wall, usage.ru_maxrss * rss_unit / 2**20, proc.returncode


def run_nanogpt(path: Path, tmp: Path, extra: tuple[str, ...] = (), gpu: bool = False) -> dict:
    """Run nanoGPT's laptop (or GPU) command from its checkout at `path` (output under tmp, `extra` overrides
    last); returns its wall time, peak RSS, ms/step and final and best val estimates, parsed from its log."""
    log = tmp / "nanogpt.log"
    cmd = [sys.executable, *(NANOGPT_GPU_CMD if gpu else NANOGPT_CMD).split(), f"--out_dir={tmp / 'nanogpt_out'}"]
    wall, rss, rc = timed([*cmd, *extra], path, log)
    text = log.read_text()
    if rc != 0:
        raise RuntimeError(f"nanoGPT failed:\n{text[-2000:]}")
    iters = [(int(i), float(ms)) for i, ms in re.findall(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", text, re.M)]
    evals = re.findall(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)", text, re.M)
    return {"program": "nanoGPT", "dtype": "bfloat16" if gpu else "float32",  # its autocast is CUDA-only
            "wall_seconds": wall, "peak_rss_mb": rss,
            "ms_per_step_median": statistics.median(ms for i, ms in iters if i >= 10),
            "val_loss_estimate": float(evals[-1][2]), "best_val_estimate": min(float(e[2]) for e in evals),
            "final_step": int(evals[-1][0])}


def run_ours(config: str, extra: list[str], dataset: str, tmp: Path) -> dict:
    """One run of train.py on config; the figures from its summary.json."""
    out = tmp / "ours_out"
    cmd = [sys.executable, "train.py", config, f"--dataset={dataset}", f"--out_dir={out}", "--overwrite=true",
           *extra]  # logs as configured; the last round's run is replaced
    wall, rss, rc = timed(cmd, ROOT, tmp / "ours.log")
    if rc != 0:
        raise RuntimeError(f"ours failed:\n{(tmp / 'ours.log').read_text()[-2000:]}")
    s = json.loads((out / "summary.json").read_text())
    dtype = json.loads((out / "config.json").read_text())["dtype"]  # what dtype=auto chose on this machine
    return {"program": f"ours:{config}", "dtype": dtype, "wall_seconds": wall, "peak_rss_mb": rss,
            "ms_per_step_median": s["ms_per_step_median"], "val_loss_estimate": s["last_val_estimate"],
            "best_val_estimate": s["best_val_loss"],
            "final_val_loss_exact": s["final_val_loss"], "final_step": s["steps"]}


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nanogpt", required=True, type=Path,
                   help="a nanoGPT checkout whose data/shakespeare_char/ is prepared (prepare.py run)")
    p.add_argument("--dataset", required=True, help="the same text, input.txt, for our runs")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of every program; medians reported")
    p.add_argument("--gpu", action="store_true", help="nanoGPT's GPU command against our GPU config")
    p.add_argument("--ours", nargs="+", default=None,
                   help="our config(s) to run against nanoGPT, each optionally with its own overrides "
                        "(default: shakespeare_char_cpu.toml, or shakespeare_char.toml with --gpu)")
    p.add_argument("--ours_args", default="", help="extra --field=value overrides for our run")
    p.add_argument("--json", default=None, help="also write every run and the medians here")
    p.add_argument("--max_iters", type=int, default=None,
                   help="stop both programs after this many steps (the schedule stays the recipe's): more, "
                        "shorter rounds, for step times on a machine whose speed drifts")
    args = p.parse_args(argv)
    args.ours = args.ours or [f"configs/shakespeare_char{'' if args.gpu else '_cpu'}.toml"]
    if not (args.nanogpt / "train.py").is_file():
        p.error(f"--nanogpt={args.nanogpt}: no nanoGPT train.py there")
    if not Path(args.dataset).is_file():
        p.error(f"--dataset={args.dataset}: no such file")
    runs = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        extra = shlex.split(args.ours_args)
        short = (f"--max_iters={args.max_iters}",) if args.max_iters else ()
        extra += list(short)
        # warm up: the first process after a while pays for cold file caches
        first, *own = shlex.split(args.ours[0])
        run_ours(first, extra + own + ["--max_iters=5", "--exact_val=false"], args.dataset, tmp)
        if args.gpu:  # and nanoGPT's compile, so that neither program's timed runs compile cold
            run_nanogpt(args.nanogpt, tmp, ("--max_iters=10", "--eval_iters=2"), gpu=True)
        for r in range(args.rounds):
            jobs = [lambda: run_nanogpt(args.nanogpt, tmp, short, args.gpu)]
            # an entry is a config and its own overrides: "configs/x.toml --attn_backend=sdpa"
            jobs += [lambda c=c: {**run_ours(shlex.split(c)[0], extra + shlex.split(c)[1:], args.dataset, tmp),
                                  "program": f"ours:{c}"} for c in args.ours]
            for job in jobs:
                row = {"round": r, **job()}
                print(json.dumps(row), flush=True)
                runs.append(row)

    def med(prog: str, key: str) -> float | None:
        # None where no run has the figure (e.g. --ours_args=--exact_val=false): the summary must not
        # be lost to a TypeError after every run has finished
        values = [r[key] for r in runs if r["program"] == prog and r[key] is not None]
        return statistics.median(values) if values else None

    summary = {"machine": os.uname().machine, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
               "runs": runs, "nanoGPT": {k: med("nanoGPT", k) for k in ("wall_seconds", "ms_per_step_median",
                                                                        "peak_rss_mb", "val_loss_estimate",
                                                                        "best_val_estimate")}}
    for c in args.ours:
        prog = f"ours:{c}"
        summary[prog] = {
            "wall_seconds": med(prog, "wall_seconds"),
            "wall_ratio_vs_nanogpt": med(prog, "wall_seconds") / med("nanoGPT", "wall_seconds"),
            "step_throughput_ratio_vs_nanogpt": med("nanoGPT", "ms_per_step_median") / med(prog, "ms_per_step_median"),
            "ms_per_step_median": med(prog, "ms_per_step_median"),
            "peak_rss_mb": med(prog, "peak_rss_mb"),
            "final_val_loss_exact": med(prog, "final_val_loss_exact"),
            "best_val_estimate": med(prog, "best_val_estimate"),
        }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
