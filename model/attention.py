"""Causal multi-head self-attention, written out step by step.

Shape glossary (used in every shape comment of this package):
    B   batch size
    T   sequence length of the input (queries when training)
    Tq  number of query positions, Tk number of key positions (Tk >= Tq when decoding
        against a cache of earlier keys)
    C   embedding width (n_embd)
    H   number of heads (n_head)
    D   width of one head, C // H
    Dv  width of one head's values (= D here; kept apart where only the shapes' roles matter)
    V   vocabulary size

`attention` is the whole mechanism in five visible steps; `causal_mask` decides which key each
query may read; `CausalSelfAttention` wraps them with the projections and head bookkeeping.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["attention", "causal_mask", "combine_masks", "apply_rope", "CausalSelfAttention", "KVCache",
           "dropout_layer", "fused_attention"]


def dropout_layer(p: float) -> nn.Module:
    """nn.Dropout(p), or nn.Identity when p == 0: the same function, but Identity hands its input
    straight back where Dropout(0) still calls the dropout op (a one-token decoding step is mostly
    such per-call overhead)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


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
        allowed: bool tensor (Tq, Tk); True means "this query may read this key".
    """
    if Tq < 1 or Tk < Tq:
        raise ValueError(f"causal_mask needs 1 <= Tq <= Tk, got Tq={Tq}, Tk={Tk}")
    q_pos = torch.arange(Tq, device=device).unsqueeze(1) + (Tk - Tq)  # (Tq, 1) absolute positions
    k_pos = torch.arange(Tk, device=device).unsqueeze(0)  # (1, Tk)
    return k_pos <= q_pos  # (Tq, Tk)


def combine_masks(allowed: Tensor, key_padding: Tensor | None) -> Tensor:
    """Combine a causal mask with a key padding mask.

    Args:
        allowed: bool (Tq, Tk), e.g. from `causal_mask`.
        key_padding: bool (B, Tk), True where the key is a real token (False = padding), or None.
    Returns:
        bool (B, 1, Tq, Tk) when key_padding is given (broadcasts over heads), else (1, 1, Tq, Tk).
    """
    allowed = allowed.view(1, 1, *allowed.shape)  # (1, 1, Tq, Tk)
    if key_padding is None:
        return allowed
    if key_padding.dim() != 2 or key_padding.shape[1] != allowed.shape[-1]:
        raise ValueError(
            f"key_padding must be (B, Tk={allowed.shape[-1]}), got {tuple(key_padding.shape)}"
        )
    return allowed & key_padding.bool()[:, None, None, :]  # (B, 1, Tq, Tk)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention, every step visible.

    Args:
        q: queries (B, H, Tq, D).
        k: keys (B, H, Tk, D).
        v: values (B, H, Tk, Dv).
        allowed: bool mask broadcastable to (B, H, Tq, Tk); True = this query may read this key.
            None means every query reads every key.
        dropout_p: probability of dropping an attention weight (training only; the caller decides).
        generator: RNG for the dropout draw; None uses the global RNG.
    Returns:
        out: (B, H, Tq, Dv) weighted sum of values.
        weights: (B, H, Tq, Tk) attention weights after masking and softmax (before dropout);
            every row sums to 1 and not-allowed positions are exactly 0.
    Raises:
        ValueError: a query row has no allowed key (its softmax would be 0/0 = NaN). Checked when
            the mask is on the CPU; on a GPU such a row gives NaN instead (see below).
    """
    D = q.size(-1)
    # 1. similarity of every query with every key, scaled so the logits' variance stays ~1
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, Tq, Tk)
    if allowed is not None:
        # (a check first: a row with nothing allowed would silently become NaN below. Reading its
        # answer on the host costs microseconds on a CPU but makes a GPU wait for all queued work,
        # once per layer of every forward, so it runs for CPU masks only: the mask tests run on the
        # CPU, and on a GPU the NaN still stops training at the next log step (RunGuard). Under
        # torch.compile it would break the graph; the model's masks always keep the diagonal.)
        if allowed.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(allowed.any(dim=-1).all()):
            raise ValueError("attention: a query row has no allowed key; every query must see >= 1 key")
        # 2. mask BEFORE the softmax: -inf becomes exactly 0 weight, and the row renormalises
        scores = scores.masked_fill(~allowed, float("-inf"))  # (B, H, Tq, Tk)
    # 3. softmax over the KEY axis (each query distributes its attention over keys). Half-precision
    # inputs are promoted to float32 so exp() cannot overflow; float64 stays float64 for exact tests.
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    weights = weights.to(q.dtype)  # (B, H, Tq, Tk)
    dropped = weights
    if dropout_p > 0.0:
        # 4. dropout acts on weights that are already masked, so it can only zero a weight, never
        # re-admit a masked key
        # (generator=None is left out rather than passed: that overload of torch.rand takes concrete
        # sizes only, so torch.compile failed on it once a second batch size made the shapes dynamic)
        rng = {"generator": generator} if generator is not None else {}
        keep = torch.rand(weights.shape, device=weights.device, **rng) >= dropout_p
        dropped = weights * keep / (1.0 - dropout_p)
    # 5. each query's output is its weighted average of the values
    out = dropped @ v  # (B, H, Tq, Dv)
    return out, weights


def apply_rope(x: Tensor, freqs: Tensor) -> Tensor:
    """Rotate each pair of channels (2i, 2i + 1) of x by its position's angle (rotary embedding).

    A pair read as the complex number x_2i + i x_2i+1 is rotated by multiplying it with e^(i angle):
    one complex multiply per pair. A query at position m and a key at position n then score
    q_m . k_n as a function of m - n only: the scores see relative positions, and no position table
    is added to the embeddings.

    Args:
        x: (B, H, T, D) queries or keys.
        freqs: (T, D/2) complex, e^(i * position * frequency) for the positions of x.
    Returns:
        (B, H, T, D), x's dtype.
    """
    pairs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # complex needs fp32/fp64
    z = torch.view_as_complex(pairs.reshape(*x.shape[:-1], -1, 2))  # (B, H, T, D/2) complex
    return torch.view_as_real(z * freqs).reshape(x.shape).to(x.dtype)


def fused_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """PyTorch's fused scaled_dot_product_attention (the sdpa backend): q (B, H, Tq, D), k and v
    (B, H, Tk, D) -> (B, H, Tq, D), in q's dtype; kwargs go to F.scaled_dot_product_attention.

    On a CPU, bfloat16 inputs are computed in float32: PyTorch's CPU flash-attention backward is
    ~9x slower in bfloat16 than in float32 at this model's sizes (5.5 vs 0.6 ms per call, measured
    in benchmarks/RESULTS.md), while the matmuls around it are ~3x faster in bfloat16 (AMX).
    """
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


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
        self.length = 0  # positions already stored (same for every layer once a forward finishes)

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

    `backend="manual"` runs `attention` above (the from-scratch path, the default);
    `backend="sdpa"` runs PyTorch's fused `scaled_dot_product_attention`, the fast path.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, backend: str,
                 qk_norm: bool = False) -> None:
        """Args:
            n_embd: C, the input and output width; n_head: H, heads of width D = C // H.
            dropout: on the attention weights and the output (training only).
            bias: biases in the qkv and output projections.
            backend: "manual" or "sdpa", as above.
            qk_norm: RMS-normalise q and k per head before the scores.
        """
        super().__init__()
        self.n_head = n_head
        self.backend = backend
        self.dropout = dropout
        self.qk_norm = qk_norm
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # one fused matmul for q, k and v
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = dropout_layer(dropout)

    def forward(
        self,
        x: Tensor,
        allowed: Tensor | None,
        cache: KVCache | None = None,
        layer: int = 0,
        weights_out: list[Tensor] | None = None,
        rope: Tensor | None = None,
    ) -> Tensor:
        """Args:
            x: (B, T, C) input.
            allowed: bool (T, Tk) causal mask for these T queries against Tk keys (Tk = T without a
                cache, cache.length + T with one); None when every query may read every key (one
                new token decoding against a cache).
            cache: optional KV cache; this layer's new keys and values are appended to it.
            layer: index of this layer in the cache.
            weights_out: if a list is given, the (B, H, T, Tk) attention weights are appended to it
                (forces the manual path, which is the only one that materialises them).
            rope: (T, D/2) complex rotations for rotary positions; None with a learned position table.
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
            k, v = cache.append(layer, k, v)  # (B, H, Tk, D) with Tk = cached + T
        p = self.dropout if self.training else 0.0
        if self.backend == "sdpa" and weights_out is None:
            if k.size(2) == T and allowed is not None:
                y = fused_attention(q, k, v, dropout_p=p, is_causal=True)
            else:
                # is_causal aligns the triangle top-left, which is wrong once Tk > Tq (decoding
                # against a cache), so the bottom-right-aligned mask is passed explicitly.
                y = fused_attention(q, k, v, attn_mask=allowed, dropout_p=p)
        else:
            y, w = attention(q, k, v, allowed, dropout_p=p)  # (B, H, T, D), (B, H, T, Tk)
            if weights_out is not None:
                weights_out.append(w)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # merge heads: (B, T, C)
        return self.resid_dropout(self.proj(y))
