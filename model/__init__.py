"""The network: from-scratch causal attention (model.attention) and the GPT built on it (model.gpt)."""

from .gpt import GPT, GPTConfig, sample_next

__all__ = ["GPT", "GPTConfig", "sample_next"]
