"""Where and how to compute: device choice, autocast, and the facts recorded about a run."""

from __future__ import annotations

import contextlib
import platform
import subprocess
import sys
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda, then mps, then cpu; an explicit device that is not there is an error."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={name!r} but CUDA is not available on this machine; use --device=cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device={name!r} but this machine has {torch.cuda.device_count()} CUDA devices")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={name!r} but MPS is not available on this machine; use --device=cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on a CUDA device that supports it, else float32."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return DTYPES[name]


def autocast_context(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass when dtype is below float32; a no-op otherwise."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def run_facts(argv: list[str]) -> dict[str, str | list[str]]:
    """What produced a run: argv, library versions, git commit (for the run's config.json)."""
    import numpy

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {
        "argv": [sys.argv[0], *argv],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "git_commit": commit,
        "platform": platform.platform(),
    }
