"""KV-cache benchmark: tokens/s of cached generation vs recomputing the whole context every token.

    python benchmarks/kv_cache.py [--device=cpu] [--new_tokens=256] [--slide=1] [--repeats=3] [--json=FILE]

The model has the shape of configs/shakespeare_char.toml (6 layers, 6 heads, 384 wide, block 256,
65 symbols) with random weights; generation starts from a one-token prompt, so all 256 new tokens
fit in the block and the cache is used for every one of them. The uncached path is the
crop-and-recompute loop nanoGPT uses (one full forward of the context per token, LM head on the
last position only). Both draw from generators with the same seed and must give identical tokens.
Each path is timed `repeats` times, alternating, and the fastest run of each is reported.

More than 256 new tokens overflow the block (the window then holds the prompt and 256 new ones
when the next is appended), and from then on it slides `--slide` tokens at a time (see
GPT.generate). With --slide=1 both paths recompute the full window every token from then on; with
--slide=k the cached path re-prefills once every k tokens, and the uncached path recomputes the
same windows, so the tokens must still be identical.

--window=W measures the rolling cache instead: a rotary model with attn_window=W generates 16 x block_size
tokens on its cache (never re-prefilled) and reports tokens/s over the stretches up to 1x, 4x and 16x
block_size, the cache's bytes and the process's peak RSS at each, and whether the first 4 blocks match the
uncached path token for token (greedy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model import GPT, GPTConfig  # noqa: E402
from training import resolve_device  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(device: str = "cpu", new_tokens: int = 256, repeats: int = 3, backend: str = "sdpa", slide: int = 1,
        n_layer: int = 6, n_head: int = 6, n_embd: int = 384, block_size: int = 256) -> dict:
    """Time both paths; returns tokens/s of each, their ratio, and whether the tokens are identical."""
    dev = resolve_device(device)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=65, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                    attn_backend=backend)
    model = GPT(cfg).to(dev).eval()
    prompt = torch.zeros(1, 1, dtype=torch.long, device=dev)
    model.generate(prompt, 8)  # warm-up: first-call allocations and kernel selection
    best = {True: float("inf"), False: float("inf")}
    tokens = {}
    for _ in range(repeats):
        for use_cache in (True, False):
            gen = torch.Generator(device=dev).manual_seed(1234)
            _sync(dev)
            t0 = time.perf_counter()
            out = model.generate(prompt, new_tokens, temperature=1.0, generator=gen, use_cache=use_cache,
                                 slide=slide)
            _sync(dev)
            best[use_cache] = min(best[use_cache], time.perf_counter() - t0)
            tokens[use_cache] = out
    return {
        "device": str(dev),
        "model": cfg.to_dict(),
        "new_tokens": new_tokens,
        "slide": slide,
        "cached_tokens_per_second": new_tokens / best[True],
        "uncached_tokens_per_second": new_tokens / best[False],
        "speedup": best[False] / best[True],
        "identical_tokens": bool(torch.equal(tokens[True], tokens[False])),
        "threads": torch.get_num_threads(),
    }


def rolling(device: str = "cpu", window: int = 16, n_layer: int = 6, n_head: int = 6, n_embd: int = 384,
            block_size: int = 256) -> dict:
    """Tokens/s and memory of a windowed rotary model's cached generation at 1x, 4x and 16x block_size."""
    import resource

    dev = resolve_device(device)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=65, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                    pos_emb="rope", attn_window=window)
    model = GPT(cfg).to(dev).eval()
    prompt = torch.zeros(1, 1, dtype=torch.long, device=dev)
    caches = []
    model.register_forward_pre_hook(lambda _m, _a, kw: caches.append(kw.get("cache")), with_kwargs=True)
    stream = model.stream(prompt, 16 * block_size, temperature=0)
    marks, stretches, done, tokens = (1, 4, 16), [], 0, []
    for mark in marks:
        _sync(dev)
        t0 = time.perf_counter()
        tokens += [int(t) for _, t in zip(range(mark * block_size - done), stream, strict=False)]
        _sync(dev)
        cache = caches[-1]
        stretches.append({"blocks": mark, "tokens_per_second": (mark * block_size - done) / (time.perf_counter() - t0),
                          "cache_bytes": sum(t.numel() * t.element_size() for t in cache.k + cache.v),
                          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
        done = mark * block_size
    uncached = model.generate(prompt, 4 * block_size, temperature=0, use_cache=False)[0, 1:].tolist()
    return {"device": str(dev), "model": cfg.to_dict(), "stretches": stretches,
            "identical_tokens_4_blocks": uncached == tokens[:4 * block_size], "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    """Command line; exit status 0 when both paths drew identical tokens, 1 when not, 2 on a bad option."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--new_tokens", type=int, default=None,
                   help="tokens to generate; None = 256, or 63 with --small: what fits in the block "
                        "(default: %(default)s)")
    p.add_argument("--slide", type=int, default=1, help="tokens a full window drops at once (GPT.generate)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each path; the fastest counts")
    p.add_argument("--backend", default="sdpa", choices=("manual", "sdpa"), help="attention backend")
    p.add_argument("--small", action="store_true", help="a tiny model (block 64), for a smoke test of the script")
    p.add_argument("--cpu_fast", action="store_true", help="the fast CPU recipe's shape (2 x 4 x 96, block 64)")
    p.add_argument("--window", type=int, default=0, help="W >= 1: the rolling-cache measurement (see above)")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    size = dict(n_layer=2, n_head=2, n_embd=32, block_size=64) if args.small else \
        dict(n_layer=2, n_head=4, n_embd=96, block_size=64) if args.cpu_fast else {}
    for name in ("repeats", "new_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            print(f"error: --{name} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.json and not Path(args.json).parent.is_dir():  # checked before the run, not after
        print(f"error: --json={args.json}: give a file in an existing folder", file=sys.stderr)
        return 2
    try:
        new_tokens = args.new_tokens if args.new_tokens is not None else (63 if args.small else 256)
        result = rolling(args.device, args.window, **size) if args.window else \
            run(args.device, new_tokens, args.repeats, args.backend, args.slide, **size)
    except (ValueError, RuntimeError) as e:  # a slide larger than the block; a device torch does not know
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if result.get("identical_tokens", result.get("identical_tokens_4_blocks")) else 1


if __name__ == "__main__":
    sys.exit(main())
