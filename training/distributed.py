"""DistributedDataParallel under torchrun: joining and leaving the process group, and rank helpers.

`torchrun --nproc_per_node=N train.py CONFIG` starts N copies with RANK, LOCAL_RANK and WORLD_SIZE set;
`python train.py` has none of them and never creates a process group. Each rank trains on its own
batches; DDP averages the gradients in the backward of each step's last micro-batch. Only rank 0
logs, evaluates and writes files, while the others wait in the next all-reduce. The global batch is
what the config says: each rank runs gradient_accumulation_steps / WORLD_SIZE micro-batches per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .runtime import resolve_device

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


@dataclass(frozen=True, kw_only=True)
class Dist:
    """Where this process stands: rank `rank` of `world_size` (a plain run is rank 0 of 1)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    enabled: bool = False  # a process group exists

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, evaluates and writes files."""
        return self.rank == 0

    def micro_steps(self, gradient_accumulation_steps: int) -> int:
        """Micro-batches this rank runs per optimizer step; refuses a count the ranks cannot share."""
        n = self.world_size
        if gradient_accumulation_steps % n:
            raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} cannot be split across {n} "
                             f"processes (each runs gradient_accumulation_steps / {n} micro-batches per step): use "
                             f"a multiple of {n}, e.g. --gradient_accumulation_steps="
                             f"{-(-gradient_accumulation_steps // n) * n}")
        return gradient_accumulation_steps // n

    def seed(self, seed: int, step: int = 0) -> int:
        """The batch (and, past rank 0, dropout) seed of this rank for a run (re)started at `step`: a fresh
        stream per rank and restart, since a checkpoint holds rank 0's streams only."""
        return seed + self.rank + self.world_size * step

    def wrap(self, module: nn.Module) -> nn.Module:
        """DDP around module when distributed (checkpoints always come from the unwrapped module)."""
        if not self.enabled:
            return module
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def sync_gradients(self, model: nn.Module, last_micro_step: bool) -> contextlib.AbstractContextManager:
        """One micro-batch's forward and backward: DDP all-reduces on the step's last one only."""
        return model.no_sync() if self.enabled and not last_micro_step else contextlib.nullcontext()

    @contextlib.contextmanager
    def rank_zero_first(self) -> Iterator[None]:
        """The body on rank 0 first, then on the others."""
        import torch.distributed as dist

        if self.enabled and not self.is_main:
            dist.barrier()
        yield
        if self.enabled and self.is_main:
            dist.barrier()


def launched_by_torchrun(env: Mapping[str, str]) -> bool:
    """True when env carries the variables torchrun sets for each process."""
    return all(name in env for name in LAUNCH_VARS)


def init_distributed(env: Mapping[str, str], device_name: str) -> Dist:
    """Join torchrun's process group when launched by it (NCCL on cuda:LOCAL_RANK, gloo on the CPU),
    else a single process on the device. Every check runs before the group is created."""
    device = resolve_device(device_name)
    if not launched_by_torchrun(env):
        return Dist(device=device)
    rank, local_rank, world_size = (int(env[name]) for name in LAUNCH_VARS)
    if device_name.startswith("cuda:"):
        raise ValueError(f"device={device_name!r}: under torchrun each process uses cuda:LOCAL_RANK; "
                         "pass --device=cuda (or auto)")
    if device.type == "mps":
        if device_name != "auto":
            raise ValueError("device='mps' cannot run distributed (neither NCCL nor gloo supports it); use "
                             "--device=cpu")
        device = torch.device("cpu")
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} CUDA "
                             "devices: start at most that many processes per node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    import torch.distributed as dist

    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                            **({"device_id": device} if device.type == "cuda" else {}))
    return Dist(rank=rank, local_rank=local_rank, world_size=world_size, device=device, enabled=True)


def close_distributed(info: Dist) -> None:
    """Leave the process group, if this process joined one."""
    import torch.distributed as dist

    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
