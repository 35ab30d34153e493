"""Sample text from a trained checkpoint.

    python sample.py --out_dir=out/shakespeare_char --prompt="ROMEO:" --max_new_tokens=500
    python sample.py --out_dir=out/shakespeare_char --prompt="ROMEO:" --attention_png=attention.png

Prints the prompt followed by its continuation; characters stream out as they are generated.
With --attention_png it draws the prompt's attention weights instead (training/visualize.py).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from data import CharTokenizer
from data.sources import decode_utf8
from model import GPT
from training import CKPT_NAME, discard_stdout, load_checkpoint, model_from_checkpoint, resolve_device
from training.config import MAX_SEED
from training.visualize import prompt_attention, save_attention_png


def build_parser() -> argparse.ArgumentParser:
    """sample.py's options (--help prints them with their defaults)."""
    p = argparse.ArgumentParser(
        description="Continue a prompt with a trained character-level GPT.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out_dir", default="out/shakespeare_char", help="run directory holding ckpt.pt")
    p.add_argument("--ckpt", default=None, help="checkpoint file; None = OUT_DIR/ckpt.pt (default: %(default)s)")
    p.add_argument("--prompt", default=None, help="text to continue; None = a newline (default: %(default)s)")
    p.add_argument("--prompt_file", default=None, help="read the prompt from this UTF-8 file instead of --prompt")
    p.add_argument("--max_new_tokens", type=int, default=500, help="characters to generate per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; <1 sharper, >1 more random")
    p.add_argument("--top_k", type=int, default=200, help="sample only among the k likeliest tokens (0 = all)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--num_samples", type=int, default=1, help="independent samples to draw")
    p.add_argument("--seed", type=int, default=1337, help="sampling seed (same seed, same text)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--no_cache", action="store_true", help="recompute the whole context every token")
    p.add_argument("--slide", type=int, default=1,
                   help="past block_size, how many of the oldest tokens the full context window drops at once: "
                        "1 keeps it full and recomputes it every token (nanoGPT's crop-and-recompute, exact "
                        "but slow); k > 1 recomputes it once every k tokens and uses the KV cache in between "
                        "(500 tokens from the shakespeare_char-sized model: 4.6x faster with --slide=32 on a "
                        "2-core CPU), each token then reading block_size-k+1 to block_size tokens of context"),
    p.add_argument("--attention_png", default=None, metavar="FILE",
                   help="instead of sampling, write the prompt's attention weights as a PNG: a heatmap per "
                        "layer (rows) and head (columns); in each, rows = queries, columns = keys")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Refuse option values generation would only trip over later, after the prompt was printed.

    A prompt longer than the model's block_size is fine: generation reads the last block_size tokens.
    """
    if args.max_new_tokens < 0:
        raise ValueError(f"--max_new_tokens must be >= 0, got {args.max_new_tokens}")
    if args.num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1, got {args.num_samples}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise ValueError(f"--top_k must be >= 0 (0 = all tokens), got {args.top_k}")
    if not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"--top_p must be in (0, 1] (1 = off), got {args.top_p}")
    if args.slide < 1:
        raise ValueError(f"--slide must be >= 1, got {args.slide}")
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed must be in [0, 2**62], got {args.seed}")


def read_prompt(path: str) -> str:
    """The prompt file as text; errors name the file (and the byte offset of non-UTF-8 input)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"--prompt_file: cannot read {path}: {e.strerror or e}") from None
    return decode_utf8(raw, path)


def load(args: argparse.Namespace) -> tuple[GPT, CharTokenizer, str, list[int]]:
    """The checkpoint's model (eval mode, on args.device), its tokenizer, the prompt and its ids."""
    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.ckpt or Path(args.out_dir) / CKPT_NAME, map_location=device)
    model, tok = model_from_checkpoint(ckpt, device, dropout=0.0)
    model.eval()
    if args.prompt_file and args.prompt is not None:
        raise ValueError("give the prompt as --prompt or as --prompt_file, not both")
    prompt = read_prompt(args.prompt_file) if args.prompt_file else ("\n" if args.prompt is None else args.prompt)
    if not prompt:
        raise ValueError("the prompt is empty; give at least one character")
    try:
        ids = tok.encode(prompt)
    except ValueError as e:
        raise ValueError(f"prompt: {e}") from None
    return model, tok, prompt, ids


def attention_png(args: argparse.Namespace) -> Path:
    """Write the attention weights of every layer and head for the prompt to args.attention_png.

    A prompt longer than block_size is drawn from its last block_size characters (what the model
    sees when it predicts the next one). Returns the path written.
    """
    model, _, prompt, ids = load(args)
    block = model.config.block_size
    if len(ids) > block:
        print(f"[the prompt has {len(ids)} characters; drawing its last {block} (block_size)]", file=sys.stderr)
        prompt, ids = prompt[-block:], ids[-block:]
    maps = prompt_attention(model, ids)  # L x (H, T, T)
    try:
        path = save_attention_png(args.attention_png, maps, list(prompt))
    except OSError as e:  # a missing folder, no permission
        raise ValueError(f"--attention_png: cannot write {args.attention_png}: {e.strerror or e}") from None
    print(f"[wrote {path}: {len(maps)} layers x {maps[0].shape[0]} heads, {len(ids)} queries x {len(ids)} keys]",
          file=sys.stderr)
    return path


def sample(args: argparse.Namespace, out: TextIO | None = None) -> list[str]:
    """Generate args.num_samples continuations, streaming them to `out` (default: the current
    sys.stdout, looked up at call time so redirections apply); returns the full texts.

    Raises:
        ValueError: a bad option, checkpoint or prompt, before any text is generated.
    """
    check_args(args)
    out = out or sys.stdout
    model, tok, prompt, ids = load(args)
    if args.slide > model.config.block_size:
        raise ValueError(f"--slide must be at most the model's block_size {model.config.block_size}, got {args.slide}")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    texts, n_tokens, t0 = [], 0, time.perf_counter()
    for i in range(args.num_samples):
        out.write(prompt)
        pieces = []
        for token in model.stream(idx, args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k or None, top_p=args.top_p, generator=gen,
                                  use_cache=not args.no_cache, slide=args.slide):
            ch = tok.decode([token])
            pieces.append(ch)
            out.write(ch)
            out.flush()
        n_tokens += len(pieces)
        texts.append(prompt + "".join(pieces))
        out.write("\n" + ("-" * 40 + "\n" if i + 1 < args.num_samples else ""))
    dt = time.perf_counter() - t0
    print(f"[{n_tokens} tokens in {dt:.2f} s, {n_tokens / max(dt, 1e-9):,.0f} tokens/s on {device}]",
          file=sys.stderr)
    return texts


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: returns the exit status (0 ok, 1 a refused option or input)."""
    args = build_parser().parse_args(argv)
    try:
        if args.attention_png:
            attention_png(args)
        else:
            sample(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (`python sample.py | head`)
        discard_stdout()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
