"""Score a nanoGPT checkpoint with our exact val loss: its weights loaded into our GPT.

    python benchmarks/nanogpt_exact_val.py NANOGPT_OUT_DIR/ckpt.pt --dataset=PATH/input.txt \
        [--meta=NANOGPT/data/shakespeare_char/meta.pkl]

nanoGPT reports a 20-batch estimate of the val loss; ours reports every val target once. Loading
nanoGPT's weights into our model (the same architecture, other parameter names) puts both programs
on the exact measure. Its character vocabulary comes from the same text (sorted set of characters),
so the token ids agree; the split is nanoGPT's too (first 90 % train). Float32, CPU.

The checkpoint holds only the vocabulary's size; nanoGPT keeps its characters in the meta.pkl its
prepare.py writes. Given --meta, the characters and their order must be ours, id for id; without
it only the size is checked (another text with as many symbols would be scored with the wrong ids).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data import load_corpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from training import exact_loss  # noqa: E402

# nanoGPT's parameter names -> ours, per block and outside the blocks
BLOCK = {"ln_1.weight": "ln_1.weight", "attn.c_attn.weight": "attn.qkv.weight",
         "attn.c_proj.weight": "attn.proj.weight", "ln_2.weight": "ln_2.weight",
         "mlp.c_fc.weight": "mlp.fc.weight", "mlp.c_proj.weight": "mlp.proj.weight"}
TOP = {"transformer.wte.weight": "tok_emb.weight", "transformer.wpe.weight": "pos_emb.weight",
       "transformer.ln_f.weight": "ln_f.weight", "lm_head.weight": "lm_head.weight"}


def convert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """nanoGPT's state_dict (bias=False) in our names; raises on a name it does not know."""
    out = {}
    for name, tensor in state.items():
        name = name.removeprefix("_orig_mod.")  # a compiled nanoGPT model saves this prefix
        if name in TOP:
            out[TOP[name]] = tensor
        elif name.startswith("transformer.h."):
            layer, rest = name.removeprefix("transformer.h.").split(".", 1)
            if rest not in BLOCK:
                raise ValueError(f"unknown nanoGPT parameter {name} (a bias? only bias=False is converted)")
            out[f"blocks.{layer}.{BLOCK[rest]}"] = tensor
        else:
            raise ValueError(f"unknown nanoGPT parameter {name}")
    return out


class _PlainUnpickler(pickle.Unpickler):
    """Loads plain data only (dicts, str, int): meta.pkl needs nothing else, and a pickle that names
    a class or function is refused instead of run."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: meta.pkl holds plain data only")


def meta_chars(path: Path) -> list[str]:
    """The characters of nanoGPT's meta.pkl ({'vocab_size', 'itos', 'stoi'}), in id order."""
    try:
        with open(path, "rb") as f:
            meta = _PlainUnpickler(f).load()
        itos = meta["itos"]
        return [itos[i] for i in range(len(itos))]
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError) as e:
        raise SystemExit(f"error: cannot read nanoGPT's vocabulary from {path}: {e!r}") from None


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("ckpt", type=Path, help="a nanoGPT out_dir/ckpt.pt")
    p.add_argument("--dataset", required=True, help="the text nanoGPT was trained on (input.txt)")
    p.add_argument("--meta", type=Path, default=None,
                   help="nanoGPT's data/<dataset>/meta.pkl: check its characters are ours, id for id")
    args = p.parse_args(argv)
    try:
        ckpt = torch.load(args.ckpt, map_location="cpu", weights_only=True)  # plain tensors, dicts and numbers
    except (OSError, RuntimeError, pickle.UnpicklingError) as e:
        raise SystemExit(f"error: cannot read {args.ckpt}: {e}") from None
    if not isinstance(ckpt, dict) or "model_args" not in ckpt:
        raise SystemExit(f"error: {args.ckpt} is not a nanoGPT checkpoint (no model_args); for one of this "
                         "project's checkpoints, the exact val loss is final_val_loss in its summary.json")
    margs = ckpt["model_args"]
    if margs.get("bias"):
        raise SystemExit("error: only nanoGPT models with bias=False are converted")
    corpus = load_corpus(args.dataset)
    if corpus.tokenizer.vocab_size != margs["vocab_size"]:
        raise SystemExit(f"error: the dataset has {corpus.tokenizer.vocab_size} symbols, the checkpoint "
                         f"{margs['vocab_size']}")
    if args.meta is not None and meta_chars(args.meta) != corpus.tokenizer.chars:
        raise SystemExit(f"error: {args.meta} maps ids to other characters than the dataset's vocabulary: "
                         "the checkpoint was trained on another text")
    model = GPT(GPTConfig(vocab_size=margs["vocab_size"], block_size=margs["block_size"], n_layer=margs["n_layer"],
                          n_head=margs["n_head"], n_embd=margs["n_embd"], attn_backend="sdpa")).eval()
    model.load_state_dict(convert(ckpt["model"]))
    val = exact_loss(model, torch.from_numpy(corpus.val.astype(np.int64)), margs["block_size"], 64, "cpu")
    print(json.dumps({"ckpt": str(args.ckpt), "iter_num": ckpt.get("iter_num"),
                      "nanogpt_best_val_estimate": float(ckpt.get("best_val_loss", float("nan"))),
                      "exact_val_loss": val}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
