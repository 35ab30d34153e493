"""The model against the float64 reference (tests/reference.py) layer by layer, dropout's law, and its contracts."""

import copy
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

import causality as C
from model import GPT, GPTConfig
from model.attention import CausalSelfAttention, additive_mask, apply_rope, attention, causal_mask
from model.gpt import rope_frequencies
from reference import reference_forward
from training import estimate_loss, exact_loss
from training.visualize import prompt_attention

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask

VALUES = {"attn_backend": ["manual", "sdpa"], "pos_emb": ["learned", "rope"], "qk_norm": [False, True],
          "bias": [False, True], "attn_window": [0, 3]}
OPTIONS = [dict(zip(VALUES, v, strict=True)) for v in itertools.product(*VALUES.values())]
tiny = lambda **kw: GPTConfig(**{**dict(vocab_size=11, block_size=12, n_layer=2, n_head=2, n_embd=16), **kw})


def first_difference(got: dict, want: dict, tol: float) -> tuple[str, float] | None:
    """The first sub-layer, in forward order, off the reference by more than tol (relative to its largest entry)."""
    errors = {name: ((got[name] - ref).abs().max() / ref.abs().max()).item() for name, ref in want.items()}
    return next(((name, err) for name, err in errors.items() if not err <= tol), None)  # NaN fails too


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_every_sub_layer_computes_the_documented_function(options):
    """Unlike relational checks (causality, cache parity), many wrong functions fail this; control: qk_norm flipped."""
    model = C.leak_test_model(**options)
    x, cfg = C.random_tokens(3, model.config.block_size, model.config.vocab_size), model.config.to_dict()
    got: dict[str, torch.Tensor] = {}  # the sub-layer outputs under reference_forward's names, read by hooks
    model.blocks[0].register_forward_pre_hook(lambda _m, args: got.__setitem__("embedding", args[0]))
    for i, block in enumerate(model.blocks):
        block.attn.register_forward_hook(lambda _m, _a, o, key=f"layer {i} attention": got.__setitem__(key, o))
        block.mlp.register_forward_hook(lambda _m, _a, o, key=f"layer {i} MLP": got.__setitem__(key, o))
    with torch.no_grad():
        got["logits"] = model(x)[0]
    diff = first_difference(got, reference_forward(model.state_dict(), cfg, x), 1e-12)
    assert diff is None, f"{diff[0]} differs from the documented computation by {diff[1]:.3g} (relative)"
    flipped = reference_forward(model.state_dict(), {**cfg, "qk_norm": not cfg["qk_norm"]}, x)
    assert first_difference(got, flipped, 1e-6) is not None


# --- dropout: its law, not only its causality ---------------------------------------------------------

CAUSAL = torch.ones(6, 6, dtype=torch.bool).tril()  # dropout's law under a plain mask, whatever the rule


def dropped_weights(p: float, draws: int = 3000) -> tuple[torch.Tensor, ...]:
    """attention() with v = I: outputs ARE the dropped weights (draws, B, H, 6, 6); weights it returns; undropped."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v, mask = torch.eye(6, dtype=torch.float64).expand(2, 2, 6, 6), CAUSAL
    torch.manual_seed(0)
    outs, returned = zip(*(attention(q, k, v, mask, dropout_p=p) for _ in range(draws)), strict=True)
    return torch.stack(outs), torch.stack(returned), attention(q, k, v, mask)[1]


def test_attention_dropout_zeroes_normalised_weights_with_probability_p_and_rescales_the_rest():
    """Kept w.p. 1 - p as exactly weight / (1 - p), masked stay 0, unbiased (to 5 standard errors) and per query."""
    p, draws = 0.3, 3000
    (outs, returned, w), allowed = dropped_weights(p, draws), CAUSAL
    kept = outs != 0
    assert (outs[..., ~allowed] == 0).all(), "dropout re-admitted a masked key"
    assert torch.allclose(outs[kept], (w / (1 - p)).expand_as(outs)[kept], rtol=0, atol=1e-12), \
        "a kept weight is not weight / (1 - p): dropout acts elsewhere than on the normalised weights"
    n, frac = kept[..., allowed].numel(), kept[..., allowed].double().mean().item()
    assert abs(frac - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n), f"kept {frac:.4f} of the weights, not {1 - p}"
    se = w * math.sqrt(p / (1 - p) / draws)  # per weight: sd of w * keep / (1 - p), over sqrt(draws)
    assert ((outs.mean(0) - w).abs() <= 5 * se + 1e-12).all(), "dropout is biased: the mean is not the weights"
    # whole weights, each query's own draw: dropping entries of V instead would drop a key for every query at once
    assert (kept[..., 4, :4] != kept[..., 5, :4]).any(), "dropout acts on V, not on each query's weights"
    other = dropped_weights(0.2, draws)[0]  # positive control: the same tolerances tell p = 0.3 from p = 0.2 apart
    assert abs((other[..., allowed] != 0).double().mean().item() - (1 - p)) > 5 * math.sqrt(p * (1 - p) / n)
    assert torch.equal(returned, w.expand_as(returned)), "attention() returns dropped weights (the maps draw them)"


@pytest.mark.parametrize("module, backend", [("attn", "manual"), ("attn", "sdpa"), ("mlp", "manual")])
def test_the_output_projections_drop_at_rate_p_in_train_mode_only(module, backend):
    """x + dropout(proj(...)): each entry kept w.p. 1 - p as proj / (1 - p) in train mode; proj itself in eval mode.
    Attention also drops weights before proj in train mode, on either backend; the MLP nothing."""
    torch.manual_seed(0)
    block, p, seen, ins = GPT(tiny(n_embd=64, dropout=0.3, attn_backend=backend)).blocks[0], 0.3, [], []
    sub = getattr(block, module)
    sub.proj.register_forward_hook(lambda _m, i, out: seen.append(out) or ins.append(i[0]))
    x = torch.randn(8, 12, 64)
    # every key visible, whatever the rule: a query of one key would lose its whole row with that key's weight
    args = (block.ln_1(x), additive_mask(torch.ones(12, 12, dtype=torch.bool))) if module == "attn" else (x,)
    out = sub.train()(*args)
    kept = out != 0
    assert abs(kept.double().mean().item() - (1 - p)) < 0.02, f"{module}: kept {kept.double().mean():.3f}, not 0.7"
    torch.testing.assert_close(out[kept], seen[-1][kept] / (1 - p))
    assert torch.equal(sub.eval()(*args), seen[-1]), f"{module}: dropout acts in eval mode"
    assert torch.equal(ins[0], ins[1]) == (module == "mlp"), f"{module} ({backend}): weights dropped or not"


def test_the_embeddings_drop_at_rate_p_in_train_mode():  # blocks[0] takes dropout(tok_emb + pos_emb)
    model, idx, seen = GPT(tiny(n_embd=64, dropout=0.3)).train(), torch.randint(11, (8, 12)), []
    model.blocks[0].register_forward_pre_hook(lambda _m, inputs: seen.append(inputs[0]))
    model(idx)
    emb, kept = model.tok_emb(idx) + model.pos_emb(torch.arange(12)), seen[0] != 0
    assert abs(kept.double().mean().item() - 0.7) < 0.02, f"embeddings: kept {kept.double().mean():.3f}, not 0.7"
    torch.testing.assert_close(seen[0][kept], emb[kept] / 0.7)


@pytest.mark.parametrize("backend", ["manual", "sdpa"])
@torch.no_grad()
def test_eval_mode_drops_nothing_on_any_path(backend):
    """Dropout 0.5: eval mode gives the dropout-free logits on every path whatever the seed; train mode does not.
    The loss estimate and the exact val put a model that trains in eval mode, and give it back training."""
    model, plain = C.leak_test_model(backend, dropout=0.5), C.leak_test_model(backend, dropout=0.0)
    x, paths = C.test_tokens(model, 2), C.PATHS  # chunked, decode: the KV cache
    want, trained = {path: C.logits_by(plain, x, path) for path in paths}, []
    for seed in (0, 1):
        torch.manual_seed(seed)
        for path in paths:
            err = (C.logits_by(model.eval(), x, path) - want[path]).abs().max().item()
            assert err < 1e-9, f"{path} ({backend}) in eval mode moved by {err:.3g}: dropout acted"
        trained.append(model.train()(x)[0])  # the positive control: in train mode, other logits for another seed
    assert (trained[0] - trained[1]).abs().max() > 1e-3
    data, cfg = x.flatten(), SimpleNamespace(eval_iters=2, batch_size=2, block_size=model.config.block_size, seed=0)
    for name, loss in (("exact val", lambda m: exact_loss(m, data, cfg.block_size, 2, "cpu")),
                       ("estimate", lambda m: estimate_loss(m, {"val": data}, cfg, "cpu")["val"])):
        err = abs(loss(model) - loss(plain))
        assert err < 1e-9 and model.training, f"{name} ({backend}): {err:.3g} off, training={model.training}"


def test_the_attention_maps_are_the_weights_each_layer_attends_with(monkeypatch):
    model, used = C.leak_test_model("manual", **C.MODERN, attn_window=3, **C.DOCUMENTS), []
    with monkeypatch.context() as m:  # the weights the forward itself attends with (rotary, qk-norm, window, documents)
        m.setattr("model.attention.attention", lambda *a: used.append(attention(*a)[1][0].float()) or attention(*a))
        model(torch.tensor([ids := C.test_tokens(model, 1)[0].tolist()]))
    assert len(used) == 2 and all(torch.equal(a, b) for a, b in zip(prompt_attention(model, ids), used, strict=True))


# --- the model's other contracts: config, init, loss, generation windows, rotary positions, FLOPs -------

@pytest.mark.parametrize("kwargs, match", [(dict(n_embd=30, n_head=4), "n_embd=30 must be divisible by n_head=4"),
    (dict(n_layer=0), "n_layer must be a positive integer"), (dict(block_size=2.5), "block_size must be a positive"),
    (dict(attn_backend="flash"), r"attn_backend='flash' is unknown; choose one of \('manual', 'sdpa'\)"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"), (dict(dropout=-0.1), "got -0.1"),
    (dict(n_layer=True), "n_layer must be a positive integer, got True"), (dict(doc_sep=-1), "doc_sep=-1 is not"),
    (dict(pos_emb="rope", n_embd=18, n_head=2), "needs an even head width, got 9"),
    (dict(attn_window=-1), "attn_window must be an integer >= 0"), (dict(attn_window=True), "got True"),
    (dict(attn_window=13), "exceeds block_size=12"),
    (dict(doc_sep=11), r"doc_sep=11 is not a token id in \[0, 11\)")])
def test_a_model_config_refusal_names_the_field_and_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kwargs)
    with pytest.raises(AttributeError):  # and a built config is frozen
        tiny().n_layer = 3
    assert tiny(attn_window=12).attn_window == 12  # a window as long as the block is allowed
    assert tiny(n_embd=18, n_head=2).n_embd == 18  # an odd head width: learned positions need no pairs


def test_the_head_is_tied_to_the_embedding_and_residual_projections_start_smaller():
    """GPT-2's init, each parameter: residual projections std 0.02 / sqrt(2 n_layer), other matrices 0.02, biases 0."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=8, n_head=4, n_embd=256, bias=True))
    assert model.lm_head.weight is model.tok_emb.weight
    for name, w in model.named_parameters():
        if name.endswith(".bias"):
            assert (w == 0).all(), name
        elif w.dim() == 2:
            want = 0.02 / math.sqrt(16) if name.endswith("proj.weight") else 0.02
            assert w.std().item() == pytest.approx(want, rel=0.05), f"{name}: std {w.std():.4f}, not {want:.4f}"
    x, y = torch.randint(50, (2, 8, 8))
    assert abs(model(x, y)[1].item() - math.log(50)) < 0.1  # the initial loss is about ln V


def test_the_model_overfits_one_batch_and_refuses_a_sequence_longer_than_block_size():
    torch.manual_seed(0)
    model = GPT(tiny(n_embd=32))
    x, y, opt = torch.randint(11, (4, 12)), torch.randint(11, (4, 12)), torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    assert model(x, y)[1].item() < 0.1
    cache = model.new_cache(1)
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    for T, held in ((13, None), (5, cache)):  # cached positions count
        with pytest.raises(ValueError, match="sequence length 13 exceeds block_size 12"):
            model(torch.zeros(1, T, dtype=torch.long), cache=held)


def greedy_over_windows(model: GPT, prompt: torch.Tensor, n: int, slide: int) -> torch.Tensor:
    """The documented windows, greedy: predict from seq[start:]; past block_size tokens, start moves `slide` on."""
    block, seq, start = model.config.block_size, prompt, max(0, prompt.size(1) - model.config.block_size)
    for _ in range(n):
        seq = torch.cat([seq, model(seq[:, start:])[0][:, -1].argmax(-1, keepdim=True)], dim=1)
        if seq.size(1) - start > block:
            start += slide
    return seq


@pytest.mark.parametrize("prompt_len", [3, 20])  # shorter and longer than block_size 12
@pytest.mark.parametrize("slide", [1, 5, 12])
def test_generation_past_block_size_reads_the_documented_windows(prompt_len, slide):
    model = C.redraw_parameters_(GPT(tiny()).double()).eval()
    prompt = torch.randint(11, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    want = greedy_over_windows(model, prompt, 40, slide)
    for use_cache in (True, False):
        got = model.generate(prompt, 40, temperature=0, use_cache=use_cache, slide=slide)
        assert torch.equal(got, want), f"generation (use_cache={use_cache}) does not read the documented windows"
    assert not torch.equal(want, greedy_over_windows(model, prompt, 40, 7 if slide != 7 else 2))  # control
    for bad in (13, True):
        with pytest.raises(ValueError, match=r"slide must be an integer in \[1, block_size=12\]"):
            model.generate(prompt, 1, slide=bad)
    with pytest.raises(ValueError, match=r"generate needs a \(B, T>=1\) prompt, got shape \(\d+,\)"):
        model.generate(prompt[0], 1)
    with pytest.raises(ValueError, match=r"generate needs a \(B, T>=1\) prompt, got shape \(2, 0\)"):
        model.generate(prompt[:, :0], 1)  # no token to continue
    assert torch.equal(model.generate(prompt, 0), prompt)  # no new token: the prompt
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -1"):  # not the prompt, silently
        model.generate(prompt, -1)


@pytest.mark.parametrize("slide, fed", [(4, [3] + [1] * 9 + ([9] + [1] * 3) * 5), (1, [3] + [1] * 9 + [12] * 20)])
def test_the_cache_feeds_one_token_per_step_and_recomputation_the_whole_window(slide, fed):
    """Tokens per forward (3-token prompt, block 12): past the 10th new token, each slide re-prefills what is left."""
    model, seen = GPT(tiny()).eval(), []
    model.register_forward_pre_hook(lambda _m, args: seen.append(args[0].size(1)))
    model.generate(torch.zeros(1, 3, dtype=torch.long), 30, slide=slide)
    model.generate(torch.zeros(1, 3, dtype=torch.long), 4, use_cache=False)
    assert seen == fed + [3, 4, 5, 6]  # without the cache, a real recomputation: what the parity checks compare


def test_a_windowed_rotary_model_generates_past_block_size_on_a_rolling_cache_without_re_prefilling():
    """rope, W=3: 4 blocks greedy as by full forwards, the cache fed one token a step, in fewer slots than a block (what
    they hold: check_rolling_cache); without the cache, each step recomputes the n_layer * (W - 1) + 1 tokens the next
    one depends on, at their own positions."""
    model = C.redraw_parameters_(GPT(tiny(pos_emb="rope", attn_window=3)).double()).eval()
    seq = prompt = torch.randint(11, (2, 5), generator=torch.Generator().manual_seed(0))
    for _ in range(48):  # the documented result: every earlier token at its own position
        seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert len(set(seq[0, 5:].tolist())) > 2  # not a constant stream: the equality below is informative
    fed = []  # (tokens, cache, start) per forward
    model.register_forward_pre_hook(lambda _m, a, kw: fed.append((a[0].size(1), kw.get("cache"), kw.get("start"))),
                                    with_kwargs=True)
    assert torch.equal(model.generate(prompt, 48, temperature=0), seq)
    assert [n for n, _, _ in fed] == [5] + [1] * 47 and all(c is fed[0][1] for _, c, _ in fed)
    assert all(k.size(2) == fed[0][1].size < model.config.block_size for k in fed[0][1].k + fed[0][1].v)
    assert torch.equal(model.generate(prompt, 48, temperature=0, use_cache=False), seq)
    reach = model.config.n_layer * (3 - 1) + 1
    assert [(n, start) for n, _, start in fed[48:]] == [(min(t, reach), t - min(t, reach)) for t in range(5, 53)], \
        f"(tokens fed, start) of each uncached step: not the last {reach} tokens at their positions"
    learned = GPT(tiny(attn_window=3)).eval()  # a position table still ends at block_size: the window slides
    assert learned.generate(prompt, 48).shape == (2, 53)
    with pytest.raises(ValueError, match="exceeds block_size 12"):
        learned(torch.zeros(1, 13, dtype=torch.long))


def test_rotary_positions_rotate_pairs_by_position_times_frequency_and_attention_sees_only_offsets():
    D, positions = 8, torch.arange(5)
    x = torch.tensor([1.0, 0.0], dtype=torch.float64).repeat(1, 1, 5, D // 2)  # pairs (1, 0): rotated, (cos, sin)
    out = apply_rope(x, rope_frequencies(positions, D, dtype=torch.float64))
    angle = positions[:, None] * 10000.0 ** (-2 * torch.arange(D // 2, dtype=torch.float64) / D)  # (T, D/2)
    torch.testing.assert_close(out[0, 0], torch.stack([angle.cos(), angle.sin()], -1).flatten(1))
    attn = CausalSelfAttention(GPTConfig(vocab_size=1, n_embd=32, n_head=4), 0).double()
    freqs = rope_frequencies(torch.arange(64), 8, dtype=torch.float64)
    x, mask = torch.randn(2, 6, 32, dtype=torch.float64), additive_mask(causal_mask(6, 6), torch.float64)
    torch.testing.assert_close(attn(x, mask, freqs[20:26]), attn(x, mask, freqs[:6]), rtol=0, atol=1e-12)
    assert (attn(x, mask) - attn(x, mask, freqs[:6])).abs().max() > 1e-2  # and the rotation does act
    in_bf16 = rope_frequencies(far := torch.arange(4000, 4096), 8, dtype=torch.bfloat16)  # angles in float32 still
    assert torch.equal(in_bf16, rope_frequencies(far, 8)), "rotary angles computed in the model's half precision"
    model, idx = GPT(tiny(pos_emb="rope")).eval(), torch.randint(11, (2, 12))
    want = model.float()(idx)[0]
    for dtype in (torch.bfloat16, torch.float16):  # and runs in half precision without autocast, cache included
        half = copy.deepcopy(model).to(dtype)
        assert (logits := half(idx)[0]).dtype == dtype and (logits.float() - want).abs().max() < 0.05, dtype
        assert half.generate(idx[:, :3], 5).shape == (2, 8)


def test_flops_per_token_is_six_per_weight_plus_the_attention_term():
    """N: tied 17x16 embedding, per layer 2 LayerNorms, qkv, proj, fc, proj, final LayerNorm (a table is no matmul)."""
    N = 17 * 16 + 3 * (16 + 16 * 48 + 16 * 16 + 16 + 16 * 64 + 64 * 16) + 16
    for pos_emb in ("learned", "rope"):  # 3 layers, 2 heads: a count by heads differs
        model = GPT(GPTConfig(vocab_size=17, block_size=8, n_layer=3, n_head=2, n_embd=16, pos_emb=pos_emb))
        assert (model.flops_per_token(), model.flops_per_token(4)) == (6 * N + 12 * 3 * 16 * 8, 6 * N + 12 * 3 * 16 * 4)
