"""The network: from-scratch causal attention and the GPT built on it."""

from .attention import CausalSelfAttention, KVCache, attention, causal_mask, combine_masks
from .gpt import GPT, GPTConfig, sample_next

__all__ = [
    "GPT",
    "GPTConfig",
    "CausalSelfAttention",
    "KVCache",
    "attention",
    "causal_mask",
    "combine_masks",
    "sample_next",
]
