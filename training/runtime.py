"""Device, dtype, peak FLOP/s and the facts of a run."""

import contextlib
import getpass
import hashlib
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import torch

from .checkpoint import write_json

KEPT = "the run's own, from its checkpoint"  # why a resumed run keeps its dtype and compile
RECENT = 5  # runs of each kind (eager, compiled) whose median step time compile='auto' weighs
# data-sheet dense bf16 FLOP/s; other GPUs get no MFU (unless --peak_tflops), not a guess
PEAK_BF16_FLOPS = [(r"\bH200\b(?!.*\bNVL\b)", 989.4e12), (r"\bH100\b(?!.*\b(PCIe|NVL)\b)", 989.4e12),
                   (r"\bA100\b", 312e12), (r"\bL40S\b", 362e12), (r"\bL4\b", 121e12), (r"\bA10G\b", 70e12),
                   (r"\bRTX 4090\b(?!.*\b(D|Laptop)\b)", 165.2e12), (r"\bRTX 3090\b(?!.*\b(Ti|Laptop)\b)", 71e12)]


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


def reproducible_blas() -> None:
    """MKL's gemm is bitwise reproducible only in its strict CNR mode: otherwise a result can depend on the
    threads MKL takes at run time, i.e. on the machine's load. MKL reads this at its first call: call it first."""
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def remembered(name: str, measure: Callable[[], Any] | None = None, update: Callable[[Any], Any] | None = None
               ) -> tuple[Any, Path]:
    """What this machine (CPU model and family, torch build, threads) measured under `name`, kept in
    $XDG_CACHE_HOME/gpt-char/probes.json so a decision never flips on one noisy timing: measure() once if nothing
    is kept (None without it); update(kept) replaces what is kept. Returns (value, that file)."""
    path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt-char" / "probes.json"
    cpu, probes = "", {}
    with contextlib.suppress(OSError):  # no /proc/cpuinfo: platform.processor()
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]  # the first CPU's; a VM's "AMD EPYC" is any Zen
        fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
        cpu = " ".join(fields.get(k, "") for k in ("model name", "cpu family", "model")).strip()
    key = f"{cpu or platform.processor()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {name}"
    with contextlib.suppress(OSError, ValueError):
        probes = json.loads(path.read_text())
    if update is not None or (key not in probes and measure is not None):
        probes[key] = update(probes.get(key)) if update is not None else measure()
        with contextlib.suppress(OSError):  # a read-only home: measured at every start instead
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, probes)
    return probes.get(key), path


def speed_key(cfg: Any) -> str:
    """What a step's speed depends on: the model's shape, the batch, dtype, backend, dropout and biases (RESULTS.md)."""
    return (f"ms per step {cfg.n_layer}x{cfg.n_head}x{cfg.n_embd} block {cfg.block_size} batch {cfg.batch_size}x"
            f"{cfg.gradient_accumulation_steps} {cfg.dtype} {cfg.attn_backend} {cfg.pos_emb} qk_norm {cfg.qk_norm} "
            f"window {cfg.attn_window} doc_mask {cfg.doc_mask} {cfg.optimizer} dropout {cfg.dropout} bias {cfg.bias}")


def compiled_here(cfg: Any) -> Path:
    """A marker in inductor's on-disk cache, made once this shape has compiled into it: wiped with the cache (a
    reboot empties /tmp), so it says whether the next compile is warm (seconds) or cold (a minute)."""
    user = "unknown_user"  # where inductor caches by default (its own helper for this is private API)
    with contextlib.suppress(KeyError, OSError):
        user = getpass.getuser()
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or Path(tempfile.gettempdir()) / f"torchinductor_{user}"
    return Path(cache) / f"gpt-char-{hashlib.sha1(f'{torch.__version__} {speed_key(cfg)}'.encode()).hexdigest()}"


def compile_time() -> float:
    """Seconds torch.compile has spent compiling in this process, every graph (the step's, the evaluations'); 0 where
    torch keeps no such count."""
    import torch._dynamo.utils  # private: the only count that sees the eval graph's compile (half the cost)

    spent = getattr(torch._dynamo.utils, "calculate_time_spent", dict)  # a torch without it: nothing counted
    return spent().get("total_wall_time", 0.0)


def record_speed(cfg: Any, summary: dict) -> None:
    """Keep this CPU run's median ms/step, after the last RECENT - 1 of its kind (eager or compiled), and its
    compile's extra seconds, cold or warm, for compile='auto'."""
    ms = summary["ms_per_step_median"]
    if ms and summary["steps_this_run"] >= 20 and not summary["interrupted"]:
        kind, new = "compiled" if cfg.compile == "true" else "eager", {}
        if kind == "compiled":
            marker = compiled_here(cfg)
            new["warm_s" if marker.exists() else "cold_s"] = summary["compile_seconds"]
            with contextlib.suppress(OSError):  # no cache folder: nothing was cached
                marker.touch()
        remembered(speed_key(cfg),
                   update=lambda kept: (kept or {}) | new | {kind: [*(kept or {}).get(kind, []), ms][-RECENT:]})


def resolve_compile(choice: str, device: torch.device, cfg: Any, steps: int, kept: str | None = None
                    ) -> tuple[bool, str]:
    """'auto' -> the resumed run's `kept` choice; compile on CUDA; on a CPU where this machine's own runs of this
    shape (record_speed keeps them; their medians, so one lucky run flips nothing) say compiled steps save more than
    twice what compiling costs: a cold compile's seconds, or with the shape in inductor's cache a warm one's (0 until
    measured); else not. And why."""
    if choice == "auto" and kept not in (None, "auto"):
        return kept == "true", KEPT
    if choice != "auto":
        return choice == "true", "as configured"
    if device.type != "cpu":
        return device.type == "cuda", f"auto: {device.type}"
    runs = remembered(speed_key(cfg))[0] or {}
    if not {"eager", "compiled", "cold_s"} <= runs.keys():
        return False, "auto: its gain not measured here yet; --compile=true measures it"
    kind = "warm_s" if compiled_here(cfg).exists() else "cold_s"
    eager, compiled = statistics.median(runs["eager"]), statistics.median(runs["compiled"])
    saving, cost = steps * (eager - compiled) / 1000, max(runs.get(kind, 0), 0)
    took = f"took {cost:.0f} s" if kind in runs else "is not measured yet"
    runs_of = f"{len(runs['compiled'])} and {len(runs['eager'])} runs"
    return saving > 2 * cost, (f"auto: compiled {compiled:.0f} vs eager {eager:.0f} ms/step here ({runs_of}), "
                               f"{steps} steps save {saving:.0f} s, a {kind[:4]} compile {took}")


def cpu_bf16_speedup(rows: int, width: int) -> float:
    """bf16 over fp32 speedup of (min(rows, 1024), width) @ (width, 4 width) on this CPU: the best of 5 runs of
    each, interleaved, so a load that comes and goes slows both alike."""
    gen = torch.Generator().manual_seed(0)  # not the global RNG: runs draw as before
    x, w = torch.randn(min(rows, 1024), width, generator=gen), torch.randn(4 * width, width, generator=gen)
    pairs = [(x, w), (x.bfloat16(), w.bfloat16())]
    times: list[list[float]] = [[], []]
    for _ in range(6):  # the first round warms up
        for i, (a, b) in enumerate(pairs):
            times[i].append(timeit.timeit(lambda a=a, b=b: torch.nn.functional.linear(a, b), number=2))
    return min(times[0][1:]) / min(times[1][1:])


def bf16_pays(device: torch.device, rows: int, width: int, min_work: int = 2 ** 16) -> tuple[bool, str]:
    """Whether (rows, width) @ (width, 4 width) matmuls are clearly faster in bf16 on device, and why."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(), "CUDA"
    if device.type != "cpu" or rows * width < min_work:
        return False, "matmuls too small for bf16 to pay" if device.type == "cpu" else device.type
    # CPU: needs native bf16 (AMX, AVX512-BF16), measured once per machine and shape
    speedup, where = remembered(f"bf16 speedup {min(rows, 1024)}x{width}", lambda: cpu_bf16_speedup(rows, width))
    return speedup >= 1.5, f"bf16 {speedup:.2f}x float32 on this CPU, measured once: {where.as_posix()}"


def resolve_dtype(name: str, device: torch.device, matmul: tuple[int, int], kept: str | None = None
                  ) -> tuple[torch.dtype, str]:
    """'auto' -> the resumed run's `kept` dtype, else bfloat16 where bf16_pays for matmul = (batch_size * block_size,
    n_embd), else float32; and why."""
    if name == "auto" and kept not in (None, "auto"):
        return getattr(torch, kept), KEPT
    if name == "auto":
        pays, why = bf16_pays(device, *matmul)
        return (torch.bfloat16 if pays else torch.float32), f"auto: {why}"
    return getattr(torch, name), "as configured"


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
    commit = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    return {"argv": [sys.argv[0], *argv], "python": platform.python_version(), "torch": torch.__version__,
            "numpy": numpy.__version__, "git_commit": commit, "platform": platform.platform()}
