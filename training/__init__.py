"""Shared by train.py and sample.py: config, optimizers, evaluation, checkpoints, devices, logging."""

from .checkpoint import CKPT_NAME, load_checkpoint, model_from_checkpoint, save_checkpoint
from .config import TrainConfig, parse_args, print_help
from .evaluate import Stopped, estimate_loss, exact_loss
from .optim import configure_optimizers
from .runtime import resolve_device

__all__ = ["CKPT_NAME", "Stopped", "TrainConfig", "configure_optimizers", "estimate_loss", "exact_loss",
           "load_checkpoint", "model_from_checkpoint", "parse_args", "print_help", "resolve_device",
           "save_checkpoint"]
