"""A decoder-only GPT: token + position embeddings, pre-LayerNorm blocks, tied LM head.

The defaults are GPT-2's (and nanoGPT's) choices. Two later techniques are options, each a few
lines, because they won in the fast recipes' ablation (benchmarks/RESULTS.md): rotary positions
and QK normalisation. (RMSNorm, ReLU², an untied head, zero-initialised projections and logit
soft-capping were tried too and did not pay here; RESULTS.md has their figures.)

Shapes use the glossary in model/attention.py (B, T, C, H, D, V).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import CausalSelfAttention, KVCache, additive_mask, causal_mask

ATTN_BACKENDS = ("manual", "sdpa")
POS_EMBS = ("learned", "rope")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Architecture of a GPT. Frozen so a model's shape cannot drift after it is built."""

    vocab_size: int
    block_size: int = 256  # longest context the position table covers
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm; nanoGPT's char recipes train without
    attn_backend: str = "manual"  # "manual" (from scratch) or "sdpa" (fused, fast)
    # later techniques, off by default (GPT-2's choices)
    pos_emb: str = "learned"  # "rope": rotate q and k by their position instead of adding a table (RoFormer)
    qk_norm: bool = False  # RMS-normalise q and k per head: attention logits stay bounded at high lr

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        for name, choices in (("attn_backend", ATTN_BACKENDS), ("pos_emb", POS_EMBS)):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"GPTConfig.{name}={getattr(self, name)!r} is unknown; choose one of {choices}"
                )
        if self.pos_emb == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"GPTConfig.pos_emb='rope' needs an even head width, got "
                             f"n_embd // n_head = {self.n_embd // self.n_head}")

    def to_dict(self) -> dict:
        """The fields as a plain dict (what a checkpoint stores as model_config)."""
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
    """Pre-LayerNorm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.attn = CausalSelfAttention(c.n_embd, c.n_head, c.dropout, c.bias, c.attn_backend, c.qk_norm, layer)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = MLP(c)

    def forward(self, x: Tensor, mask: Tensor, rope: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """(B, T, C) -> (B, T, C); see CausalSelfAttention.forward for the other arguments."""
        x = x + self.attn(self.ln_1(x), mask, rope, cache)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """The language model. `forward` scores next tokens; `generate` and `stream` sample continuations."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd) if config.pos_emb == "learned" else None
        self.blocks = nn.ModuleList([Block(config, layer) for layer in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: the input embedding and the output projection share one matrix
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth (two residual additions per block)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of parameters (the tied embedding/head matrix counted once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, T: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), counted as nanoGPT and PaLM do: 6 per weight
        of the non-position parameters, plus 12 * n_layer * n_embd * T for the scores and the weighted
        sum of values (the causal half counted in full, by convention). Used for MFU."""
        T = T or self.config.block_size
        N = self.num_params() - (self.pos_emb.weight.numel() if self.pos_emb is not None else 0)
        return 6 * N + 12 * self.config.n_layer * self.config.n_embd * T

    def forward(self, idx: Tensor, targets: Tensor | None = None,
                cache: KVCache | None = None) -> tuple[Tensor, Tensor | None]:
        """Next-token logits and, given targets, their mean cross-entropy.

        Args:
            idx: token ids (B, T); with a cache, the T positions after the cache.length cached ones.
            targets: (B, T) token ids; targets[:, t] is the token that FOLLOWS idx[:, t]. The shift
                is done once, in data.inputs_and_targets; here position t is scored against targets[:, t].
            cache: optional KV cache holding the keys and values of the positions before idx.
        Returns:
            logits: (B, T, V).
            loss: scalar mean cross-entropy over all B*T positions, or None without targets.
        """
        B, T = idx.shape
        start = cache.length if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence length {start + T} exceeds block_size {self.config.block_size}; "
                             "crop the context to the last block_size tokens")
        x = self.tok_emb(idx)  # (B, T, C)
        positions = torch.arange(start, start + T, device=idx.device)  # (T,) after the cached ones
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)  # + (T, C)
        else:
            # (T, D/2) complex, per forward rather than a buffer: Module.to(dtype) would cast a complex
            # buffer to a real dtype, dropping its imaginary part
            rope = rope_frequencies(positions, self.config.n_embd // self.config.n_head, dtype=x.dtype)
        x = F.dropout(x, self.config.dropout, self.training)
        # the (T, Tk) mask, built once per forward and shared by every layer; built afresh each time
        # so that an edit of causal_mask reaches an existing model at once
        mask = additive_mask(causal_mask(T, start + T, device=idx.device), x.dtype)
        for block in self.blocks:
            x = block(x, mask, rope, cache)
        if cache is not None:
            cache.length = start + T
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def new_cache(self, B: int) -> KVCache:
        """An empty KV cache for B sequences of up to block_size positions, on the model's device."""
        c, w = self.config, self.tok_emb.weight
        return KVCache(c.n_layer, B, c.n_head, c.block_size, c.n_embd // c.n_head, w.device, w.dtype)

    @torch.inference_mode()
    def generate(self, idx: Tensor, max_new_tokens: int, **options: Any) -> Tensor:
        """(B, T) prompt -> (B, T + max_new_tokens): the prompt and the tokens `stream` draws after it."""
        return torch.cat([idx, *(t[:, None] for t in self.stream(idx, max_new_tokens, **options))], dim=1)

    @torch.inference_mode()
    def stream(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        slide: int = 1,
    ) -> Iterator[Tensor]:
        """Sample max_new_tokens tokens after idx, yielding each (B,) as soon as it is drawn.

        The model reads a window of at most block_size tokens. With use_cache, keys and values of
        the window's earlier positions are kept per layer and each step feeds one new token. Once
        the window is full it slides: its first `slide` tokens are dropped, which moves every
        remaining token to another position, so the cache is rebuilt from the new window in one
        forward (a re-prefill). slide=1 keeps the window full, as nanoGPT's crop-and-recompute does,
        and re-prefills every step; slide=k re-prefills once every k tokens, each token then reading
        between block_size - k + 1 and block_size tokens of context. use_cache=False recomputes the
        same windows in full, so both paths give the same tokens for any slide.

        Args:
            idx: (B, T) prompt token ids, T >= 1.
            max_new_tokens: number of tokens to draw.
            temperature, top_k, top_p, generator: as sample_next.
            use_cache: use the KV cache (identical tokens, much faster).
            slide: how many tokens a full window drops at once, 1 <= slide <= block_size.
        """
        if idx.dim() != 2 or idx.size(1) < 1:
            raise ValueError(f"generate needs a (B, T>=1) prompt, got shape {tuple(idx.shape)}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        block = self.config.block_size
        if isinstance(slide, bool) or not isinstance(slide, int) or not 1 <= slide <= block:
            raise ValueError(f"slide must be an integer in [1, block_size={block}], got {slide!r}")
        context = idx[:, -block:]  # (B, <=block) the window the next token is predicted from
        cache: KVCache | None = None  # keys and values of context[:, :-1], while they are valid
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = self(context)
            elif cache is None:  # (re-)prefill: the whole window in one forward
                cache = self.new_cache(idx.size(0))
                logits, _ = self(context, cache=cache)
            else:
                logits, _ = self(context[:, -1:], cache=cache)  # only the newest token
            next_id = sample_next(logits[:, -1], temperature, top_k, top_p, generator)  # (B, 1)
            context = torch.cat((context, next_id), dim=1)
            if context.size(1) > block:
                # the window slides: every token left in it moves to another position, so no cached
                # key is valid any more
                context, cache = context[:, slide:], None
            yield next_id[:, 0]


def rope_frequencies(positions: int | Tensor, head_dim: int, base: float = 10000.0,
                     dtype: torch.dtype = torch.float32) -> Tensor:
    """e^(i * p * base^(-2i/D)) for every position p and channel pair i: the rotary rotations.

    Args:
        positions: (T,) integer positions, or an int T for positions 0..T-1.
        head_dim: D, the width of one head (even).
        dtype: the model's dtype; the angles are computed in float64 for a float64 model, in float32
            for every other.
    Returns:
        (T, D/2) complex (complex128 for float64, else complex64), on the positions' device.
    """
    if isinstance(positions, int):
        positions = torch.arange(positions)
    real = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=real, device=positions.device) / head_dim)
    angles = positions.to(real)[:, None] * inv_freq[None, :]  # (T, D/2)
    return torch.polar(torch.ones_like(angles), angles)


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw one token per row from logits (B, V); returns (B, 1) token ids."""
    if not (math.isfinite(temperature) and temperature >= 0):  # NaN fails every comparison: test it first
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # greedy
    # float64, shifted so the largest is 0: a tiny temperature (float32 would round 1e-300 to 0) then
    # sends the others to -inf instead of overflowing to +inf and making the softmax NaN. (B, V) only.
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    return torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
