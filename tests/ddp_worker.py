"""train.py's main under torchrun, recording what this rank does (for test_ddp.py).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/ddp_worker.py [train.py args]

Each rank writes to $BATCH_LOG_DIR/rank{RANK}.pt the (x, y) of every training micro-batch, in order
(so a test can replay exactly what the ranks saw in one process), and how often it called the
evaluation and checkpoint functions (which only rank 0 may do).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402


def main() -> int:
    batches = []
    draw = train.get_batch

    def recording_get_batch(*args, **kwargs):
        x, y = draw(*args, **kwargs)
        batches.append((x.clone(), y.clone()))
        return x, y

    train.get_batch = recording_get_batch  # train.py's own name: training batches only, not eval ones
    calls = {name: 0 for name in ("estimate_loss", "exact_loss", "save_checkpoint")}
    for name in calls:
        setattr(train, name, _counted(getattr(train, name), name, calls))
    rc = train.main(sys.argv[1:])
    torch.save({"batches": batches, "calls": calls}, Path(os.environ["BATCH_LOG_DIR"]) / f"rank{os.environ['RANK']}.pt")
    return rc


def _counted(fn, name: str, calls: dict[str, int]):
    def counted(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return counted


if __name__ == "__main__":
    sys.exit(main())
