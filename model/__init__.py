"""The network: from-scratch causal attention (model.attention) and the GPT built on it (model.gpt).

`from model import GPT, GPTConfig` is the public API. The attention pieces are imported from their
module, `from model.attention import attention, causal_mask`, so that `model.attention` always names
the module (re-exporting the function here would shadow it).
"""

from .gpt import GPT, GPTConfig, sample_next

__all__ = ["GPT", "GPTConfig", "sample_next"]
