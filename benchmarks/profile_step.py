"""Where one eager training step of a recipe goes on this machine, by kind of operator.

    python benchmarks/profile_step.py [CONFIG.toml] [--steps=20] [--field=value ...]

Runs train.py's step (train.train_step: batch, forward, backward, clip, optimizer) on the recipe's model, 20
warm-up steps, then `--steps` under torch.profiler. Prints ms per step by the clock, and the operators' self CPU
time grouped as matmuls, attention's softmax, elementwise, norms, optimizer and copies; the clock minus these
(aten) operators is Python, dispatch and the autograd engine.
"""

from __future__ import annotations

import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from training import parse_args  # noqa: E402

GROUPS = [("matmuls", r"mm|addmm|bmm|baddbmm|linear|matmul"), ("softmax", r"softmax"),
          ("norms (LayerNorm, clip)", r"layer_norm|norm"), ("optimizer", r"_fused_adamw|adam|foreach"),
          ("copies, gathers, views", r"copy|index|cat|clone|contiguous|to_copy|fill|zero|empty"),
          ("elementwise (GELU, dropout, add, ...)", r".")]


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    given = next((a.split("=")[1] for a in argv if a.startswith("--steps=")), "20")
    if not given.isdigit() or int(given) < 1:
        print(f"error: --steps={given}: give a whole number of steps >= 1", file=sys.stderr)
        return 2
    steps = int(given)
    argv = [a for a in argv if not a.startswith("--steps=")]
    if not argv or argv[0].startswith("--"):
        argv = [str(ROOT / "configs" / "shakespeare_char_cpu.toml"), *argv]
    with tempfile.TemporaryDirectory(prefix="profile_step-") as out:  # set_up writes config.json there; steps don't
        cfg = parse_args([*argv, "--tensorboard=false", "--compile=false", f"--out_dir={out}",
                          f"--max_iters={steps + 20}"])
        run = train.set_up(cfg, train.init_distributed({}, cfg.device), train.RunGuard(f"{out}/ckpt.pt", False, False),
                           [], False, time.perf_counter(), None)
    for step in range(20):
        train.train_step(run, step)
    times = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for step in range(steps):
            t0 = time.perf_counter()
            train.train_step(run, step)
            times.append(time.perf_counter() - t0)
    ms = 1000 * statistics.median(times)
    per_group: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):  # autograd nodes, Optimizer.step: bookkeeping, in the remainder
            continue
        group = next(g for g, pattern in GROUPS if re.search(pattern, event.key.removeprefix("aten::")))
        per_group[group] += event.self_cpu_time_total / 1000 / steps  # ms per step
    ops = sum(per_group.values())
    print(f"{cfg.n_layer}x{cfg.n_head}x{cfg.n_embd}, batch {cfg.batch_size}x{cfg.block_size}, {run.cfg.dtype}: "
          f"{ms:.1f} ms a step by the clock (median of {steps}, profiled), operators {ops:.1f} ms")
    for group, t in sorted(per_group.items(), key=lambda kv: -kv[1]):
        print(f"  {group:40s} {t:6.1f} ms  {100 * t / ms:4.0f} %")
    print(f"  {'Python, dispatch, autograd engine':40s} {ms - ops:6.1f} ms  {100 * (ms - ops) / ms:4.0f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
