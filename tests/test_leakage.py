"""No position reads the future: perturbation, gradient, prefix, dropout and KV-cache checks.

Every check lives in tests/causality.py and carries its own positive control. Run on a trained
model with:  python -m pytest tests/test_leakage.py --ckpt out/shakespeare_char/ckpt.pt -s
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

import causality as C
from model import GPTConfig

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask

BACKENDS = ["manual", "sdpa"]


assert_ok = C.require


def test_causal_mask_is_the_lower_triangle():
    """On failure: causal_mask(6, 6) drawn next to the lower triangle."""
    assert_ok(C.check_causal_mask())


def test_attention_outputs_before_t_ignore_future_q_k_v():
    assert_ok(C.check_attention_future_perturbation())


def test_attention_weights_sum_to_one_and_future_weights_are_exactly_zero():
    assert_ok(C.check_attention_weights())


def test_a_masked_key_gets_zero_weight_even_when_it_outscores_every_allowed_key_by_far():
    assert_ok(C.check_attention_extreme_scores())  # catches a finite fill value such as -1e4 or -1e9


def test_attention_gradient_reaches_past_and_diagonal_but_never_future_keys():
    assert_ok(C.check_attention_gradients())


def test_attention_in_half_precision_is_finite_and_causal():
    assert_ok(C.check_attention_half_precision())


@pytest.mark.parametrize("backend", BACKENDS)
def test_future_tokens_do_not_change_past_logits(backend):
    model = C.leak_test_model(backend)
    assert_ok(C.check_future_perturbation(model, C.random_tokens(4, 10, model.config.vocab_size)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_logit_gradients_never_reach_future_embeddings(backend):
    model = C.leak_test_model(backend)
    assert_ok(C.check_gradients(model, C.random_tokens(4, 10, model.config.vocab_size)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_logits_equal_full_sequence_logits(backend):
    model = C.leak_test_model(backend)
    assert_ok(C.check_prefix_parity(model, C.random_tokens(4, 10, model.config.vocab_size)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_never_readmits_future_tokens(backend):
    assert_ok(C.check_dropout_causality(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_and_uncached_generation_draw_identical_tokens(backend):
    model = C.leak_test_model(backend)
    # 3-token prompt + 16 new tokens passes block_size 10: covers the re-prefill path too
    assert_ok(C.check_cache_parity(model, C.random_tokens(3, 3, model.config.vocab_size)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slide", [3, 10])
@pytest.mark.parametrize("options", [{}, C.MODERN], ids=["learned", "rope-qk_norm"])
def test_cached_and_uncached_generation_agree_when_the_window_slides_several_tokens(backend, slide, options):
    """slide=3: a re-prefill every third token past block_size 10, cached steps in between; slide=10:
    the window empties to the newest token. 40 new tokens cross the block several times."""
    model = C.leak_test_model(backend, **options)
    assert_ok(C.check_cache_parity(model, C.random_tokens(3, 3, model.config.vocab_size), 40, slide=slide))


def test_leak_checks_pass_on_checkpoint_weights(request, tmp_path):
    """With --ckpt PATH: the checks on that trained model. Without: on a checkpoint written here
    from a re-drawn model, so the load path is exercised either way."""
    path = request.config.getoption("--ckpt")
    if path is None:
        from training import save_checkpoint

        model = C.leak_test_model("manual").float()
        path = tmp_path / "ckpt.pt"
        save_checkpoint(path, {"model": model.state_dict(), "model_config": model.config.to_dict(),
                               "config": {}, "vocab": {"chars": [chr(97 + i) for i in range(13)]}, "step": 0})
    checks = C.checkpoint_checks(str(path))
    for check in checks:
        print(check)
    assert_ok(*checks)


# --- every model option, in every combination ------------------------------------------------------

OPTION_VALUES = {  # each GPTConfig option and the values the leakage suite covers
    "attn_backend": ["manual", "sdpa"],
    "pos_emb": ["learned", "rope"],
    "qk_norm": [False, True],
}
SIZE_FIELDS = {"vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias"}
COMBINATIONS = [dict(zip(OPTION_VALUES, values, strict=True))
                for values in itertools.product(*OPTION_VALUES.values())]


def test_the_option_matrix_covers_every_model_option():
    options = {f.name for f in dataclasses.fields(GPTConfig)} - SIZE_FIELDS
    assert options == set(OPTION_VALUES), f"add {options - set(OPTION_VALUES)} to OPTION_VALUES"


@pytest.mark.parametrize("options", COMBINATIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_every_combination_of_model_options_is_causal(options):
    """Perturbation, gradient, prefix and KV-cache checks (rope included) for each combination; also
    with dropout, since rotary positions reach attention another way than a position table."""
    backend, rest = options["attn_backend"], {k: v for k, v in options.items() if k != "attn_backend"}
    model = C.leak_test_model(backend, **rest)
    checks = C.model_checks(model, C.random_tokens(3, 8, model.config.vocab_size))
    checks.append(C.check_dropout_causality(backend, **rest))
    assert_ok(*checks)
