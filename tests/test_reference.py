"""The model computes the documented function: every option against an independent float64 reference
(tests/reference.py), layer by layer; dropout obeys its law; eval mode is deterministic everywhere."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from reference import reference_forward

import causality as C
from model.attention import attention, causal_mask

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask

VALUES = {"attn_backend": ["manual", "sdpa"], "pos_emb": ["learned", "rope"], "qk_norm": [False, True],
          "bias": [False, True]}
OPTIONS = [dict(zip(VALUES, v, strict=True)) for v in itertools.product(*VALUES.values())]


def model_outputs(model, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's own sub-layer outputs under reference_forward's names, read with forward hooks."""
    out: dict[str, torch.Tensor] = {}
    hooks = [model.blocks[0].register_forward_pre_hook(lambda _m, args: out.__setitem__("embedding", args[0]))]
    for layer, block in enumerate(model.blocks):
        for name, module in (("attention", block.attn), ("MLP", block.mlp)):
            hooks.append(module.register_forward_hook(
                lambda _m, _a, o, key=f"layer {layer} {name}": out.__setitem__(key, o)))
    try:
        with torch.no_grad():
            out["logits"] = model(idx)[0]
    finally:
        for h in hooks:
            h.remove()
    return out


def first_difference(got: dict, want: dict, tol: float) -> tuple[str, float] | None:
    """The first sub-layer, in forward order, whose output differs from the reference by more than tol
    (relative to the reference's largest entry), with that difference."""
    for name, ref in want.items():
        err = ((got[name] - ref).abs().max() / ref.abs().max()).item()
        if not err <= tol:  # NaN fails too
            return name, err
    return None


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_every_sub_layer_computes_the_documented_function(options):
    """Relational checks (causality, cache parity, manual vs sdpa) pass for many wrong functions of the
    same weights; this one compares every sub-layer with the reference, and a failure names the first
    one that differs. Positive control: the reference with qk_norm flipped is far off."""
    model = C.leak_test_model(**options)
    x = C.random_tokens(3, model.config.block_size, model.config.vocab_size)
    got = model_outputs(model, x)
    cfg = model.config.to_dict()
    diff = first_difference(got, reference_forward(model.state_dict(), cfg, x), 1e-12)
    assert diff is None, f"{diff[0]} differs from the documented computation by {diff[1]:.3g} (relative)"
    flipped = reference_forward(model.state_dict(), {**cfg, "qk_norm": not cfg["qk_norm"]}, x)
    assert first_difference(got, flipped, 1e-6) is not None


# --- dropout: its law, not only its causality ---------------------------------------------------------

def dropped_weights(p: float, draws: int, T: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """attention() with v = the identity, so its output IS the weights after dropout: (draws, B, H, T, T),
    and the weights without dropout (B, H, T, T)."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 2, T, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.eye(T, dtype=torch.float64).expand(2, 2, T, T)
    mask = causal_mask(T, T)
    torch.manual_seed(seed)
    outs = torch.stack([attention(q, k, v, mask, dropout_p=p)[0] for _ in range(draws)])
    return outs, attention(q, k, v, mask)[1]


def test_attention_dropout_zeroes_normalised_weights_with_probability_p_and_rescales_the_rest():
    """Dropout acts on the normalised, masked weights: each allowed weight is kept with probability 1 - p
    and then equals weight / (1 - p) exactly; masked weights stay exactly 0; the mean over draws is the
    weights themselves (unbiased). Tolerances: 5 standard errors of the binomial and of the mean."""
    p, draws = 0.3, 3000
    outs, w = dropped_weights(p, draws)
    allowed = causal_mask(w.size(-1), w.size(-1))
    kept = outs != 0
    assert (outs[..., ~allowed] == 0).all(), "dropout re-admitted a masked key"
    assert torch.allclose(outs[kept], (w / (1 - p)).expand_as(outs)[kept], rtol=0, atol=1e-12), \
        "a kept weight is not weight / (1 - p): dropout acts elsewhere than on the normalised weights"
    n = kept[..., allowed].numel()
    frac = kept[..., allowed].double().mean().item()
    assert abs(frac - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n), f"kept {frac:.4f} of the weights, not {1 - p}"
    se = w * math.sqrt(p / (1 - p) / draws)  # per weight: sd of w * keep / (1 - p), over sqrt(draws)
    assert ((outs.mean(0) - w).abs() <= 5 * se + 1e-12).all(), "dropout is biased: the mean is not the weights"
    # positive control: the same tolerances tell p = 0.3 from p = 0.2 apart
    other, _ = dropped_weights(0.2, draws)
    assert abs((other[..., allowed] != 0).double().mean().item() - (1 - p)) > 5 * math.sqrt(p * (1 - p) / n)


def _paths(model, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The logits of x by each path the model computes them: one forward, a chunked prefill through the
    KV cache, and one token at a time through it."""
    with torch.no_grad():
        full, _ = model(x)
        cache = model.new_cache(x.size(0))
        chunked = torch.cat([model(x[:, :4], cache=cache)[0], model(x[:, 4:], cache=cache)[0]], dim=1)
        cache = model.new_cache(x.size(0))
        decoded = torch.cat([model(x[:, t:t + 1], cache=cache)[0] for t in range(x.size(1))], dim=1)
    return {"full forward": full, "chunked prefill": chunked, "one-token decode": decoded}


@pytest.mark.parametrize("backend", ["manual", "sdpa"])
def test_eval_mode_drops_nothing_on_any_path(backend):
    """With dropout 0.5, eval mode on each path gives the dropout-free model's logits, whatever the RNG
    holds; train mode (the positive control) gives other logits for another seed."""
    model = C.leak_test_model(backend, dropout=0.5)
    plain = C.leak_test_model(backend, dropout=0.0)
    x = C.random_tokens(2, model.config.block_size, model.config.vocab_size)
    want = _paths(plain, x)
    for seed in (0, 1):
        torch.manual_seed(seed)
        for path, logits in _paths(model.eval(), x).items():
            err = (logits - want[path]).abs().max().item()
            assert err < 1e-9, f"{path} ({backend}) in eval mode moved by {err:.3g}: dropout acted"
    model.train()
    torch.manual_seed(0)
    a, _ = model(x)
    torch.manual_seed(1)
    b, _ = model(x)
    assert (a - b).abs().max() > 1e-3
