"""Shared by train.py and sample.py: config, optimizers, evaluation, checkpoints, devices, logging."""

from .checkpoint import CKPT_NAME, load_checkpoint, model_from_checkpoint, save_checkpoint
from .config import TrainConfig, help_text, parse_args
from .evaluate import Stopped, estimate_loss, exact_loss
from .optim import configure_optimizers, lr_at, set_lr
from .runtime import resolve_device

__all__ = ["CKPT_NAME", "Stopped", "TrainConfig", "configure_optimizers", "estimate_loss", "exact_loss", "help_text",
           "load_checkpoint", "lr_at", "model_from_checkpoint", "parse_args", "resolve_device", "save_checkpoint",
           "set_lr"]
