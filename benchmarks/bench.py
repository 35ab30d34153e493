"""Benchmark a training config: ms/step, tokens/s, peak memory, MFU, time to a target val loss.

    python benchmarks/bench.py CONFIG.toml [--field=value ...] [--json=FILE] [--target_val=X]

Runs the real training loop (train.train) on the config with TensorBoard off, then prints one
JSON object and optionally writes it to --json. The run writes into a temporary directory that is
deleted afterwards, unless --out_dir is given: a benchmark must not replace the checkpoint a real
run of the same config left in its out_dir. Timing figures come from the loop's own clock:
evaluation is excluded from train_seconds and ms/step; wall_seconds is the whole process from
start-up (imports included) to the summary.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

T_PROCESS = time.perf_counter()  # before torch is imported: start-up counts in the wall time

from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402
from training import parse_args  # noqa: E402
from training.checkpoint import json_safe  # noqa: E402


def time_to_target(history: list[dict], target: float) -> dict | None:
    """The first evaluation whose val estimate is <= target: its step and the time taken to get there."""
    for h in history:
        if h["val_loss"] <= target:
            return {"step": h["step"], "train_seconds": h["train_seconds"], "wall_seconds": h["wall_seconds"]}
    return None


def main(argv: list[str] | None = None) -> int:
    """Command line: train.py's arguments plus --json and --target_val; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # not TrainConfig's defaults: a GPU-sized run, silent for minutes on a CPU
        print(f"error: give a config (or --field=value overrides) to benchmark\n{__doc__}", file=sys.stderr)
        return 2
    own = {"--json": None, "--target_val": None}
    rest = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in own:
            own[key] = value
        elif arg in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            rest.append(arg)
    target = None
    if own["--target_val"] is not None:  # checked now, not after a training run that may take minutes
        try:
            target = float(own["--target_val"])
        except ValueError:
            print(f"error: --target_val must be a number, got {own['--target_val']!r}", file=sys.stderr)
            return 2
    if own["--json"] is not None and not (own["--json"] and Path(own["--json"]).parent.is_dir()):
        print(f"error: --json={own['--json']}: give a file in an existing folder", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        if not any(a.split("=")[0] == "--out_dir" for a in rest):
            rest = rest + [f"--out_dir={tmp}"]
        try:
            cfg = parse_args(rest + ["--tensorboard=false"])
            summary = train.train(cfg, rest, verbose=False)
        except train.RUN_ERRORS as e:  # reported as train.py reports them
            print(f"error: {e}", file=sys.stderr)
            return 1
    result = {
        "config": {k: v for k, v in cfg.to_dict().items() if k not in ("dataset", "out_dir")},
        "device": summary["device"],
        "dtype": summary["dtype"],
        "steps": summary["steps_this_run"],
        "ms_per_step_median": summary["ms_per_step_median"],
        "ms_per_step_mean": 1000 * summary["train_seconds"] / max(1, summary["steps_this_run"]),
        "tokens_per_second": summary["tokens_per_second"],
        "train_seconds": summary["train_seconds"],  # compiling included: compile_seconds of it
        "compile_seconds": summary["compile_seconds"],
        "wall_seconds": time.perf_counter() - T_PROCESS,
        "peak_memory_mb": summary["peak_memory_mb"],
        "mfu": summary["mfu"],
        "final_val_loss": summary["final_val_loss"],
        "best_val_loss": summary["best_val_loss"],
        "params": summary["params"],
        "interrupted": summary["interrupted"],
        "history": summary["history"],  # per evaluation: step, estimates, seconds so far
    }
    if target is not None:
        result["target_val"] = target
        result["time_to_target"] = time_to_target(summary["history"], target)
    text = json.dumps(json_safe(result), indent=2)  # an interrupted run's best val is inf: null in JSON
    print(text)
    if own["--json"]:
        Path(own["--json"]).write_text(text + "\n")
    return train.exit_code(summary["interrupted"]) if summary["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
