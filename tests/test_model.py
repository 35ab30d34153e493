"""The GPT: config validation, init, loss, learning, generation. (Causality: tests/test_leakage.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from causality import redraw_parameters_
from model import GPT, GPTConfig


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=11, block_size=12, n_layer=2, n_head=2, n_embd=16)
    return GPTConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "field, kwargs, match",
    [
        ("n_embd", dict(n_embd=30, n_head=4), "n_embd=30 must be divisible by n_head=4"),
        ("n_layer", dict(n_layer=0), "n_layer must be a positive integer"),
        ("vocab_size", dict(vocab_size=-3), "vocab_size must be a positive integer"),
        ("block_size", dict(block_size=2.5), "block_size must be a positive integer"),
        ("attn_backend", dict(attn_backend="flash"), "attn_backend='flash' is unknown"),
        ("dropout", dict(dropout=1.0), "dropout must be in"),
    ],
)
def test_invalid_model_config_raises_naming_the_field(field, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kwargs)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        tiny().n_layer = 3


def test_initial_loss_is_about_ln_vocab():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32))
    x = torch.randint(65, (8, 32))
    _, loss = model(x, torch.randint(65, (8, 32)))
    assert abs(loss.item() - math.log(65)) < 0.1


def test_loss_is_cross_entropy_of_each_position_against_its_target():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    x, y = torch.randint(11, (3, 12)), torch.randint(11, (3, 12))
    logits, loss = model(x, y)
    by_hand = torch.stack([-torch.log_softmax(logits[b, t], -1)[y[b, t]] for b in range(3) for t in range(12)])
    torch.testing.assert_close(loss, by_hand.mean())


def test_model_overfits_a_single_batch():
    torch.manual_seed(0)
    model = GPT(tiny(n_embd=32))
    x, y = torch.randint(11, (4, 12)), torch.randint(11, (4, 12))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


def test_lm_head_is_tied_to_token_embedding_and_residual_projections_are_scaled():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=8, n_head=4, n_embd=256))
    assert model.lm_head.weight is model.tok_emb.weight
    std = model.blocks[0].attn.proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_input_longer_than_block_size_names_both_lengths():
    model = GPT(tiny())
    with pytest.raises(ValueError, match="sequence length 13 exceeds block_size 12"):
        model(torch.zeros(1, 13, dtype=torch.long))


def test_greedy_generation_is_argmax_of_the_cropped_context():
    model = redraw_parameters_(GPT(tiny()).double()).eval()
    prompt = torch.randint(11, (2, 20))  # longer than block_size: only the last 12 tokens are read
    out = model.generate(prompt, 1, temperature=0)
    logits, _ = model(prompt[:, -12:])
    assert torch.equal(out[:, -1], logits[:, -1].argmax(-1))


def greedy_over_windows(model: GPT, prompt: torch.Tensor, n: int, slide: int) -> torch.Tensor:
    """The documented windows, by index: predict from seq[start:], and once the window holds more
    than block_size tokens move its start `slide` tokens on. Greedy, one full forward per token."""
    block, seq = model.config.block_size, prompt
    start = max(0, prompt.size(1) - block)
    for _ in range(n):
        logits, _ = model(seq[:, start:])
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        if seq.size(1) - start > block:
            start += slide
    return seq


@pytest.mark.parametrize("prompt_len", [3, 20])  # shorter and longer than block_size 12
@pytest.mark.parametrize("slide", [1, 5, 12])
@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_past_block_size_reads_the_documented_windows(prompt_len, slide, use_cache):
    model = redraw_parameters_(GPT(tiny()).double()).eval()
    prompt = torch.randint(11, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    out = model.generate(prompt, 40, temperature=0, use_cache=use_cache, slide=slide)
    assert torch.equal(out, greedy_over_windows(model, prompt, 40, slide))
    # positive control: another slide reads other windows and, here, draws other tokens
    other = 7 if slide != 7 else 2
    assert not torch.equal(out, greedy_over_windows(model, prompt, 40, other))


@pytest.mark.parametrize("slide, fed", [
    # 3-token prompt, block_size 12, 30 new tokens. The window first overflows after the 10th token.
    # slide=4: the 9 tokens left are re-prefilled, then 3 steps of one token, and again
    (4, [3] + [1] * 9 + ([9] + [1] * 3) * 5),
    # slide=1: the window stays full, so every step from then on is a full re-prefill
    (1, [3] + [1] * 9 + [12] * 20),
])
def test_the_cache_feeds_one_token_per_step_between_slides(slide, fed):
    """The speed claim, counted: how many tokens each forward of the cached path processes."""
    model = GPT(tiny()).eval()
    seen = []
    model.register_forward_pre_hook(lambda _m, args: seen.append(args[0].size(1)))
    model.generate(torch.zeros(1, 3, dtype=torch.long), 30, use_cache=True, slide=slide)
    assert seen == fed


@pytest.mark.parametrize("slide", [0, 13, 2.0, True])
def test_a_slide_outside_one_to_block_size_is_refused(slide):
    model = GPT(tiny())
    with pytest.raises(ValueError, match=f"slide must be an integer in \\[1, block_size=12\\], got {slide!r}"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), 1, slide=slide)


@pytest.mark.parametrize("temperature", [1e-30, 1e-300])
def test_a_tiny_temperature_samples_the_argmax_instead_of_overflowing(temperature):
    """logits / 1e-300 overflows float32 to inf and the softmax to NaN, unless the logits are shifted
    so that the largest is 0 first: then the others go to -inf and the draw is the argmax."""
    from model.gpt import sample_next

    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0)) * 5
    drawn = sample_next(logits, temperature=temperature, generator=torch.Generator().manual_seed(1))
    assert torch.equal(drawn[:, 0], logits.argmax(-1))


def test_top_k_one_is_greedy_and_top_p_keeps_the_most_likely_token():
    model = redraw_parameters_(GPT(tiny()).double()).eval()
    prompt = torch.randint(11, (2, 3))
    greedy = model.generate(prompt, 8, temperature=0)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(model.generate(prompt, 8, temperature=1.0, top_k=1, generator=g), greedy)
    assert torch.equal(model.generate(prompt, 8, temperature=1.0, top_p=1e-9, generator=g), greedy)


@pytest.mark.parametrize("temperature, top_k, top_p, expected", [
    (1.0, None, None, [0.4, 0.3, 0.2, 0.1]),
    (0.5, None, None, [16 / 30, 9 / 30, 4 / 30, 1 / 30]),  # p^(1/T), renormalised
    (1.0, 2, None, [4 / 7, 3 / 7, 0, 0]),
    (1.0, None, 0.65, [4 / 7, 3 / 7, 0, 0]),  # 0.4 < 0.65 before the 2nd, 0.7 >= 0.65 before the 3rd
    (1.0, None, 0.75, [4 / 9, 3 / 9, 2 / 9, 0]),  # the smallest set whose mass reaches 0.75
    (1.0, None, 0.35, [1, 0, 0, 0]),  # the likeliest token alone already reaches 0.35
    # top_p acts on what top_k kept, renormalised ([4, 3, 2] / 9: 7/9 >= 0.75 before the 3rd), as
    # Hugging Face's samplers order them; on the full distribution it would keep three tokens
    (1.0, 3, 0.75, [4 / 7, 3 / 7, 0, 0]),
])
def test_sample_next_draws_from_exactly_the_filtered_renormalised_distribution(monkeypatch, temperature, top_k,
                                                                            top_p, expected):
    """The distribution handed to torch.multinomial, captured and compared: which tokens survive
    top_k and top_p, and their renormalised probabilities. The vocabulary is permuted, so the
    nucleus must be mapped back from sorted order to token ids."""
    from model.gpt import sample_next

    perm = torch.tensor([2, 0, 3, 1])  # token perm[i] has the i-th largest probability
    probs = torch.zeros(4, dtype=torch.float64)
    probs[perm] = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    seen = []
    monkeypatch.setattr(torch, "multinomial", lambda p, num_samples, generator=None: seen.append(p) or
                        torch.zeros(p.size(0), 1, dtype=torch.long))
    sample_next(probs.log()[None], temperature=temperature, top_k=top_k, top_p=top_p)
    want = torch.zeros(4, dtype=torch.float64)
    want[perm] = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(seen[0][0], want, rtol=0, atol=1e-12)
    assert torch.equal(seen[0][0] == 0, want == 0)  # dropped tokens exactly 0, kept ones not


def test_rope_rotates_each_channel_pair_forward_by_position_times_frequency():
    """The RoFormer convention, pinned: pair (x0, x1) at position p becomes (x0 cos a - x1 sin a,
    x0 sin a + x1 cos a) with a = p * 10000^(-2i/D). A mirrored rotation (conjugate frequencies) is
    causal and relative too, but it is another function of the same weights: rope checkpoints would
    silently score differently."""
    from model.attention import apply_rope
    from model.gpt import rope_frequencies

    D, positions = 4, torch.arange(5, dtype=torch.float64)
    x = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64).expand(1, 1, 5, D)  # (B, H, T, D)
    out = apply_rope(x, rope_frequencies(5, D).to(torch.complex128))
    for i in range(D // 2):
        angle = positions * 10000.0 ** (-2 * i / D)
        torch.testing.assert_close(out[0, 0, :, 2 * i], torch.cos(angle))
        torch.testing.assert_close(out[0, 0, :, 2 * i + 1], torch.sin(angle))


def test_rotary_attention_sees_only_relative_positions():
    """With rotary positions, shifting every position by the same amount changes no output: q and k
    are both rotated, so their scores depend on m - n only (rotating only q would make them absolute)."""
    from model.attention import CausalSelfAttention, additive_mask, causal_mask
    from model.gpt import rope_frequencies

    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4, 0.0, False, "manual", False, 0).double()
    freqs = rope_frequencies(64, 8)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    mask = additive_mask(causal_mask(6, 6), torch.float64)
    at_start = attn(x, mask, rope=freqs[:6])
    shifted = attn(x, mask, rope=freqs[20:26])
    torch.testing.assert_close(shifted, at_start, rtol=0, atol=1e-6)  # complex64 angles: ~1e-7
    unrotated = attn(x, mask)
    assert (unrotated - at_start).abs().max() > 1e-2  # and the rotation does act


def test_flops_per_token_is_six_per_weight_plus_the_attention_term():
    """6 * N + 12 * n_layer * n_embd * T, N without the position table (which is a lookup, not a
    matmul). N = 6496 here: the tied 17x16 embedding, per layer 2 LayerNorms (16 each), qkv 16x48,
    proj 16x16, fc 16x64 and proj 64x16, and the final LayerNorm."""
    cfg = dict(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=16)
    N = 17 * 16 + 2 * (16 + 16 * 48 + 16 * 16 + 16 + 16 * 64 + 64 * 16) + 16
    assert N == 6496
    assert GPT(GPTConfig(**cfg)).flops_per_token() == 6 * N + 12 * 2 * 16 * 8  # T = block_size
    assert GPT(GPTConfig(**cfg)).flops_per_token(4) == 6 * N + 12 * 2 * 16 * 4
    assert GPT(GPTConfig(**cfg, pos_emb="rope")).flops_per_token() == 6 * N + 12 * 2 * 16 * 8
