"""Decoder-only GPT: GPT-2's design (pre-LayerNorm, tied LM head) plus optional rotary positions and QK norm.

Shapes: the glossary in model/attention.py.
"""

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import CausalSelfAttention, KVCache, additive_mask, documents, visible

ATTN_BACKENDS = ("manual", "sdpa")
POS_EMBS = ("learned", "rope")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """GPT architecture, validated on creation."""

    vocab_size: int
    block_size: int = 256  # longest context
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm
    attn_backend: str = "manual"  # "manual": hand-written; "sdpa": PyTorch's kernel, same mask
    pos_emb: str = "learned"  # "rope": rotate q, k by position instead of adding a table
    qk_norm: bool = False  # RMS-norm q, k per head: bounded logits at high lr
    attn_window: int = 0  # W >= 1: each query reads itself and the W - 1 keys before it; 0: every earlier key
    doc_sep: int | None = None  # the separator's token id: no query reads a key of another document; None: off

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        for name, choices in (("attn_backend", ATTN_BACKENDS), ("pos_emb", POS_EMBS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} is unknown; choose one of {choices}")
        if isinstance(self.attn_window, bool) or not isinstance(self.attn_window, int) or self.attn_window < 0:
            raise ValueError(f"GPTConfig.attn_window must be an integer >= 0 (0: no window), got {self.attn_window!r}")
        if self.attn_window > self.block_size:
            raise ValueError(f"GPTConfig.attn_window={self.attn_window} exceeds block_size={self.block_size}: give "
                             "a window <= block_size (a window the context never fills is no window)")
        if self.doc_sep is not None and not (isinstance(self.doc_sep, int) and 0 <= self.doc_sep < self.vocab_size):
            raise ValueError(f"GPTConfig.doc_sep={self.doc_sep!r} is not a token id in [0, {self.vocab_size})")
        if self.pos_emb == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"GPTConfig.pos_emb='rope' needs an even head width, got {self.n_embd // self.n_head}")

    def to_dict(self) -> dict:
        """Fields as a plain dict (checkpoint model_config)."""
        return asdict(self)


class MLP(nn.Module):
    """Position-wise feed-forward: C -> 4C -> GELU -> C."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, C)"""
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    """Pre-LN block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.attn = CausalSelfAttention(c, layer)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = MLP(c)

    def forward(self, x: Tensor, mask: Tensor, rope: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """(B, T, C) -> (B, T, C); other args: CausalSelfAttention.forward's."""
        x = x + self.attn(self.ln_1(x), mask, rope, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Language model: `forward` scores next tokens; `stream`, `generate` sample."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd) if config.pos_emb == "learned" else None
        self.blocks = nn.ModuleList([Block(config, layer) for layer in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init_weights)  # GPT-2's init in nanoGPT's order: runs reproduce
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # residual projections: variance flat in depth
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Parameter count (tied embedding once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, T: int | None = None) -> float:
        """Training FLOPs per token for MFU (PaLM's count)."""
        T = T or self.config.block_size
        N = self.num_params() - (self.pos_emb.weight.numel() if self.pos_emb is not None else 0)
        return 6 * N + 12 * self.config.n_layer * self.config.n_embd * T

    @property
    def endless(self) -> bool:
        """Whether sequences may run past block_size: rotary positions are relative and a window keeps every key
        within W - 1 of its query, so the model never meets an offset it did not train on (a table ends)."""
        return self.pos_emb is None and self.config.attn_window > 0

    def forward(self, idx: Tensor, targets: Tensor | None = None, cache: KVCache | None = None,
                start: int = 0) -> tuple[Tensor, Tensor | None]:
        """idx (B, T) -> logits (B, T, V), mean cross-entropy vs targets (B, T) or None.
        targets[:, t] FOLLOWS idx[:, t] (already shifted). idx[:, 0] is at position `start` (cache.length with a
        cache, whose keys and values the queries also read)."""
        B, T = idx.shape
        start = cache.length if cache is not None else start
        if start + T > self.config.block_size and not self.endless:
            raise ValueError(f"sequence length {start + T} exceeds block_size {self.config.block_size}; "
                             "crop it to the last block_size tokens")
        q_pos, k_pos = cache.positions(T) if cache is not None else (torch.arange(start, start + T,
                                                                                  device=idx.device),) * 2
        x = self.tok_emb(idx)  # (B, T, C)
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(q_pos)
        else:  # per call, from q_pos (a cache moves it on); float32 at least: angles grow with the position
            rope = rope_frequencies(q_pos, self.config.n_embd // self.config.n_head, dtype=x.dtype)
        x = F.dropout(x, self.config.dropout, self.training)
        docs = ()
        if self.config.doc_sep is not None:  # ids from the inputs, never the targets (those are the future)
            q_doc = documents(idx, self.config.doc_sep, cache.last_document() if cache is not None else 0)  # (B, T)
            k_doc = cache.documents(q_doc) if cache is not None else q_doc  # (B, Tk)
            docs = (q_doc[:, None, :, None], k_doc[:, None, None, :])  # against (B, 1, T, Tk)
        # (T, Tk) or (B, 1, T, Tk) for all layers, from the rule; not cached, so an edit of `visible` takes effect
        mask = additive_mask(visible(q_pos[:, None], k_pos[None, :], self.config.attn_window, *docs), x.dtype)
        for block in self.blocks:
            x = block(x, mask, rope, cache)
        if cache is not None:
            cache.length += T
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def new_cache(self, B: int) -> KVCache:
        """Empty KV cache for B sequences: block_size slots, or a rolling attn_window of them."""
        c, w = self.config, self.tok_emb.weight
        return KVCache(c.n_layer, B, c.n_head, c.attn_window or c.block_size, c.n_embd // c.n_head, w.device,
                       w.dtype)

    @torch.inference_mode()
    def generate(self, idx: Tensor, max_new_tokens: int, **options: Any) -> Tensor:
        """(B, T) prompt -> (B, T + max_new_tokens): prompt, then `stream`'s tokens."""
        return torch.cat([idx, *(t[:, None] for t in self.stream(idx, max_new_tokens, **options))], dim=1)

    @torch.inference_mode()
    def stream(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None, use_cache: bool = True,
               slide: int = 1) -> Iterator[Tensor]:
        """Yield max_new_tokens tokens (B,) after prompt idx (B, T >= 1), one at a time.

        use_cache feeds only the newest token (same result). An `endless` model runs on without a window limit: the
        cache rolls, and without it the last n_layer * (W - 1) + 1 tokens (all the next token can depend on) are
        recomputed at their positions. Otherwise a full block_size window drops its first `slide` tokens and its
        cache (slide=1: nanoGPT's crop). Other options: sample_next's.
        """
        if idx.dim() != 2 or idx.size(1) < 1:
            raise ValueError(f"generate needs a (B, T>=1) prompt, got shape {tuple(idx.shape)}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        block = self.config.block_size
        if isinstance(slide, bool) or not isinstance(slide, int) or not 1 <= slide <= block:
            raise ValueError(f"slide must be an integer in [1, block_size={block}], got {slide!r}")
        reach = self.config.n_layer * (self.config.attn_window - 1) + 1 if self.endless else block
        context, cache, n = idx[:, -block:] if not self.endless else idx, None, idx.size(1)  # n: tokens so far
        for _ in range(max_new_tokens):
            if use_cache and cache is None:
                cache = self.new_cache(idx.size(0))  # (re-)prefill: the whole context at once
            if cache is None:
                recent = context[:, -reach:]
                logits, _ = self(recent, start=n - recent.size(1) if self.endless else 0)
            else:
                logits, _ = self(context if cache.length == 0 else context[:, -1:], cache=cache)
            next_id = sample_next(logits[:, -1], temperature, top_k, top_p, generator)  # (B, 1)
            context, n = torch.cat((context[:, -reach:], next_id), dim=1), n + 1
            if context.size(1) > block and not self.endless:
                context, cache = context[:, slide:], None
            yield next_id[:, 0]


def rope_frequencies(positions: Tensor, head_dim: int, base: float = 10000.0,
                     dtype: torch.dtype = torch.float32) -> Tensor:
    """(cos, sin) of p base^(-2i/D) for positions p (T,), channel pairs i: (T, D/2, 2); float64 iff dtype is."""
    real = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=real, device=positions.device) / head_dim)
    angles = positions.to(real)[:, None] * inv_freq[None, :]  # (T, D/2)
    return torch.stack((angles.cos(), angles.sin()), -1)


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """logits (B, V) -> ids (B, 1). Temperature (0 = greedy), then the top_k likeliest, then of those
    the smallest set whose mass reaches top_p."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # float64, max at 0: a tiny temperature sends the rest to -inf, not +inf (NaN)
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None and top_p < 1:
        ranked, order = torch.sort(logits, descending=True)  # (B, V)
        probs = torch.softmax(ranked, dim=-1)
        drop = (probs.cumsum(dim=-1) - probs) >= top_p  # mass before it reaches top_p
        logits = torch.full_like(logits, -math.inf).scatter(-1, order, ranked.masked_fill(drop, -math.inf))
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1, generator=generator)
