"""Causal multi-head self-attention, written out step by step. `visible` is THE visibility rule: which key
position each query position may read; every path builds its mask from it (training on both backends, the KV
cache, generation, the exact val pass, the maps). `attention` is softmax(Q Kᵀ / √D + M) V in five steps.

Shapes: B batch, T sequence, Tq queries and Tk keys (Tk >= Tq against a cache), C width, H heads, D = C // H, V vocab,
W window (attn_window).
"""

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:  # the config's module imports this one
    from .gpt import GPTConfig


def visible(q_pos: Tensor, k_pos: Tensor, window: int = 0, q_doc: Tensor | None = None,
            k_doc: Tensor | None = None) -> Tensor:
    """Whether the query at absolute position q_pos may read the key at k_pos: bool, the broadcast shape.

    A predicate of positions (FlexAttention's mask_mod), composed with & and |. Causal: no key after the query.
    window W >= 1: nor any W or more positions back, so a query reads itself and the W - 1 keys before it (W keys,
    as torchtitan and modded-nanogpt count; FlashAttention's window_size=(W - 1, 0)). 0: every earlier key.
    Documents (q_doc, k_doc: ids from `documents`): nor any key of another document.
    """
    allowed = k_pos <= q_pos
    if window:
        allowed = allowed & (k_pos > q_pos - window)
    if q_doc is not None:
        allowed = allowed & (q_doc == k_doc)
    return allowed


def documents(tokens: Tensor, sep: int, first: Tensor | int = 0) -> Tensor:
    """Document ids (B, T) of tokens (B, T): a separator opens its document, so it reads nothing of the one before
    (it predicts the next document's first character from nothing else). first: the id before tokens[:, 0]."""
    return (tokens == sep).cumsum(-1) + first


def causal_mask(Tq: int, Tk: int, device: torch.device | str | None = None, window: int = 0) -> Tensor:
    """allowed (Tq, Tk) by `visible`, the Tq queries being the LAST Tq of Tk positions (bottom-right, as in
    decoding and FlashAttention >= 2.1; sdpa's is_causal aligns top-left): the lower triangle when Tq == Tk."""
    if Tq < 1 or Tk < Tq:
        raise ValueError(f"causal_mask needs 1 <= Tq <= Tk, got Tq={Tq}, Tk={Tk}")
    k_pos = torch.arange(Tk, device=device)
    return visible(k_pos[Tk - Tq:, None], k_pos[None, :], window)  # (Tq, Tk)


def additive_mask(allowed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """M, added to the scores: 0 where allowed, -inf where not (allowed's shape). -inf, not -1e9: exp(-inf) is 0 in
    every dtype, while a finite fill loses to a lower score or overflows float16.

    A query that may read no key (0/0 = NaN) is refused here for CPU masks (on a GPU the check would stall it).
    """
    if allowed.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(allowed.any(-1).all()):
        query = (~allowed.any(-1)).nonzero()[0, -1].item()
        raise ValueError(f"attention mask: query {query} may read no key, so its softmax would be 0/0; every "
                         "query must see >= 1 key (see model/attention.py:visible)")
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
              dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention, softmax(Q Kᵀ / √D + M) V.

    q (B, H, Tq, D), k (B, H, Tk, D), v (B, H, Tk, Dv); mask: M or a bool `allowed`, broadcastable to (B, H, Tq, Tk),
    None for none; dropout_p: 0 in eval mode. Returns out (B, H, Tq, Dv) and weights (B, H, Tq, Tk) before dropout.
    """
    B, H, Tq, D = q.shape
    Tk = k.size(2)
    if mask is None:
        mask = torch.zeros((), dtype=q.dtype, device=q.device)
    elif mask.dtype == torch.bool:
        mask = additive_mask(mask, q.dtype)
    # 1. + 2. scores = Q Kᵀ / √D + M in one matmul: the scale keeps the logits' variance ~1, and M, added
    # BEFORE the softmax, makes every masked score -inf. (baddbmm takes 3-D stacks: heads join the batch.)
    M = mask.broadcast_to(B, H, Tq, Tk).reshape(B * H, Tq, Tk)  # a view for a (Tq, Tk) mask
    scores = torch.baddbmm(M, q.reshape(B * H, Tq, D), k.reshape(B * H, Tk, D).transpose(1, 2),
                           alpha=1.0 / math.sqrt(D))  # (B*H, Tq, Tk)
    # 3. softmax over the KEY axis: each query spreads one unit of attention over the keys (half
    # precision is computed in float32 inside the kernel)
    weights = torch.softmax(scores, dim=-1).view(B, H, Tq, Tk)
    # 4. dropout on the weights that are already masked: it can zero a weight, never re-admit a key
    dropped = F.dropout(weights, dropout_p)
    # 5. each query's output is its weighted average of the values
    return dropped @ v, weights  # (B, H, Tq, Dv), (B, H, Tq, Tk)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Rotary positions: each channel pair (a, b) of x (B, H, T, D) turned by its angle, rope (T, D/2, 2) holding
    (cos, sin), so q_m . k_n depends on m - n only. Returns x's shape and dtype."""
    cos, sin = rope.unbind(-1)  # (T, D/2) each, float32 or float64: half-precision pairs are promoted
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2).to(x.dtype)  # real ops: compile fuses


class KVCache:
    """Keys and values of earlier positions, per layer, in `size` preallocated slots: position p lives in slot
    p % size. Without a window size = block_size and nothing wraps (a step writes in place, no history copied);
    with a window W, size = W: a rolling buffer of the last W positions, so memory and cost per token stay constant
    however long generation runs (older keys are out of every later query's window)."""

    def __init__(self, n_layer: int, B: int, H: int, size: int, D: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        self.k = [torch.empty(B, H, size, D, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.empty(B, H, size, D, device=device, dtype=dtype) for _ in range(n_layer)]
        self.pos = torch.zeros(size, dtype=torch.long, device=device)  # absolute positions
        self.doc = torch.zeros(B, size, dtype=torch.long, device=device)  # document ids, with a separator
        self.size = size
        self.length = 0  # positions seen: the next one's absolute position (the same for every layer after a forward)

    def positions(self, T: int) -> tuple[Tensor, Tensor]:
        """Store T new positions; return them (T,) and those of the keys `append` returns for them (Tk,), in order."""
        new = torch.arange(self.length, self.length + T, device=self.pos.device)
        return new, self._store(self.pos, new, 0)  # stored like keys: the keys' positions, in their order

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, H, T, D) of the T new positions; return the stored and new ones (B, H, Tk, D)."""
        return self._store(self.k[layer], k, 2), self._store(self.v[layer], v, 2)

    def documents(self, new: Tensor) -> Tensor:
        """Store the document ids (B, T) of the T new positions; return those of the keys `append` returns (B, Tk)."""
        return self._store(self.doc, new, 1)

    def last_document(self) -> Tensor | int:
        """(B, 1) document id of the last position stored, 0 before any."""
        return self.doc[:, [(self.length - 1) % self.size]] if self.length else 0

    def _store(self, held: Tensor, new: Tensor, dim: int) -> Tensor:
        """Write new (T positions along dim) into held's slots; return held's positions, then new's."""
        start, T = self.length, new.size(dim)
        if start + T <= self.size:  # room: write in place, return a view
            held.narrow(dim, start, T).copy_(new)
            return held.narrow(dim, 0, start + T)
        out = torch.cat([held.narrow(dim, 0, min(start, self.size)), new], dim=dim)
        keep = min(T, self.size)  # the newest positions overwrite the oldest
        slots = torch.arange(start + T - keep, start + T, device=new.device) % self.size
        held.index_copy_(dim, slots, new.narrow(dim, T - keep, keep))
        return out


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: qkv projection, split heads, attend, merge heads, project.

    backend "manual" runs `attention` above; "sdpa" runs PyTorch's fused kernel with the same mask. `weights` gives
    the attention weights explicitly (for the maps: sdpa does not return them).
    """

    def __init__(self, config: "GPTConfig", layer: int) -> None:
        super().__init__()
        c = config
        self.n_head, self.backend, self.dropout, self.qk_norm, self.layer = c.n_head, c.attn_backend, c.dropout, \
            c.qk_norm, layer
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)  # one matmul for q, k and v
        self.proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)

    def heads(self, x: Tensor, rope: Tensor | None = None, cache: KVCache | None = None) -> tuple[Tensor, ...]:
        """x (B, T, C) -> q (B, H, T, D), k and v (B, H, Tk, D): split into heads, normed and rotated as configured,
        after the cache's keys and values (slot `layer` gets these)."""
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head)  # (B, T, 3, H, D)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # split into heads: 3 x (B, H, T, D)
        if self.qk_norm:
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))  # unit RMS per head
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)  # before caching: cached keys stay rotated
        if cache is not None:
            k, v = cache.append(self.layer, k, v)  # (B, H, Tk, D)
        return q, k, v

    def forward(self, x: Tensor, mask: Tensor, rope: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """x (B, T, C) -> (B, T, C). mask: additive (T, Tk) or (B, 1, T, Tk); rope: (T, D/2, 2) cos, sin, None with a
        learned table; cache: see heads."""
        B, T, C = x.shape
        q, k, v = self.heads(x, rope, cache)
        p = self.dropout if self.training else 0.0
        y = fused_attention(q, k, v, mask, p) if self.backend == "sdpa" else attention(q, k, v, mask, p)[0]
        y = y.transpose(1, 2).reshape(B, T, C)  # merge heads: (B, T, C)
        return F.dropout(self.proj(y), p)

    def weights(self, x: Tensor, mask: Tensor, rope: Tensor | None = None) -> Tensor:
        """The weights (B, H, T, T) this layer gives x (B, T, C) under mask, before dropout, on either backend."""
        return attention(*self.heads(x, rope), mask)[1]


def fused_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout_p: float) -> Tensor:
    """The sdpa backend with the additive mask the model builds from `visible`: q (B, H, Tq, D), k and v (B, H, Tk, D),
    mask (Tq, Tk) or (B, 1, Tq, Tk) -> (B, H, Tq, D) in q's dtype.
    On a CPU, bf16 runs in float32: its bf16 backward is far slower (benchmarks/RESULTS.md)."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        with torch.autocast("cpu", enabled=False):
            return fused_attention(q.float(), k.float(), v.float(), mask.float(), dropout_p).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), dropout_p=dropout_p)
