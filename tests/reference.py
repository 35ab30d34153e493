"""An independent float64 reference of the documented GPT: a plain function over a state dict.

Written from the seeds' formulas and the README, sharing no code with model/: token (+ learned position) embeddings; per
block x + attn(LN(x)), then x + MLP(LN(x)); a final LN and the LM head tied to the token embedding. Attention: qkv rows
are [q | k | v], each C wide, head h owns channels h*D .. (h+1)*D of each; optional RMS normalisation of q and k per
head (no gain); optional rotary positions, pair (2i, 2i+1) rotated by p * 10000^(-2i/D); scores q.k / sqrt(D), -inf
where the declared rule forbids, softmax over keys, weights @ v, heads merged in order, then the output projection. MLP:
C -> 4C, exact GELU (erf), -> C. LayerNorm: biased variance, eps 1e-5.

The declared visibility rule lives here too, cell by cell: the suite holds every path of the model to it.
"""

import itertools
import math

import torch
from torch import Tensor


def declared_rule(q: int, k: int, window: int = 0, same_document: bool = True) -> bool:
    """May the query at position q read the key at position k? The reference of model/attention.py:visible.
    Changing the rule on purpose? Write the new rule here too (and its name below): the whole suite then holds
    every path of the model to it, and still refuses any query that reads a later key."""
    return k <= q and (window == 0 or q - k < window) and same_document


def rule_name(window: int = 0, documents: bool = False) -> str:
    """The declared rule, in words, for failure messages."""
    return (f"attn_window={window}" if window else "the causal rule") + (" within documents" if documents else "")


def document_ids(tokens: list[int], sep: int) -> list[int]:
    """The document of each position, counted from 0: a separator opens the next one."""
    return list(itertools.accumulate(int(token == sep) for token in tokens))


def rule_grid(Tq: int, Tk: int, window: int = 0, docs: list[int] | None = None) -> Tensor:
    """(Tq, Tk) bool: declared_rule for queries at the last Tq of Tk positions; docs: each position's document.
    Never a later key, whatever the declared rule says: reading one is a LEAK under every rule."""
    same = (lambda i, j: docs[i] == docs[j]) if docs is not None else (lambda i, j: True)
    return torch.tensor([[j <= Tk - Tq + i and declared_rule(Tk - Tq + i, j, window, same(Tk - Tq + i, j))
                          for j in range(Tk)] for i in range(Tq)])


def reach(grid: Tensor, n_layer: int) -> Tensor:
    """(T, T) bool: which tokens each position's output can depend on through n_layer attention layers of grid
    (T, T) (the residual stream carries its own token)."""
    step, out = (grid | torch.eye(len(grid), dtype=torch.bool)).double(), torch.eye(len(grid), dtype=torch.float64)
    for _ in range(n_layer):
        out = (step @ out > 0).double()
    return out.bool()


def _layer_norm(x: Tensor, sd: dict[str, Tensor], name: str) -> Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * sd[f"{name}.weight"] + sd.get(f"{name}.bias", 0.0)


def _linear(x: Tensor, sd: dict[str, Tensor], name: str) -> Tensor:
    return x @ sd[f"{name}.weight"].T + sd.get(f"{name}.bias", 0.0)


def _rotate(x: Tensor, start: int) -> Tensor:
    """x (B, H, T, D): pair (2i, 2i+1) at position p = start + t turned by p * 10000^(-2i/D)."""
    T, D = x.shape[-2:]
    pos = torch.arange(start, start + T, dtype=torch.float64)[:, None]  # (T, 1)
    angle = pos * 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (T, D/2)
    cos, sin, even, odd = torch.cos(angle), torch.sin(angle), x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)  # back to (2i, 2i+1)


def _attention(x: Tensor, sd: dict[str, Tensor], p: str, cfg: dict, allowed: Tensor) -> Tensor:
    (B, T, C), H = x.shape, cfg["n_head"]
    D = C // H
    qkv = _linear(x, sd, f"{p}qkv")  # (B, T, 3C)
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, H, D).transpose(1, 2) for i in range(3))
    if cfg["qk_norm"]:
        q, k = (t / torch.sqrt((t * t).mean(-1, keepdim=True) + torch.finfo(torch.float64).eps) for t in (q, k))
    if cfg["pos_emb"] == "rope":
        q, k = _rotate(q, 0), _rotate(k, 0)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, T, T)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # allowed: (B, 1, T, T)
    return _linear((weights @ v).transpose(1, 2).reshape(B, T, C), sd, f"{p}proj")  # heads merged in order


def reference_forward(sd: dict[str, Tensor], cfg: dict, idx: Tensor) -> dict[str, Tensor]:
    """The documented GPT (sd: a GPT state dict, cast to float64 here; cfg: its GPTConfig as a dict) on idx (B, T),
    every sub-layer's output in forward order: "embedding" (B, T, C); per layer l "layer l attention" and "layer l
    MLP", the (B, T, C) outputs of the two sub-layers before they join the residual; "logits" (B, T, V)."""
    sd, T = {k: v.detach().double().cpu() for k, v in sd.items()}, idx.size(1)
    x = sd["tok_emb.weight"][idx.cpu()]
    if cfg["pos_emb"] == "learned":
        x = x + sd["pos_emb.weight"][:T]
    out, sep, window = {"embedding": x}, cfg.get("doc_sep"), cfg.get("attn_window", 0)
    allowed = torch.stack([rule_grid(T, T, window, None if sep is None else document_ids(row, sep))
                           for row in idx.tolist()])[:, None]  # (B, 1, T, T)
    for layer in range(cfg["n_layer"]):
        p = f"blocks.{layer}."
        a = _attention(_layer_norm(x, sd, f"{p}ln_1"), sd, f"{p}attn.", cfg, allowed)
        x = x + a
        u = _linear(_layer_norm(x, sd, f"{p}ln_2"), sd, f"{p}mlp.fc")
        m = _linear(0.5 * u * (1 + torch.erf(u / math.sqrt(2))), sd, f"{p}mlp.proj")
        x = x + m
        out[f"layer {layer} attention"], out[f"layer {layer} MLP"] = a, m
    out["logits"] = _layer_norm(x, sd, "ln_f") @ sd["tok_emb.weight"].T
    return out
