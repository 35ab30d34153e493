"""Sample text from a trained checkpoint.

    python sample.py                                  (the newest run under out/)
    python sample.py --out_dir=out/shakespeare_char_cpu_fast --prompt="ROMEO:" --max_new_tokens=500
    python sample.py --attention_png                  (the prompt's attention maps, into the run's out_dir)

Prints the prompt and its continuation as the characters are drawn; the speed goes to stderr.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from data import decode_utf8
from model import GPT
from training import CKPT_NAME, load_checkpoint, model_from_checkpoint, resolve_device
from training.config import MAX_SEED
from training.visualize import prompt_attention, save_attention_png


class Parser(argparse.ArgumentParser):
    """argparse, whose unknown-option error suggests the closest options ("did you mean --top_k?")."""

    def error(self, message: str) -> None:
        words = [w.split("=")[0] for w in message.split() if w.startswith("--")]
        options = [o for a in self._actions for o in a.option_strings]
        close = [m for w in words for m in difflib.get_close_matches(w, options, n=2)]
        super().error(message + (f"; did you mean {' or '.join(close)}?" if close else ""))


def build_parser() -> argparse.ArgumentParser:
    """sample.py's options (--help prints them with their defaults)."""
    p = Parser(description="Continue a prompt with a trained character-level GPT.",
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out_dir", default=None, help="run directory holding ckpt.pt (default: the newest under out/)")
    p.add_argument("--ckpt", default=None, help="a checkpoint file, instead of OUT_DIR/ckpt.pt")
    p.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    p.add_argument("--prompt_file", default=None, help="read the prompt from this UTF-8 file instead of --prompt")
    p.add_argument("--max_new_tokens", type=int, default=500, help="characters to generate per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; < 1 sharper, > 1 more random")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens only (0 = all)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--num_samples", type=int, default=1, help="samples to draw, one generator for all")
    p.add_argument("--seed", type=int, default=1337, help="sampling seed (same seed, same text)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--no_cache", action="store_true", help="recompute the whole context every token")
    p.add_argument("--slide", type=int, default=1,
                   help="past block_size, how many of the oldest tokens the full window drops at once: 1 keeps it "
                        "full and recomputes it every token (nanoGPT's crop, exact but slow); k > 1 recomputes it "
                        "once every k tokens and uses the KV cache in between")
    p.add_argument("--attention_png", nargs="?", const="", default=None, metavar="FILE",
                   help="instead of sampling, draw the prompt's attention weights as a PNG, a heatmap per layer "
                        "and head (rows = queries, columns = keys); FILE defaults to OUT_DIR/attention.png")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Refuse option values generation would only trip over later, after the prompt was printed."""
    rules = [(args.max_new_tokens >= 0, "--max_new_tokens must be >= 0"),
             (args.num_samples >= 1, "--num_samples must be >= 1"),
             (math.isfinite(args.temperature) and args.temperature >= 0,
              "--temperature must be a finite number >= 0 (0 = greedy)"),
             (args.top_k >= 0, "--top_k must be >= 0 (0 = all tokens)"), (0 < args.top_p <= 1, "--top_p must be in (0, 1]"),
             (args.slide >= 1, "--slide must be >= 1"), (0 <= args.seed <= MAX_SEED, "--seed must be in [0, 2**62]"),
             (not (args.prompt_file and args.prompt is not None), "give the prompt as --prompt or --prompt_file, not both")]
    for ok, message in rules:
        if not ok:
            raise ValueError(message)


def checkpoint_path(args: argparse.Namespace) -> Path:
    """--ckpt, else OUT_DIR/ckpt.pt, else the newest out/*/ckpt.pt (what `python train.py` just wrote)."""
    if args.ckpt:
        return Path(args.ckpt)
    if args.out_dir:
        out_dir = Path(args.out_dir)
        if out_dir.is_file():
            raise ValueError(f"--out_dir={out_dir} is a file, not a run directory: give it as --ckpt={out_dir}")
        return out_dir / CKPT_NAME
    runs = sorted(Path("out").glob(f"**/{CKPT_NAME}"), key=os.path.getmtime)
    if not runs:
        raise ValueError("no checkpoint under out/: train one first (python train.py), or give --out_dir or --ckpt")
    print(f"[sampling from {runs[-1]}, the newest checkpoint under out/]", file=sys.stderr)
    return runs[-1]


def load(args: argparse.Namespace) -> tuple[GPT, list[str], str, list[int], Path]:
    """The checkpoint's model (eval mode, on args.device), its characters, the prompt, its ids, the path."""
    device = resolve_device(args.device)
    path = checkpoint_path(args)
    model, tok = model_from_checkpoint(load_checkpoint(path, map_location=device), device, dropout=0.0)
    if args.prompt_file:
        try:
            prompt = decode_utf8(Path(args.prompt_file).read_bytes(), args.prompt_file)
        except OSError as e:
            raise ValueError(f"--prompt_file: cannot read {args.prompt_file}: {e.strerror or e}") from None
    else:
        prompt = "\n" if args.prompt is None else args.prompt
    if not prompt:
        raise ValueError("the prompt is empty; give at least one character")
    try:
        ids = tok.encode(prompt)
    except ValueError as e:
        raise ValueError(f"prompt: {e}") from None
    return model.eval(), tok.chars, prompt, ids, path


def attention_png(args: argparse.Namespace) -> Path:
    """Draw every layer's and head's attention weights for the prompt (its last block_size characters)."""
    model, _, prompt, ids, ckpt = load(args)
    block = model.config.block_size
    if len(ids) > block:
        print(f"[the prompt has {len(ids)} characters; drawing its last {block} (block_size)]", file=sys.stderr)
        prompt, ids = prompt[-block:], ids[-block:]
    maps = prompt_attention(model, ids)  # L x (H, T, T)
    try:
        path = save_attention_png(args.attention_png or ckpt.parent / "attention.png", maps, list(prompt))
    except OSError as e:
        raise ValueError(f"--attention_png: cannot write {args.attention_png}: {e.strerror or e}") from None
    print(f"[wrote {path}: {len(maps)} layers x {maps[0].shape[0]} heads, {len(ids)} queries x {len(ids)} keys]",
          file=sys.stderr)
    return path


def sample(args: argparse.Namespace, out: TextIO | None = None) -> list[str]:
    """Stream args.num_samples continuations to `out` (default: sys.stdout at call time); returns them."""
    check_args(args)
    out = out or sys.stdout
    model, chars, prompt, ids, _ = load(args)
    if args.slide > model.config.block_size:
        raise ValueError(f"--slide must be at most the model's block_size {model.config.block_size}, got {args.slide}")
    device = model.tok_emb.weight.device
    gen = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([ids], device=device)
    texts, t0 = [], time.perf_counter()
    for i in range(args.num_samples):
        out.write(prompt)
        pieces = []
        for token in model.stream(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                                  top_p=args.top_p, generator=gen, use_cache=not args.no_cache, slide=args.slide):
            pieces.append(chars[int(token)])
            out.write(pieces[-1])
            out.flush()
        texts.append(prompt + "".join(pieces))
        out.write("\n" + ("-" * 40 + "\n" if i + 1 < args.num_samples else ""))
    out.flush()  # the text ends with its newline before the speed line, on a terminal too
    n, dt = args.num_samples * args.max_new_tokens, time.perf_counter() - t0
    print(f"[{n} tokens in {dt:.2f} s, {n / max(dt, 1e-9):,.0f} tokens/s on {device}]", file=sys.stderr)
    return texts


def main(argv: list[str] | None = None) -> int:
    """Command line; returns the exit status (0 ok, 1 a refused option or input)."""
    args = build_parser().parse_args(argv)
    try:
        attention_png(args) if args.attention_png is not None else sample(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (`python sample.py | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
