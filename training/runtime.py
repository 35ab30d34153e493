"""Device, dtype, peak FLOP/s and the facts of a run."""

import contextlib
import functools
import platform
import re
import resource
import subprocess
import sys
import timeit
from pathlib import Path

import numpy
import torch


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda, mps or cpu; a missing explicit device is an error."""
    mps = torch.backends.mps.is_available()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    device = torch.device(name)
    count = {"cuda": torch.cuda.device_count(), "mps": int(mps)}.get(device.type)
    if count is not None and (device.index or 0) >= count:
        raise ValueError(f"device={name!r} but this machine has {count} {device.type} devices; use --device=cpu")
    return device


@functools.cache
def cpu_bf16_speedup(rows: int, width: int) -> float:
    """bf16 over fp32 speedup of (min(rows, 1024), width) @ (width, 4 width) on this CPU, timed once."""
    gen = torch.Generator().manual_seed(0)  # not the global RNG: runs draw as before
    x, w = torch.randn(min(rows, 1024), width, generator=gen), torch.randn(4 * width, width, generator=gen)

    def seconds(a: torch.Tensor, b: torch.Tensor, runs: int) -> float:  # best after warm-up
        return min(timeit.repeat(lambda: torch.nn.functional.linear(a, b), number=1, repeat=runs + 1)[1:])

    return seconds(x, w, 3) / seconds(x.bfloat16(), w.bfloat16(), 2)


def bf16_pays(device: torch.device, rows: int, width: int, min_work: int = 2 ** 16) -> bool:
    """Whether (rows, width) @ (width, 4 width) matmuls are clearly faster in bf16 on device."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    # CPU: needs native bf16 (AMX, AVX512-BF16) and matmuls big enough to amortise the casts
    return device.type == "cpu" and rows * width >= min_work and cpu_bf16_speedup(rows, width) >= 1.5


def resolve_dtype(name: str, device: torch.device, matmul: tuple[int, int]) -> torch.dtype:
    """'auto' -> bfloat16 where bf16_pays for matmul = (batch_size * block_size, n_embd), else float32."""
    if name == "auto":
        return torch.bfloat16 if bf16_pays(device, *matmul) else torch.float32
    return getattr(torch, name)


def autocast_context(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to dtype; a no-op for float32."""
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)


# data-sheet dense bf16 FLOP/s; other GPUs get no MFU (unless --peak_tflops), not a guess
PEAK_BF16_FLOPS = [(r"\bH200\b(?!.*\bNVL\b)", 989.4e12), (r"\bH100\b(?!.*\b(PCIe|NVL)\b)", 989.4e12),
                   (r"\bA100\b", 312e12), (r"\bL40S\b", 362e12), (r"\bL4\b", 121e12), (r"\bA10G\b", 70e12),
                   (r"\bRTX 4090\b(?!.*\b(D|Laptop)\b)", 165.2e12), (r"\bRTX 3090\b(?!.*\b(Ti|Laptop)\b)", 71e12)]


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s for MFU: the override (> 0), a known GPU's bf16 peak, or None."""
    if override_tflops > 0:
        return override_tflops * 1e12
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((peak for pattern, peak in PEAK_BF16_FLOPS if re.search(pattern, name)), None)


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    """Peak CPU RSS of this process and, on CUDA, peak PyTorch allocation, in MB."""
    rss_unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    out = {"cpu_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * rss_unit / 2**20}
    if device.type == "cuda":
        out["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def run_facts(argv: list[str]) -> dict[str, str | list[str]]:
    """What produced a run: argv, versions, git commit."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"argv": [sys.argv[0], *argv], "python": platform.python_version(), "torch": torch.__version__,
            "numpy": numpy.__version__, "git_commit": commit, "platform": platform.platform()}
