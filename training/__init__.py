"""What train.py and sample.py share: the config, optimizer and schedule, evaluation,
checkpoints, device selection and run logging."""

from .checkpoint import CKPT_NAME, load_checkpoint, model_from_checkpoint, save_checkpoint
from .config import TrainConfig, help_text, parse_args
from .evaluate import estimate_loss, exact_loss
from .optim import configure_optimizer, lr_at, set_lr
from .runtime import autocast_context, peak_flops, peak_memory_mb, resolve_device, resolve_dtype, run_facts

__all__ = [
    "CKPT_NAME",
    "TrainConfig",
    "autocast_context",
    "configure_optimizer",
    "estimate_loss",
    "exact_loss",
    "help_text",
    "load_checkpoint",
    "lr_at",
    "peak_flops",
    "peak_memory_mb",
    "model_from_checkpoint",
    "parse_args",
    "resolve_device",
    "resolve_dtype",
    "run_facts",
    "save_checkpoint",
    "set_lr",
]
