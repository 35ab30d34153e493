"""Causal multi-head self-attention, written out step by step.

Shape glossary (used in every shape comment of this package):
    B   batch size
    T   sequence length of the input (queries when training)
    Tq  number of query positions, Tk number of key positions (Tk >= Tq when decoding
        against a cache of earlier keys)
    C   embedding width (n_embd)
    H   number of heads (n_head)
    D   width of one head, C // H
    V   vocabulary size

`causal_mask` decides which key each query may read, and is the only place that decides it: every
backend, the KV cache, the loss and the attention maps obey the mask it builds. `attention` is the
whole mechanism, softmax(Q Kᵀ / √D + M) V, in five visible steps. `CausalSelfAttention` wraps it
with the projections and the head bookkeeping.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["causal_mask", "additive_mask", "attention", "apply_rope", "KVCache", "CausalSelfAttention"]


def causal_mask(Tq: int, Tk: int, device: torch.device | str | None = None) -> Tensor:
    """Which keys each query may read: key j is allowed for query i iff j <= i + (Tk - Tq).

    The offset (Tk - Tq) aligns the queries with the *last* Tq keys, so the same function serves
    training (Tq == Tk: the usual lower triangle) and decoding, where Tq new queries attend to a
    longer history of Tk keys that ends with their own.

    Args:
        Tq: number of query positions (>= 1).
        Tk: number of key positions (>= Tq).
        device: where to build the mask.
    Returns:
        allowed: bool (Tq, Tk); True means "this query may read this key".
    """
    if Tq < 1 or Tk < Tq:
        raise ValueError(f"causal_mask needs 1 <= Tq <= Tk, got Tq={Tq}, Tk={Tk}")
    q_pos = torch.arange(Tq, device=device).unsqueeze(1) + (Tk - Tq)  # (Tq, 1) absolute positions
    k_pos = torch.arange(Tk, device=device).unsqueeze(0)  # (1, Tk)
    return k_pos <= q_pos  # (Tq, Tk)


def additive_mask(allowed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The mask M the scores are added to: 0 where a key is allowed, -inf where it is not.

    -inf, not a large negative number: exp(-inf) is exactly 0 in every dtype, while a finite fill
    (-1e4, -1e9) loses to a score below it, or overflows float16.

    Args:
        allowed: bool, e.g. causal_mask's (Tq, Tk), or anything broadcastable to (B, H, Tq, Tk).
        dtype: M's dtype (the scores' dtype).
    Returns:
        M: allowed's shape, in dtype.
    Raises:
        ValueError: a query row allows no key (its softmax would be 0/0 = NaN). Checked for CPU masks
            outside torch.compile: on a GPU reading the answer would stall the device once per
            forward; there a NaN loss stops training at the next log step instead.
    """
    if allowed.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(allowed.any(-1).all()):
        query = (~allowed.any(-1)).nonzero()[0, -1].item()
        raise ValueError(f"attention mask: query {query} may read no key, so its softmax would be 0/0; every "
                         "query must see >= 1 key (see model/attention.py:causal_mask)")
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
              dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention, softmax(Q Kᵀ / √D + M) V, every step visible.

    Args:
        q: queries (B, H, Tq, D).
        k: keys (B, H, Tk, D).
        v: values (B, H, Tk, D).
        mask: M from additive_mask (0 = may read, -inf = may not), broadcastable to (B, H, Tq, Tk),
            or a bool `allowed` mask (converted here); None means every query reads every key.
        dropout_p: probability of dropping an attention weight (training only; the caller decides).
    Returns:
        out: (B, H, Tq, D) weighted sum of values.
        weights: (B, H, Tq, Tk) attention weights after masking and softmax (before dropout);
            every row sums to 1 and masked keys are exactly 0.
    """
    B, H, Tq, D = q.shape
    Tk = k.size(2)
    if mask is None:
        mask = torch.zeros((), dtype=q.dtype, device=q.device)
    elif mask.dtype == torch.bool:
        mask = additive_mask(mask, q.dtype)
    # 1. + 2. scores = Q Kᵀ / √D + M in one matmul: the scale keeps the logits' variance ~1, and
    # adding M BEFORE the softmax turns every masked score into -inf, i.e. exactly 0 weight.
    # (baddbmm works on 3-D stacks: the heads are folded into the batch, the mask broadcasts.)
    M = mask.broadcast_to(B, H, Tq, Tk).reshape(B * H, Tq, Tk)  # a view unless the mask varies per row
    scores = torch.baddbmm(M, q.reshape(B * H, Tq, D), k.reshape(B * H, Tk, D).transpose(1, 2),
                           alpha=1.0 / math.sqrt(D))  # (B*H, Tq, Tk)
    # 3. softmax over the KEY axis: each query spreads one unit of attention over the keys (PyTorch
    # computes a half-precision softmax in float32 inside the kernel: exp() cannot overflow)
    weights = torch.softmax(scores, dim=-1).view(B, H, Tq, Tk)
    # 4. dropout on the weights that are already masked: it can zero a weight, never re-admit a key
    dropped = F.dropout(weights, dropout_p)
    # 5. each query's output is its weighted average of the values
    out = dropped @ v  # (B, H, Tq, D)
    return out, weights


def apply_rope(x: Tensor, freqs: Tensor) -> Tensor:
    """Rotate each pair of channels (2i, 2i + 1) of x by its position's angle (rotary embedding).

    A pair read as the complex number x_2i + i x_2i+1 is multiplied by e^(i angle). A query at
    position m and a key at position n then score q_m . k_n as a function of m - n only.

    Args:
        x: (B, H, T, D) queries or keys.
        freqs: (T, D/2) complex, e^(i * position * frequency) for the positions of x.
    Returns:
        (B, H, T, D), x's dtype.
    """
    pairs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # complex needs fp32/fp64
    z = torch.view_as_complex(pairs.reshape(*x.shape[:-1], -1, 2))  # (B, H, T, D/2) complex
    return torch.view_as_real(z * freqs).reshape(x.shape).to(x.dtype)


class KVCache:
    """Keys and values of earlier positions, one pair per layer, for incremental decoding.

    Preallocated to `max_len` positions so each decoding step writes in place instead of
    concatenating (which would copy the whole history every token).
    """

    def __init__(self, n_layer: int, B: int, H: int, max_len: int, D: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        """Room for max_len positions of (B, H, ·, D) keys and values in each of n_layer layers."""
        self.k = [torch.empty(B, H, max_len, D, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.empty(B, H, max_len, D, device=device, dtype=dtype) for _ in range(n_layer)]
        self.max_len = max_len
        self.length = 0  # positions already stored (the same for every layer once a forward finishes)

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, H, Tq, D) after the cached ones; return all keys and values (B, H, Tk, D)."""
        start, end = self.length, self.length + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked to store up to {end}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: qkv projection, split heads, attend, merge, project.

    `backend="manual"` runs `attention` above (the from-scratch path, the default); `"sdpa"` runs
    PyTorch's fused scaled_dot_product_attention with the same mask. Set `keep_weights` to keep the
    last forward's attention weights in `weights` (the manual path, whatever the backend).
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, backend: str, qk_norm: bool,
                 layer: int) -> None:
        """Args:
            n_embd: C, the input and output width; n_head: H, heads of width D = C // H.
            dropout: on the attention weights and the output (training only).
            bias: biases in the qkv and output projections.
            backend: "manual" or "sdpa", as above.
            qk_norm: RMS-normalise q and k per head before the scores.
            layer: this block's index: its slot in a KV cache.
        """
        super().__init__()
        self.n_head, self.backend, self.dropout, self.qk_norm, self.layer = n_head, backend, dropout, qk_norm, layer
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # one fused matmul for q, k and v
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.keep_weights = False
        self.weights: Tensor | None = None  # (B, H, T, Tk) when keep_weights

    def forward(self, x: Tensor, mask: Tensor, rope: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """Args:
            x: (B, T, C) input.
            mask: additive (T, Tk) mask from additive_mask(causal_mask(T, Tk)); Tk = T without a cache,
                cache.length + T with one.
            rope: (T, D/2) complex rotations for rotary positions; None with a learned position table.
            cache: optional KV cache; this layer's new keys and values are appended to it.
        Returns:
            (B, T, C)
        """
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head)  # (B, T, 3, H, D)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # split into heads: 3 x (B, H, T, D)
        if self.qk_norm:
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))  # unit RMS per head
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)  # before caching: cached keys stay rotated
        if cache is not None:
            k, v = cache.append(self.layer, k, v)  # (B, H, Tk, D) with Tk = cached + T
        p = self.dropout if self.training else 0.0
        if self.backend == "sdpa" and not self.keep_weights:
            y = fused_attention(q, k, v, mask, p)  # (B, H, T, D)
        else:
            y, w = attention(q, k, v, mask, p)  # (B, H, T, D), (B, H, T, Tk)
            self.weights = w if self.keep_weights else None
        y = y.transpose(1, 2).reshape(B, T, C)  # merge heads: (B, T, C)
        return F.dropout(self.proj(y), p)


def fused_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout_p: float) -> Tensor:
    """The sdpa backend: F.scaled_dot_product_attention with causal_mask's additive mask; q (B, H, Tq, D),
    k and v (B, H, Tk, D) -> (B, H, Tq, D), in q's dtype.

    On a CPU, bfloat16 is computed in float32: PyTorch's CPU bf16 attention backward is ~9x slower
    than its float32 one at these sizes (benchmarks/RESULTS.md).
    """
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        with torch.autocast("cpu", enabled=False):
            return fused_attention(q.float(), k.float(), v.float(), mask.float(), dropout_p).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), dropout_p=dropout_p)
