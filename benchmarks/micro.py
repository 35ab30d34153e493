"""The small measurements that code comments quote, re-measured in one go.

    python benchmarks/micro.py [--json=FILE]

Each entry names the comment it backs. Timings are medians of repeated runs on this machine, so
compare the ratios, not the absolute numbers, with another machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data import CharTokenizer  # noqa: E402
from model.attention import causal_mask  # noqa: E402
from training.optim import orthogonalize  # noqa: E402


def median_seconds(fn: Callable[[], object], repeats: int = 5, number: int = 1) -> float:
    """Median over `repeats` of the mean time of `number` calls of fn()."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return statistics.median(times)


def causal_mask_cost() -> dict:
    """model/gpt.py: the mask is rebuilt every forward (~10 us on a CPU, 0.04% of a laptop step)."""
    s = median_seconds(lambda: causal_mask(64, 64), repeats=7, number=2000)
    return {"comment": "model/gpt.py forward(): causal_mask(64, 64) per forward", "microseconds": s * 1e6,
            "share_of_25.7_ms_laptop_step": s / 25.7e-3}


def tokenizer_speed() -> dict:
    """data/corpus.py: vectorised encode_array vs a Python loop over a 1 MB text."""
    rng = np.random.default_rng(0)
    alphabet = [chr(c) for c in range(32, 97)]  # 65 symbols, like Tiny Shakespeare
    text = "".join(rng.choice(alphabet, size=1_000_000))
    tok = CharTokenizer(sorted(set(text)))
    vec = median_seconds(lambda: tok.encode_array(text), repeats=3)
    loop = median_seconds(lambda: np.array([tok.stoi[c] for c in text], dtype=np.uint16), repeats=3)
    return {"comment": "data/corpus.py encode_array vs a Python loop, 1 MB", "vectorised_s": vec,
            "loop_s": loop, "speedup": loop / vec}


def newton_schulz_dtype() -> dict:
    """training/optim.py: orthogonalize in bfloat16 vs float32, on the laptop model's matrices (Muon picks bf16
    only where it is faster)."""
    g = torch.Generator().manual_seed(0)
    square = torch.randn(16, 128, 128, generator=g)  # 4 layers x (q, k, v, proj) as 128 x 128 blocks
    wide = torch.randn(8, 512, 128, generator=g)  # 4 layers x (fc, proj^T)
    out = {"comment": "training/optim.py orthogonalize: bfloat16 vs float32"}
    for dtype in (torch.bfloat16, torch.float32):
        out[f"{str(dtype).removeprefix('torch.')}_ms"] = 1e3 * median_seconds(
            lambda d=dtype: (orthogonalize(square, dtype=d), orthogonalize(wide, dtype=d)), repeats=7, number=5)
    out["speedup_bf16"] = out["float32_ms"] / out["bfloat16_ms"]
    return out


def attention_variants() -> dict:
    """model/attention.py: one layer's attention, forward and backward, at the laptop recipe's shapes:
    the scale and the mask folded into baddbmm (ours), matmul + divide + masked_fill, and sdpa."""
    import math

    import torch.nn.functional as F

    from model.attention import additive_mask, attention

    B, H, T, D = 12, 4, 64, 32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g, requires_grad=True) for _ in range(3))
    grad = torch.randn(B, H, T, D, generator=g)
    allowed = causal_mask(T, T)
    mask = additive_mask(allowed)

    def unfolded():
        s = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(~allowed, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    variants = {"baddbmm_us": lambda: attention(q, k, v, mask)[0], "matmul_divide_masked_fill_us": unfolded,
                "sdpa_us": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)}
    return {"comment": "model/attention.py attention(): one layer forward + backward, (12, 4, 64, 32)",
            **{name: 1e6 * median_seconds(lambda f=f: f().backward(grad), repeats=7, number=50)
               for name, f in variants.items()}}


def main(argv: list[str] | None = None) -> int:
    """Command line: measure every figure, print them (and write --json); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    results = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
               "entries": [causal_mask_cost(), tokenizer_speed(), newton_schulz_dtype(), attention_variants()]}
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
