"""DistributedDataParallel under torchrun: process-group set-up and teardown, and rank helpers.

`torchrun --nproc_per_node=N train.py CONFIG` starts N copies of train.py with RANK, LOCAL_RANK and
WORLD_SIZE in their environment; `python train.py` has none of them and never creates a process group.
Every rank trains the same model on its own batches; DDP averages the gradients across ranks in the
backward of the last micro-batch of each step, so the ranks' weights stay identical. Only rank 0
logs, evaluates and writes files, without collectives, while the others wait in the next all-reduce.

The global batch stays what the config says: batch_size * gradient_accumulation_steps sequences per
optimizer step, of which each rank runs gradient_accumulation_steps / WORLD_SIZE micro-batches.
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
    enabled: bool = False  # a process group exists (launched by torchrun)

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, evaluates and writes files."""
        return self.rank == 0

    def micro_steps(self, gradient_accumulation_steps: int) -> int:
        """Micro-batches this rank runs per optimizer step, keeping the global batch as configured.

        Raises:
            ValueError: gradient_accumulation_steps is not a multiple of the number of processes.
        """
        if gradient_accumulation_steps % self.world_size:
            n = self.world_size
            raise ValueError(
                f"gradient_accumulation_steps={gradient_accumulation_steps} cannot be split across {n} "
                f"processes: each optimizer step takes batch_size * gradient_accumulation_steps sequences "
                f"in total, gradient_accumulation_steps / {n} micro-batches per process. Use a multiple "
                f"of {n}, e.g. --gradient_accumulation_steps={-(-gradient_accumulation_steps // n) * n}"
            )
        return gradient_accumulation_steps // self.world_size

    def seed(self, seed: int, step: int = 0) -> int:
        """Seed of this rank's batch generator (and, for ranks > 0, its dropout) for a run (re)started
        at `step`: `seed` itself on rank 0 of a fresh run (so one process draws what it always drew),
        seed + rank on the others, and a fresh stream per restart for ranks whose state a checkpoint
        does not hold (a checkpoint holds rank 0's)."""
        return seed + self.rank + self.world_size * step

    def wrap(self, module: nn.Module) -> nn.Module:
        """DDP around module when distributed (the module itself otherwise).

        Checkpoints must come from the unwrapped model, never from this wrapper (no "module." prefix).
        """
        if not self.enabled:
            return module
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)

    def sync_gradients(self, model: nn.Module, last_micro_step: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward and backward: DDP all-reduces the gradients only on
        the last micro-batch of a step (model.no_sync() on the others); a no-op when not distributed."""
        if self.enabled and not last_micro_step:
            return model.no_sync()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def rank_zero_first(self) -> Iterator[None]:
        """Run the body on rank 0 first, then on the others (e.g. rank 0 fills a cache they then read).

        If rank 0 fails inside, the others stay in the barrier until torchrun stops them.
        """
        import torch.distributed as dist

        if self.enabled and not self.is_main:
            dist.barrier()
        yield
        if self.enabled and self.is_main:
            dist.barrier()


def launched_by_torchrun(env: Mapping[str, str]) -> bool:
    """True when env carries the variables torchrun sets for each process it starts."""
    return all(name in env for name in LAUNCH_VARS)


def init_distributed(env: Mapping[str, str], device_name: str) -> Dist:
    """Join torchrun's process group when launched by it; otherwise a single process on the device.

    Under torchrun: NCCL on CUDA (each process on cuda:LOCAL_RANK), gloo on CPU. Every check that
    can fail (device, ranks vs GPUs) runs before the process group is created.

    Args:
        env: the process environment (os.environ).
        device_name: the config's device: auto, cpu, cuda, cuda:N or mps.
    Returns:
        Dist; call close_distributed(dist) when done.
    Raises:
        ValueError: the device is not available, or does not fit a distributed run.
    """
    if not launched_by_torchrun(env):
        return Dist(device=resolve_device(device_name))
    rank, local_rank, world_size = (int(env[name]) for name in LAUNCH_VARS)
    device = resolve_device(device_name)
    if device_name.startswith("cuda:"):
        raise ValueError(f"device={device_name!r}: under torchrun each process uses cuda:LOCAL_RANK; "
                         "pass --device=cuda (or auto)")
    if device.type == "mps":
        if device_name != "auto":
            raise ValueError("device='mps' cannot run distributed (neither NCCL nor gloo supports it); "
                             "use --device=cpu")
        device = torch.device("cpu")  # auto picked MPS, which DDP cannot use: gloo on the CPU instead
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} "
                             "CUDA devices: start at most that many processes per node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    import torch.distributed as dist

    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                            **({"device_id": device} if device.type == "cuda" else {}))
    return Dist(rank=rank, local_rank=local_rank, world_size=world_size, device=device, enabled=True)


def close_distributed(dist_info: Dist) -> None:
    """Leave the process group, if this process joined one."""
    import torch.distributed as dist

    if dist_info.enabled and dist.is_initialized():
        dist.destroy_process_group()
