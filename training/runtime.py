"""Where and how to compute: device choice, autocast, and the facts recorded about a run."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import re
import subprocess
import sys
import time
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


# bf16 autocast on a CPU pays only where the CPU computes bf16 matmuls natively (AMX, AVX512-BF16) and
# the matmuls are large enough to amortise the casts: batch_size x block_size x n_embd >= 2**16 is the
# measured crossover on an AMX CPU, and on this project's sizes bf16 then gained 1.13-1.31x per step
# where its matmuls ran ~3x faster (benchmarks/RESULTS.md). Without native bf16 its matmuls run ~10x
# slower, so a one-off timing tells the two kinds of CPU apart.
CPU_BF16_MIN_WORK = 2 ** 16
CPU_BF16_MIN_SPEEDUP = 1.5


@functools.cache
def cpu_bf16_speedup(rows: int, width: int) -> float:
    """How many times faster this CPU multiplies (rows, width) @ (width, 4 width) in bfloat16 than in
    float32: the model's MLP matmul, timed once per process (~0.1 s at most; rows is capped at 1024)."""
    gen = torch.Generator().manual_seed(0)  # never the global RNG: a run must draw what it always drew
    x, w = torch.randn(min(rows, 1024), width, generator=gen), torch.randn(4 * width, width, generator=gen)

    def seconds(a: torch.Tensor, b: torch.Tensor, runs: int) -> float:
        torch.nn.functional.linear(a, b)  # warm-up: first-call costs are not the steady state
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            torch.nn.functional.linear(a, b)
            times.append(time.perf_counter() - t0)
        return min(times)

    return seconds(x, w, 3) / seconds(x.bfloat16(), w.bfloat16(), 2)


def bf16_pays(device: torch.device, rows: int, width: int, min_work: int = CPU_BF16_MIN_WORK) -> bool:
    """Whether (rows, width) @ (width, 4 width) matmuls are markedly faster in bfloat16 on this device:
    on CUDA where it is supported; on a CPU when rows * width >= min_work and cpu_bf16_speedup says so."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and rows * width >= min_work and cpu_bf16_speedup(rows, width) >= CPU_BF16_MIN_SPEEDUP


def resolve_dtype(name: str, device: torch.device, matmul: tuple[int, int] | None = None) -> torch.dtype:
    """The compute dtype a config's `dtype` means on this device.

    'auto' -> bfloat16 where bf16_pays for the model's matmuls, matmul = (batch_size * block_size, n_embd)
    of one micro-batch (None: unknown, float32 on a CPU); float32 otherwise. Any other name is taken as given.
    """
    if name == "auto":
        return torch.bfloat16 if bf16_pays(device, *(matmul or (0, 0))) else torch.float32
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
