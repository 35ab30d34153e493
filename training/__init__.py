"""What train.py and sample.py share: the config, optimizer and schedule, evaluation,
checkpoints, device selection and run logging; and, for train.py, fault handling (faults.py) and
multi-process training under torchrun (distributed.py)."""

from .checkpoint import (
    CKPT_NAME,
    check_resumable,
    load_checkpoint,
    model_from_checkpoint,
    remove_partial_saves,
    save_checkpoint,
)
from .config import TrainConfig, help_text, parse_args
from .evaluate import estimate_loss, exact_loss
from .optim import configure_optimizer, lr_at, set_lr
from .runtime import (
    autocast_context,
    discard_stdout,
    peak_flops,
    peak_memory_mb,
    resolve_device,
    resolve_dtype,
    run_facts,
)

__all__ = [
    "CKPT_NAME",
    "TrainConfig",
    "autocast_context",
    "check_resumable",
    "configure_optimizer",
    "discard_stdout",
    "estimate_loss",
    "exact_loss",
    "help_text",
    "load_checkpoint",
    "lr_at",
    "peak_flops",
    "peak_memory_mb",
    "model_from_checkpoint",
    "parse_args",
    "remove_partial_saves",
    "resolve_device",
    "resolve_dtype",
    "run_facts",
    "save_checkpoint",
    "set_lr",
]
