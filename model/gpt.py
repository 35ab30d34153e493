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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import CausalSelfAttention, KVCache, causal_mask, dropout_layer

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
        self.dropout = dropout_layer(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, C)"""
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(
            config.n_embd, config.n_head, config.dropout, config.bias, config.attn_backend, config.qk_norm
        )
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, allowed: Tensor | None, cache: KVCache | None = None, layer: int = 0,
                weights_out: list[Tensor] | None = None, rope: Tensor | None = None) -> Tensor:
        """(B, T, C) -> (B, T, C); see CausalSelfAttention.forward for the other arguments."""
        x = x + self.attn(self.ln_1(x), allowed, cache, layer, weights_out, rope)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """The language model. `forward` scores next tokens; `generate` samples continuations."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd) if config.pos_emb == "learned" else None
        self.drop = dropout_layer(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
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
        """Training FLOPs per token (forward + backward), counted as nanoGPT and PaLM do.

        6 per weight for the matmuls (2 forward, 4 backward) over the non-position parameters (the
        tied embedding counts once, as the LM head's matmul), plus 12 * n_layer * n_embd * T for
        the attention scores and the weighted sum of values (the causal half counted in full, by
        convention). Used for MFU.
        """
        T = T or self.config.block_size
        N = self.num_params()
        if self.pos_emb is not None:
            N -= self.pos_emb.weight.numel()
        return 6 * N + 12 * self.config.n_layer * self.config.n_embd * T

    def hidden(self, idx: Tensor, cache: KVCache | None = None,
               weights_out: list[Tensor] | None = None) -> Tensor:
        """Final hidden states before the LM head.

        Args:
            idx: token ids (B, T).
            cache: optional KV cache holding the keys/values of the positions before idx.
            weights_out: optional list that receives each layer's (B, H, T, Tk) attention weights.
        Returns:
            (B, T, C)
        """
        B, T = idx.shape
        start = cache.length if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(
                f"sequence length {start + T} exceeds block_size {self.config.block_size}; "
                "crop the context to the last block_size tokens"
            )
        x = self.tok_emb(idx)  # (B, T, C)
        positions = torch.arange(start, start + T, device=idx.device)  # (T,) after the cached ones
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)  # + (T, C)
        else:
            # (T, D/2) complex, for these positions only: a few small ops per forward. Not a buffer built
            # once: Module.to(dtype) casts a complex buffer to the real dtype and drops its imaginary part
            # (with only a warning), which silently broke the positions of a model cast with .to(bfloat16).
            rope = rope_frequencies(positions, self.config.n_embd // self.config.n_head)
        x = self.drop(x)
        # (T, Tk), built once per forward and shared by every layer: ~10 us on a CPU, under 0.05% of
        # a laptop-recipe step (benchmarks/micro.py). Not a buffer cached at construction, so that an
        # edit of causal_mask (or a test's substitute for it) takes effect on the next forward of an
        # existing model.
        # One new query against a cache may read every cached key (all are its past), so decoding
        # steps skip the mask: same numbers, less work per token.
        allowed = None if cache is not None and T == 1 else causal_mask(T, start + T, device=idx.device)
        for i, block in enumerate(self.blocks):
            x = block(x, allowed, cache, i, weights_out, rope)
        if cache is not None:
            cache.length = start + T
        return self.ln_f(x)  # (B, T, C)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Next-token logits and, given targets, their mean cross-entropy.

        Args:
            idx: token ids (B, T), T <= block_size.
            targets: (B, T) token ids; targets[:, t] is the token that FOLLOWS idx[:, t]. The shift
                is done once, in data.get_batch; here position t is scored against targets[:, t].
        Returns:
            logits: (B, T, V).
            loss: scalar mean cross-entropy over all B*T positions, or None without targets.
        """
        logits = self.lm_head(self.hidden(idx))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def attention_maps(self, idx: Tensor) -> list[Tensor]:
        """Attention weights of every layer for idx (B, T): a list of n_layer tensors (B, H, T, T)."""
        weights: list[Tensor] = []
        self.hidden(idx, weights_out=weights)
        return weights

    @torch.inference_mode()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        slide: int = 1,
    ) -> Tensor:
        """Sample max_new_tokens tokens after idx.

        The model reads a window of at most block_size tokens. With use_cache, keys and values of
        the window's earlier positions are kept per layer and each step feeds one new token. Once
        the window is full it slides: its first `slide` tokens are dropped, which moves every
        remaining token to another position, so the cache is rebuilt from the new window in one
        forward (a re-prefill). slide=1 keeps the window full, as nanoGPT's crop-and-recompute does,
        and re-prefills every step: exact, but no faster than use_cache=False. slide=k re-prefills
        once every k tokens and decodes the rest from the cache; each token then reads between
        block_size - k + 1 and block_size tokens of context. use_cache=False follows the same
        windows by recomputing each one in full, so both paths give the same tokens for any slide.

        Args:
            idx: (B, T) prompt token ids, T >= 1.
            max_new_tokens: number of tokens to append.
            temperature: divides the logits; 0 means greedy (argmax).
            top_k: keep only the k most likely tokens before sampling.
            top_p: keep the smallest set of tokens whose probability mass reaches top_p.
            generator: RNG for sampling.
            use_cache: use the KV cache (identical tokens, much faster).
            slide: how many tokens a full window drops at once, 1 <= slide <= block_size.
        Returns:
            (B, T + max_new_tokens) token ids.
        """
        new = list(self.stream(idx, max_new_tokens, temperature, top_k, top_p, generator, use_cache, slide))
        return torch.cat([idx, *(t[:, None] for t in new)], dim=1)

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
        """Like generate, but yields each new token (B,) as soon as it is drawn."""
        if idx.dim() != 2 or idx.size(1) < 1:
            raise ValueError(f"generate needs a (B, T>=1) prompt, got shape {tuple(idx.shape)}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        block = self.config.block_size
        if isinstance(slide, bool) or not isinstance(slide, int) or not 1 <= slide <= block:
            raise ValueError(f"slide must be an integer in [1, block_size={block}], got {slide!r}")
        context = idx[:, -block:]  # (B, <=block) the window the next token is predicted from
        cache: KVCache | None = None  # keys and values of context[:, :-1], when they are still valid
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = self.lm_head(self.hidden(context)[:, -1])  # (B, V)
            else:
                if cache is None:  # (re-)prefill: the whole window in one forward
                    cache = self._new_cache(idx.size(0), idx.device)
                    h = self.hidden(context, cache)
                else:
                    h = self.hidden(context[:, -1:], cache)  # only the newest token
                logits = self.lm_head(h[:, -1])  # (B, V)
            next_id = sample_next(logits, temperature, top_k, top_p, generator)  # (B, 1)
            context = torch.cat((context, next_id), dim=1)
            if context.size(1) > block:
                # the window slides: every token left in it moves to another position (and has lost
                # some of its own context), so no cached key is valid any more
                context, cache = context[:, slide:], None
            yield next_id[:, 0]

    def _new_cache(self, B: int, device: torch.device) -> KVCache:
        c = self.config
        dtype = self.tok_emb.weight.dtype
        return KVCache(c.n_layer, B, c.n_head, c.block_size, c.n_embd // c.n_head, device, dtype)


def rope_frequencies(positions: int | Tensor, head_dim: int, base: float = 10000.0) -> Tensor:
    """e^(i * p * base^(-2i/D)) for every position p and channel pair i: the rotary rotations.

    Args:
        positions: (T,) integer positions, or an int T for positions 0..T-1.
        head_dim: D, the width of one head (even).
    Returns:
        (T, D/2) complex64, on the positions' device; computed in float32 whatever the model's dtype.
    """
    if isinstance(positions, int):
        positions = torch.arange(positions)
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2)
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
