"""DDP under torchrun: rank 0 alone logs, evaluates and writes; ranks share the micro-batches."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .runtime import resolve_device

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


@dataclass(frozen=True, kw_only=True)
class Dist:
    """Rank `rank` of `world_size` (a plain run is rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    enabled: bool = False  # a process group exists

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, evaluates and writes."""
        return self.rank == 0

    def micro_steps(self, gradient_accumulation_steps: int) -> int:
        """This rank's micro-batches per optimizer step; refuses a count the ranks cannot share."""
        steps, n = gradient_accumulation_steps, self.world_size
        if steps % n:
            raise ValueError(f"gradient_accumulation_steps={steps} cannot be split across {n} processes: use a "
                             f"multiple of {n}, e.g. --gradient_accumulation_steps={-(-steps // n) * n}")
        return steps // n

    def seed(self, seed: int, step: int = 0) -> int:
        """This rank's seed for a run (re)started at `step` (checkpoints hold rank 0's RNG only)."""
        return seed + self.rank + self.world_size * step

    def wrap(self, module: nn.Module) -> nn.Module:
        """module in DDP when distributed (save the unwrapped one)."""
        if not self.enabled:
            return module
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(module, device_ids=device_ids)


def launched_by_torchrun(env: Mapping[str, str]) -> bool:
    """Whether env holds the variables torchrun sets for each process."""
    return all(name in env for name in LAUNCH_VARS)


def init_distributed(env: Mapping[str, str], device_name: str) -> Dist:
    """Join torchrun's process group (NCCL on cuda:LOCAL_RANK, else gloo) if launched by it."""
    device = resolve_device(device_name)
    if not launched_by_torchrun(env):
        return Dist(device=device)
    rank, local_rank, world_size = (int(env[name]) for name in LAUNCH_VARS)
    if device_name.startswith("cuda:"):
        raise ValueError(f"{device_name!r}: under torchrun each process uses cuda:LOCAL_RANK; use --device=cuda")
    if device.type == "mps":
        if device_name != "auto":
            raise ValueError("device='mps' cannot run distributed (NCCL and gloo lack it); use --device=cpu")
        device = torch.device("cpu")
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} CUDA "
                             "devices: start at most that many processes per node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    cuda = device.type == "cuda"
    torch.distributed.init_process_group(backend="nccl" if cuda else "gloo", device_id=device if cuda else None)
    return Dist(rank=rank, world_size=world_size, device=device, enabled=True)


def close_distributed(info: Dist) -> None:
    """Destroy the process group init_distributed made, if any."""
    if info.enabled and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
