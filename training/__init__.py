"""What train.py and sample.py share: the config, optimizers and schedule, evaluation, checkpoints,
devices, logging; and, for train.py, faults (signals, non-finite losses) and torchrun (distributed.py)."""

from .checkpoint import CKPT_NAME, load_checkpoint, model_from_checkpoint, save_checkpoint
from .config import TrainConfig, help_text, parse_args
from .evaluate import Stopped, estimate_loss, exact_loss
from .optim import configure_optimizers, lr_at, set_lr
from .runtime import autocast_context, resolve_device, resolve_dtype

__all__ = ["CKPT_NAME", "Stopped", "TrainConfig", "autocast_context", "configure_optimizers", "estimate_loss",
           "exact_loss", "help_text", "load_checkpoint", "lr_at", "model_from_checkpoint", "parse_args",
           "resolve_device", "resolve_dtype", "save_checkpoint", "set_lr"]
