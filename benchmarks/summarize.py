"""Turn benchmarks/ablate.py's JSON lines into a markdown table (one row per variant, seeds pooled).

    python benchmarks/summarize.py benchmarks/ablations_cpu.jsonl [--baseline=NAME]

Columns: exact val loss per seed and their mean, the difference to the baseline's mean, steps in the
budget, median ms/step of the timing runs, mean training seconds and whole-process wall seconds.
"""

from __future__ import annotations

import json
import statistics
import sys


def table(rows: list[dict], baseline: str | None = None) -> str:
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
    paths = [a for a in argv if not a.startswith("--")]
    baseline = next((a.split("=", 1)[1] for a in argv if a.startswith("--baseline=")), None)
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    print(table(rows, baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
