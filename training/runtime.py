"""Where and how to compute: device choice, autocast, and the facts recorded about a run."""

from __future__ import annotations

import contextlib
import os
import platform
import re
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
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device={name!r} is not a device name; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={name!r} but CUDA is not available on this machine; use --device=cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device={name!r} but this machine has {torch.cuda.device_count()} CUDA devices")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={name!r} but MPS is not available on this machine; use --device=cpu")
    return device


# bf16 autocast on an AMX CPU pays only when the matmuls are large enough to amortise its casts.
# The cut-off is where the measured speed-up crosses 1 (one size at it measured 0.97x, within noise).
# Measured by training-step time (benchmarks/results/cpu_bf16_by_size.jsonl): with batch_size x
# block_size x n_embd at 2**16 and above, bf16 was 0.97-1.31x the speed of float32 (1.31x for the
# laptop recipe); below it, 0.70-0.89x.
CPU_BF16_MIN_WORK = 2 ** 16


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Sapphire Rapids and later): bfloat16 matrix units.

    There bfloat16 matmuls of this project's sizes measured ~3x faster than float32 ones. Without
    AMX, bfloat16 on a CPU is converted to float32 inside each kernel and is no faster, often slower.
    """
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # a private probe: absent means unknown
    return bool(probe is not None and probe())


def resolve_dtype(name: str, device: torch.device, work: int | None = None) -> torch.dtype:
    """The compute dtype a config's `dtype` means on this device.

    'auto' -> bfloat16 on a CUDA device that supports it, and on a CPU with AMX when the model's
    matmuls are large enough to gain from it (work = batch_size * block_size * n_embd of one
    micro-batch >= CPU_BF16_MIN_WORK; None means the size is unknown and counts as large enough);
    float32 otherwise. Any other name is taken as given.
    """
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        if device.type == "cpu" and cpu_has_amx() and (work is None or work >= CPU_BF16_MIN_WORK):
            return torch.bfloat16
        return torch.float32
    return DTYPES[name]


# Dense bf16 tensor-core peaks from the vendors' data sheets, in FLOP/s, each with the pattern that
# picks its part out of torch.cuda.get_device_name. MFU is only reported for devices listed here, or
# with an explicit peak: a guessed peak would be a made-up figure. The patterns match whole words
# ("L4" is not the L40, "A100" not an RTX A1000) and leave out variants with another peak (an H100
# PCIe or NVL, a 4090 D or laptop 4090, a 3090 Ti): those get no MFU unless --peak_tflops is given.
PEAK_BF16_FLOPS = [
    (r"\bH200\b(?!.*\bNVL\b)", 989.4e12),  # SXM: "NVIDIA H200" (not a GH200, not an H200 NVL)
    (r"\bH100\b(?!.*\b(PCIe|NVL)\b)", 989.4e12),  # SXM: "NVIDIA H100 80GB HBM3"
    (r"\bA100\b", 312e12),  # SXM and PCIe alike
    (r"\bL40S\b", 362e12),
    (r"\bL4\b", 121e12),
    (r"\bA10G\b", 70e12),
    (r"\bRTX 4090\b(?!.*\b(D|Laptop)\b)", 165.2e12),
    (r"\bRTX 3090\b(?!.*\b(Ti|Laptop)\b)", 71e12),
]


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> float | None:
    """The device's peak FLOP/s for MFU: the override when given (> 0), else a known GPU's bf16
    peak, else None (CPUs and unknown GPUs: no MFU is reported)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for pattern, peak in PEAK_BF16_FLOPS:
            if re.search(pattern, name):
                return peak
    return None


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    """Peak resident memory of this process (CPU RSS) and, on CUDA, the peak allocated by PyTorch."""
    import resource

    rss_unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, KiB on Linux
    out = {"cpu_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * rss_unit / 2**20}
    if device.type == "cuda":
        out["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def discard_stdout() -> None:
    """After a BrokenPipeError on stdout (`python train.py --help | head`, `python sample.py | head`:
    the reader went away), send stdout to /dev/null. The command then stops quietly, as Unix tools
    do; otherwise Python reports the broken pipe again when it flushes stdout at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


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
