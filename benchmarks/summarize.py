"""Turn benchmarks/ablate.py's JSON lines into a markdown table (one row per variant, seeds pooled).

    python benchmarks/summarize.py benchmarks/ablations_cpu.jsonl [--baseline=NAME]

Columns: exact val loss per seed and their mean, the difference to the baseline's mean, steps in the
budget, median ms/step of the timing runs, mean training seconds and whole-process wall seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import os  # noqa: E402


def table(rows: list[dict], baseline: str | None = None) -> str:
    """ablate.py rows as a markdown table, one line per variant: val per seed, mean, difference to
    the baseline's mean (the first variant unless named), steps, ms/step, and the mean train
    seconds, wall seconds and tokens/s."""
    names = list(dict.fromkeys(r["name"] for r in rows))
    by = {n: [r for r in rows if r["name"] == n] for n in names}
    base = statistics.mean(r["final_val_loss"] for r in by[baseline or names[0]])
    lines = ["| variant | val (per seed) | mean | vs baseline | steps | ms/step | train s | wall s | tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n in names:
        rs = by[n]
        vals = [r["final_val_loss"] for r in rs]
        mean = statistics.mean(vals)
        lines.append(
            f"| {n} | {', '.join(f'{v:.4f}' for v in vals)} | {mean:.4f} | {mean - base:+.4f} | {rs[0]['steps']} | "
            f"{rs[0]['ms_per_step_timing_run']:.1f} | {statistics.mean(r['train_seconds'] for r in rs):.1f} | "
            f"{statistics.mean(r['wall_seconds'] for r in rs):.1f} | "
            f"{statistics.mean(r['tokens_per_second'] for r in rs):,.0f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Command line (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("jsonl", nargs="+", help="ablate.py output files (JSON lines)")
    p.add_argument("--baseline", default=None, help="variant the 'vs baseline' column compares with "
                   "(default: the first one)")
    args = p.parse_args(argv)
    rows = []
    for path in args.jsonl:
        try:
            with open(path) as f:
                rows += [json.loads(line) for line in f if line.strip()]
        except (OSError, json.JSONDecodeError) as e:
            p.error(f"{path}: {e}")
    names = {r["name"] for r in rows}
    if not rows:
        p.error("the files hold no rows")
    if args.baseline is not None and args.baseline not in names:
        p.error(f"--baseline={args.baseline!r} is not a variant in the files; they have: {sorted(names)}")
    try:
        print(table(rows, args.baseline))
    except BrokenPipeError:  # `summarize.py ... | head`: the reader went away
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
