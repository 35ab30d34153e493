"""No position reads the future: perturbation, gradient, prefix, dropout and KV-cache checks, on every
combination of the model's options. Every check lives in tests/causality.py, with its positive control;
a failure says which (query, key) pair leaked and in which layer.

On a trained model:  python -m pytest tests/test_causality.py -k checkpoint --ckpt out/RUN/ckpt.pt -s
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

import causality as C
from model import GPTConfig

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask

OPTION_VALUES = {"attn_backend": ["manual", "sdpa"], "pos_emb": ["learned", "rope"], "qk_norm": [False, True]}
COMBINATIONS = [dict(zip(OPTION_VALUES, v, strict=True)) for v in itertools.product(*OPTION_VALUES.values())]
ATTENTION_CHECKS = [C.check_causal_mask, C.check_attention_future_perturbation, C.check_attention_weights,
                    C.check_attention_extreme_scores, C.check_attention_gradients, C.check_attention_half_precision]


@pytest.mark.parametrize("check", ATTENTION_CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_attention_reads_no_future_key(check):
    """The mask is the lower triangle (drawn on failure); outputs before j ignore q, k, v at j; future weights
    are exactly 0 even when a masked score beats every allowed one by ~1e300; gradients reach the past and
    the diagonal, never the future; half precision stays finite and causal."""
    C.require(check())


def test_the_option_matrix_covers_every_model_option():
    options = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "block_size", "n_layer", "n_head",
                                                                 "n_embd", "dropout", "bias"}
    assert options == set(OPTION_VALUES), f"add {options - set(OPTION_VALUES)} to OPTION_VALUES"


@pytest.mark.parametrize("options", COMBINATIONS, ids=lambda o: "-".join(map(str, o.values())))
def test_no_position_reads_the_future_for_any_combination_of_options(options):
    """Future perturbation (bit-identical past logits), gradients, prefix parity, KV-cache parity and a
    chunked prefill, then the same perturbation in train mode with dropout."""
    backend, rest = options["attn_backend"], {k: v for k, v in options.items() if k != "attn_backend"}
    model = C.leak_test_model(backend, **rest)
    x = C.random_tokens(4, model.config.block_size, model.config.vocab_size)
    C.require(*C.model_checks(model, x), C.check_dropout_causality(backend, **rest))


@pytest.mark.parametrize("slide", [3, 10])
@pytest.mark.parametrize("options", [{}, C.MODERN], ids=["learned", "rope-qk_norm"])
def test_cached_and_uncached_generation_agree_when_the_window_slides(options, slide):
    """40 new tokens past block_size 10: a re-prefill every `slide` tokens, cached steps in between."""
    for backend in ("manual", "sdpa"):
        model = C.leak_test_model(backend, **options)
        C.require(C.check_cache_parity(model, C.random_tokens(3, 3, model.config.vocab_size), 40, slide=slide))


def test_the_checks_pass_on_checkpoint_weights(request, tmp_path):
    """With --ckpt PATH: on that trained model. Without: on a checkpoint of a re-drawn model written here."""
    path = request.config.getoption("--ckpt")
    if path is None:
        from training import save_checkpoint

        model = C.leak_test_model("manual").float()
        path = tmp_path / "ckpt.pt"
        save_checkpoint(path, {"model": model.state_dict(), "model_config": model.config.to_dict(), "config": {},
                               "vocab": {"chars": [chr(97 + i) for i in range(13)]}, "step": 0})
    checks = C.checkpoint_checks(str(path))
    print(*checks, sep="\n")
    C.require(*checks)
