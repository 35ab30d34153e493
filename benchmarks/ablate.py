"""Ablations at a fixed wall-clock training budget: one change at a time, several seeds.

    python benchmarks/ablate.py PLAN.toml --dataset=PATH [--seeds=1,2] [--out=FILE.jsonl] [--only=NAME,...]

A plan names a base config, a training budget in seconds and the variants (config overrides):

    base = "configs/shakespeare_char_cpu.toml"
    budget_seconds = 16.0
    [[variant]]
    name = "baseline"
    [[variant]]
    name = "+muon"
    overrides = { optimizer = "muon" }

Each variant is first timed (short runs, median ms/step, variants interleaved over
timing_rounds rounds), and the budget becomes its number of steps: steps = budget / (ms/step),
with the lr schedule spread over exactly those steps. Then each seed trains in a fresh process and
the exact val loss is recorded. Converting time to steps once
keeps the loss figures deterministic (a busy machine changes timings, not losses); the timing run
should be done on a quiet machine. Every run appends one JSON line to --out.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from training.config import TrainConfig, load_toml  # noqa: E402


def _args(overrides: dict) -> list[str]:
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()]


def check_plan(plan: dict) -> None:
    """Raise ValueError naming the first variant whose config (base file + plan overrides + its own)
    is not a valid TrainConfig: a misspelt or retired option fails here, before minutes of timing
    runs, instead of in the middle of the plan."""
    for key in ("base", "variant"):
        if key not in plan:
            raise ValueError(f"the plan has no {key!r}")
    base = load_toml(ROOT / plan["base"])
    for variant in plan["variant"]:
        if "name" not in variant:
            raise ValueError(f"a variant has no name: {variant}")
        if "steps" not in variant and "budget_seconds" not in plan:
            raise ValueError(f"variant {variant['name']!r} has no steps and the plan no budget_seconds")
        steps = variant.get("steps", 1)
        if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
            raise ValueError(f"variant {variant['name']!r}: steps must be a positive integer, got {steps!r}")
        overrides = {**plan.get("overrides", {}), **variant.get("overrides", {})}
        unknown = sorted(set(overrides) - set(TrainConfig.__dataclass_fields__))
        try:
            if unknown:
                raise ValueError(f"unknown config key {unknown[0]!r} (not a field of train.py's config)")
            TrainConfig(**{**base, **overrides})
        except ValueError as e:
            raise ValueError(f"variant {variant['name']!r}: {e}") from None


def run_train(base: str, overrides: dict, out_dir: Path) -> tuple[dict, float]:
    """Train in a fresh process; returns (summary.json, whole-process wall seconds)."""
    cmd = [sys.executable, "train.py", base, *_args(overrides), f"--out_dir={out_dir}", "--tensorboard=false",
           "--overwrite=true"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads((out_dir / "summary.json").read_text()), wall


def ms_per_step(base: str, overrides: dict, dataset: str, tmp: Path, steps: int = 80) -> float:
    """Median ms per training step of a variant, from a short run with a log line every step."""
    timing = {**overrides, "dataset": dataset, "max_iters": steps, "lr_decay_iters": steps, "log_interval": 1,
              "eval_interval": steps, "eval_iters": 1, "exact_val": False}
    summary, _ = run_train(base, timing, tmp / "timing")
    return summary["ms_per_step_median"]


def main(argv: list[str]) -> int:
    """Command line (see the module docstring); returns the exit status."""
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    opts = {"--dataset": None, "--seeds": "1,2", "--out": "benchmarks/ablations.jsonl", "--only": None}
    plan_path = None
    for arg in argv:
        key, eq, value = arg.partition("=")
        if key in opts and eq:
            opts[key] = value
        elif plan_path is None and not arg.startswith("--"):
            plan_path = arg
        else:
            raise SystemExit(f"unexpected argument {arg!r}\n{__doc__}")
    if plan_path is None or opts["--dataset"] is None:
        raise SystemExit(__doc__)
    if Path(opts["--dataset"]).exists():  # a path of the caller's folder: the runs start in the repository
        opts["--dataset"] = str(Path(opts["--dataset"]).resolve())
    try:
        plan = tomllib.loads(Path(plan_path).read_text())
        check_plan(plan)
    except (OSError, tomllib.TOMLDecodeError, ValueError) as e:
        raise SystemExit(f"error: plan {plan_path}: {e}") from None
    try:
        seeds = [int(s) for s in opts["--seeds"].split(",")]
    except ValueError:
        raise SystemExit(f"error: --seeds={opts['--seeds']!r} is not a comma-separated list of integers") from None
    names = [v["name"] for v in plan["variant"]]
    only = set(opts["--only"].split(",")) if opts["--only"] else None
    if only and only - set(names):
        raise SystemExit(f"error: --only names {sorted(only - set(names))}, not variants of {plan_path}; "
                         f"it has: {names}")
    out = Path(opts["--out"])
    variants = [v for v in plan["variant"] if not only or v["name"] in only]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        # time every variant first, in interleaved rounds, and take each one's median: a drift in
        # the machine's speed then spreads over all variants instead of biasing one
        timings: dict[str, list[float]] = {v["name"]: [] for v in variants}
        for _ in range(int(plan.get("timing_rounds", 3))):
            for variant in variants:
                overrides = {**plan.get("overrides", {}), **variant.get("overrides", {})}
                timings[variant["name"]].append(ms_per_step(plan["base"], overrides, opts["--dataset"], tmp))
        budget: dict[str, tuple[float, int]] = {}  # name -> (median ms/step, steps), all known before training
        for variant in variants:
            ms = statistics.median(timings[variant["name"]])
            steps = variant["steps"] if "steps" in variant else int(plan["budget_seconds"] * 1000 / ms)
            if steps < 1:
                raise SystemExit(f"error: variant {variant['name']!r}: budget_seconds={plan['budget_seconds']} is "
                                 f"shorter than one step ({ms:.1f} ms)")
            budget[variant["name"]] = ms, steps
        for variant in variants:
            overrides = {**plan.get("overrides", {}), **variant.get("overrides", {})}
            ms, steps = budget[variant["name"]]
            for seed in seeds:
                run = {**overrides, "dataset": opts["--dataset"], "seed": seed, "max_iters": steps,
                       "lr_decay_iters": steps, "eval_interval": steps, "log_interval": max(1, steps // 10)}
                summary, wall = run_train(plan["base"], run, tmp / f"run-{seed}")
                row = {"name": variant["name"], "seed": seed, "overrides": overrides, "steps": steps,
                       "ms_per_step_timing_run": ms, "timings": timings[variant["name"]],
                       "final_val_loss": summary["final_val_loss"],
                       "train_seconds": summary["train_seconds"], "wall_seconds": wall,
                       "tokens_per_second": summary["tokens_per_second"], "params": summary["params"],
                       "time": time.strftime("%Y-%m-%d %H:%M")}
                print(json.dumps(row), flush=True)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
