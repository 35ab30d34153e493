"""Sample from a checkpoint (default: newest out/**/ckpt.pt): text to stdout, speed to stderr."""

import dataclasses
import itertools
import os
import sys
import time
from pathlib import Path
from typing import ClassVar

import torch

from data import SEPARATOR, CharTokenizer, decode_utf8
from model import GPT
from training import CKPT_NAME, load_checkpoint, model_from_checkpoint, resolve_device
from training.config import check_fields, opt, parse_args, print_help
from training.faults import exit_code
from training.runtime import reproducible_blas
from training.visualize import prompt_attention, render_attention

HELP_HEAD = ("usage: python sample.py [--option=value ...]", "", __doc__, "", "options:")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SampleConfig:
    """sample.py's options, parsed and validated as train.py's config is."""

    PROGRAM: ClassVar[str] = "sample.py"
    KEY: ClassVar[str] = "option"
    NANOGPT: ClassVar[dict[str, str]] = {"start": "prompt"}  # its sample.py's --start
    FIELD: ClassVar[str] = "--"
    USAGE: ClassVar[tuple[str, ...]] = HELP_HEAD

    out_dir: str | None = opt(None, "run dir holding ckpt.pt; None = newest under out/", rule="non-empty")
    ckpt: str | None = opt(None, "checkpoint file instead of OUT_DIR/ckpt.pt", rule="non-empty")
    prompt: str | None = opt(None, "text to continue; None = a newline. A model trained on documents starts a new "
                                   "one with it, and each sample ends where its document does")
    prompt_file: str | None = opt(None, "UTF-8 file holding the prompt", rule="non-empty")
    max_new_tokens: int = opt(500, "characters per sample", rule=">= 0")
    temperature: float = opt(0.8, "0 = greedy; < 1 sharper, > 1 more random", rule=">= 0")
    top_k: int = opt(200, "keep the k likeliest tokens (0 = all)", rule=">= 0")
    top_p: float = opt(1.0, "nucleus sampling mass (1 = off)", rule="in (0, 1]")
    num_samples: int = opt(1, "samples, one generator for all", rule=">= 1")
    seed: int = opt(1337, "same seed, same text", rule="in [0, 2**62]")
    device: str = opt("auto", "auto, cpu, cuda, cuda:N or mps", rule="one of auto, cpu, cuda, cuda:N, mps")
    no_cache: bool = opt(False, "recompute the whole context per token")
    slide: int = opt(1, "tokens a full window drops at once (1 = nanoGPT's crop)", rule=">= 1")
    attention_png: str | None = opt(None, "draw the prompt's attention maps into FILE (a bare --attention_png: "
                                          "OUT_DIR/attention.png) instead of sampling", bare="")

    def __post_init__(self) -> None:
        check_fields(self)  # the sampling options too, before any model: --attention_png's, so none are ignored


def load(args: SampleConfig) -> tuple[GPT, CharTokenizer, str, list[int], Path]:
    """(eval model, tokenizer, prompt, prompt ids, checkpoint path) that args name."""
    prompt = args.prompt
    if args.prompt_file:
        if args.prompt is not None:
            raise ValueError("give the prompt as --prompt or --prompt_file, not both")
        try:
            prompt = decode_utf8(Path(args.prompt_file).read_bytes(), args.prompt_file)
        except OSError as e:
            raise ValueError(f"--prompt_file: cannot read {args.prompt_file}: {e.strerror or e}") from None
    if prompt == "":
        raise ValueError("the prompt is empty; give one character or more")
    if args.ckpt and args.out_dir:
        raise ValueError("give the checkpoint as --out_dir or --ckpt, not both")
    if args.ckpt:
        path = Path(args.ckpt)
    elif args.out_dir:
        if Path(args.out_dir).is_file():
            raise ValueError(f"--out_dir={args.out_dir} is a file: give it as --ckpt={args.out_dir}")
        path = Path(args.out_dir, CKPT_NAME)
    else:
        path = max(Path("out").glob(f"**/{CKPT_NAME}"), key=os.path.getmtime, default=None)
        if path is None:
            raise ValueError("no checkpoint under out/: run python train.py, or give --out_dir or --ckpt")
        print(f"[sampling from {path}, the newest under out/]", file=sys.stderr)
    device = resolve_device(args.device)
    model, tok = model_from_checkpoint(load_checkpoint(path, map_location=device), device, dropout=0.0)
    if SEPARATOR in tok.stoi:  # a model of documents: the sample opens a document (the separator), the prompt its start
        prompt = SEPARATOR + (prompt or "").removeprefix(SEPARATOR)
    elif prompt is None:
        prompt = "\n"
    return model.eval(), tok, prompt, tok.encode(prompt), path


def attention_png(args: SampleConfig) -> None:
    """Draw each layer's and head's attention over the prompt's last block_size characters."""
    from PIL import Image  # here: only the maps need it

    if args.prompt is None and args.prompt_file is None:  # else a 1 x 1 map of the start token
        raise ValueError("--attention_png draws a prompt's attention: give --prompt=TEXT or --prompt_file=FILE")
    model, _, prompt, full, ckpt = load(args)
    prompt, ids = prompt[-model.config.block_size:], full[-model.config.block_size:]
    maps = prompt_attention(model, ids)  # L x (H, T, T)
    path = Path(args.attention_png or ckpt.parent / "attention.png")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(render_attention(maps, list(prompt))).save(path, format=None if path.suffix else "PNG")
    except (OSError, ValueError) as e:  # ValueError: PIL knows no format by that extension
        why = "a file stands where its folder should be" if isinstance(e, FileExistsError | NotADirectoryError) \
            else getattr(e, "strerror", None) or e
        raise ValueError(f"--attention_png: cannot write {path}: {why}") from None
    cropped = f" (the last {len(ids)} of the prompt's {len(full)} characters)" if len(full) > len(ids) else ""
    print(f"[wrote {path}: {len(maps)} layers x {maps[0].shape[0]} heads, {len(ids)} x {len(ids)}{cropped}]",
          file=sys.stderr)


def sample(args: SampleConfig) -> None:
    """Stream args.num_samples continuations to stdout: dashed lines between them; a model trained on documents
    stops each at the end of its document (the next separator), and documents of one line take a line each."""
    model, tok, prompt, ids, _ = load(args)
    sep = tok.stoi.get(SEPARATOR)
    between = "" if sep is not None and "\n" not in tok.stoi else "-" * 40 + "\n"
    idx = torch.tensor([ids], device=model.tok_emb.weight.device)
    gen = torch.Generator(device=idx.device).manual_seed(args.seed)
    t0, n = time.perf_counter(), 0
    for i in range(args.num_samples):
        tokens = model.stream(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                              top_p=args.top_p, generator=gen, use_cache=not args.no_cache, slide=args.slide)
        first = next(tokens, None)  # options are checked here, before any text
        print((between if i else "") + prompt.removeprefix(SEPARATOR).replace(SEPARATOR, "\n"), end="")
        for token in itertools.chain([] if first is None else [first], tokens):
            n += 1
            if int(token) == sep:  # the document ends
                break
            print(tok.chars[int(token)], end="", flush=True)
        print(flush=True)  # newline before the speed line, on a terminal too
    dt = time.perf_counter() - t0
    print(f"[{n} tokens in {dt:.2f} s, {n / max(dt, 1e-9):,.0f} tokens/s on {idx.device}]", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Command line; exit status 0, 1 for a refused option or input, 130 for Ctrl-C."""
    argv = sys.argv[1:] if argv is None else argv
    reproducible_blas()
    if print_help(argv, SampleConfig):
        return 0
    try:
        args = parse_args(argv, SampleConfig)
        attention_png(args) if args.attention_png is not None else sample(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # reader gone (`sample.py | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the text so far stays, and no traceback follows it
        print("\n[interrupted]", file=sys.stderr)
        return exit_code("SIGINT")
    return 0


if __name__ == "__main__":
    sys.exit(main())
