"""The causality and label-shift checks, in one place, for the tests, the mutants and real checkpoints.

Every check returns a `Check`: ok or not, and the numbers that decided it, so a failure says how
far off it was. Each check carries its own positive control: it passes only if the comparison that
must stay quiet stays quiet AND the comparison that must fire does fire (a check that could never
fire proves nothing).

The checks look the pieces under test up at call time (`model.attention.attention`,
`data.get_batch`, ...), so a test can substitute a broken piece and watch them fail: see
tests/mutants.py.

Run on a trained model:  python tests/causality.py --ckpt out/shakespeare_char/ckpt.pt
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import data  # noqa: E402
import model.attention as attn_lib  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


@dataclass
class Check:
    """Outcome of one check. `quiet` must be 0 (what must not change); `fired` must be > 0."""

    name: str
    ok: bool
    quiet: float  # largest change where nothing may change
    fired: float  # smallest change where something must change
    detail: str = ""  # where it failed: the first (query, key) pair that leaked, the layer, ...

    def __str__(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        where = f" | {self.detail}" if self.detail and not self.ok else ""
        return f"{status} {self.name:<40} max change where none allowed {self.quiet:.3g} | " \
               f"min change where one is required {self.fired:.3g}{where}"


def require(*checks: Check) -> None:
    """In a test: fail with one line per failed check (what broke and where), not a traceback."""
    failed = [str(c) for c in checks if not c.ok]
    if failed:
        import pytest

        pytest.fail("\n".join(failed), pytrace=False)


def _max(x: Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


def leak_pair(reads: Tensor) -> tuple[int, int] | None:
    """reads (T, T) bool, reads[i, j]: query (position) i depends on key (token) j. The first pair with
    j > i (the lowest query first), or None."""
    future = (reads & torch.ones_like(reads).triu(1)).nonzero()
    return tuple(future[0].tolist()) if len(future) else None


def first_leak(reads: Tensor) -> str:
    """The first future pair of leak_pair, in words; '' when there is none."""
    pair = leak_pair(reads)
    return f"query {pair[0]} reads key {pair[1]} ({pair[1] - pair[0]} ahead)" if pair else ""


def first_blind_spot(reads: Tensor) -> str:
    """The first query that does not read its own key, or (past query 0) no earlier key; '' if none."""
    for i in range(reads.size(0)):
        if not reads[i, i]:
            return f"query {i} does not read key {i} (its own)"
        if i > 0 and not reads[i, :i].any():
            return f"query {i} reads no earlier key"
    return ""


def mask_picture(T: int = 6) -> str:
    """causal_mask(T, T) next to the plain lower triangle the checks expect (■ allowed, · masked)."""
    got = attn_lib.causal_mask(T, T).cpu()
    want = torch.ones(T, T, dtype=torch.bool).tril()

    def row(r: Tensor) -> str:
        return " ".join("■" if a else "·" for a in r.tolist())

    width = max(2 * T + 2, 20)
    lines = [f"{f'causal_mask({T}, {T})':<{width}}expected (lower triangle)"]
    lines += [f"{row(g):<{width}}{row(w)}" for g, w in zip(got, want, strict=True)]
    return "\n".join(lines) + "\n(model/attention.py:causal_mask)"


# --- models with no dead paths -------------------------------------------------------------------

def redraw_parameters_(model: torch.nn.Module, seed: int = 0, gain: float = 1.5) -> torch.nn.Module:
    """Re-draw every parameter so that every path carries signal and no softmax is flat or saturated.

    GPT-2's init (std 0.02, scaled residual projections) gives near-uniform attention: a leak through
    a near-uniform softmax can change logits by less than rounding, and a test would miss it. Here
    matrices get std gain/sqrt(fan_in) (activations stay O(1), scores are O(1) so softmax is neither
    flat nor one-hot), norm gains 1 +- 0.5, biases +- 0.5. Tied weights are drawn once.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * gain / math.sqrt(p.shape[-1]))
            elif name.endswith("weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


MODERN = dict(pos_emb="rope", qk_norm=True)  # every later technique the model has


def leak_test_model(backend: str = "manual", dropout: float = 0.0, seed: int = 0, **kw) -> GPT:
    """A float64 GPT with two layers (a leak can take two hops) and re-drawn weights, in eval mode."""
    cfg = dict(vocab_size=13, block_size=10, n_layer=2, n_head=2, n_embd=16, bias=True,
               attn_backend=backend, dropout=dropout)
    torch.manual_seed(seed)
    return redraw_parameters_(GPT(GPTConfig(**{**cfg, **kw})).double(), seed).eval()


def random_tokens(B: int, T: int, V: int, seed: int = 1) -> Tensor:
    """(B, T) token ids; rows differ from each other."""
    return torch.randint(V, (B, T), generator=torch.Generator().manual_seed(seed))


def _change_at(x: Tensor, j: int, V: int, seed: int) -> Tensor:
    """x with the token at position j of every row replaced by a different token."""
    y = x.clone()
    shift = 1 + torch.randint(V - 1, (x.size(0),), generator=torch.Generator().manual_seed(seed))
    y[:, j] = (x[:, j] + shift.to(x.device)) % V
    return y


# --- attention level -----------------------------------------------------------------------------

def check_causal_mask(T: int = 6) -> Check:
    """causal_mask(T, T) is the plain lower triangle, and a query block against a longer history is its
    last rows (decoding). On failure the detail draws the mask next to the expected one."""
    want = torch.ones(T, T, dtype=torch.bool).tril()
    wrong = sum(int((attn_lib.causal_mask(Tq, T).cpu() != want[T - Tq:]).sum()) for Tq in range(1, T + 1))
    return Check("mask: causal_mask is the lower triangle", wrong == 0, float(wrong), float(want.sum()),
                 "" if wrong == 0 else "it is not the lower triangle:\n" + mask_picture(T))


def check_attention_future_perturbation(T: int = 8, seed: int = 0, scale: float = 100.0) -> Check:
    """Perturb q, k and v at one position j (x100): outputs before j bit-identical, at j changed."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, T, 4, generator=g, dtype=torch.float64) for _ in range(3))
    allowed = attn_lib.causal_mask(T, T)
    base, _ = attn_lib.attention(q, k, v, allowed)
    change = torch.zeros(T, T, dtype=torch.float64)  # change[i, j]: output i moved when position j did
    for j in range(T):
        qp, kp, vp = q.clone(), k.clone(), v.clone()
        for z in (qp, kp, vp):
            z[:, :, j] *= scale
        out, _ = attn_lib.attention(qp, kp, vp, allowed)
        change[:, j] = (out - base).abs().amax(dim=(0, 1, 3))
    quiet, fired = _max(change.triu(1)), change.diagonal().min().item()
    where = first_leak(change > 0) or first_blind_spot(change > 0)
    return Check("attention: future perturbation", quiet == 0.0 and fired > 0, quiet, fired, where)


def check_attention_weights(T: int = 7, seed: int = 0) -> Check:
    """Weights: rows sum to 1, every future weight exactly 0, every allowed weight (diagonal too) > 0."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, T, 4, generator=g, dtype=torch.float64) for _ in range(3))
    _, w = attn_lib.attention(q, k, v, attn_lib.causal_mask(T, T))
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # the reference, not the code under test
    quiet = max(_max(w[..., future]), _max(w.sum(-1) - 1))
    fired = w[..., ~future].min().item()
    reads = (w > 0).any(0).any(0)  # (T, T)
    where = first_leak(reads) or first_blind_spot(reads) or ("rows do not sum to 1" if quiet >= 1e-12 else "")
    return Check("attention: weights", quiet < 1e-12 and _max(w[..., future]) == 0 and fired > 0, quiet, fired,
                 where)


def check_attention_extreme_scores(scale: float = 1e150) -> Check:
    """A masked key gets weight exactly 0 however far its score rises above the allowed ones: query 0
    may read only key 0, at score -scale**2, while keys 1.. score +scale**2. With -inf in the masked
    places that is still weight 1 on key 0; a finite fill above -scale**2 (-1e4, -1e9, ... but not
    float64's finfo.min) hands query 0's attention to the future."""
    T = 4
    q = torch.full((1, 1, T, 1), scale, dtype=torch.float64)
    k = torch.full((1, 1, T, 1), scale, dtype=torch.float64)
    k[..., 0, 0] = -scale
    v = torch.randn(1, 1, T, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    _, w = attn_lib.attention(q, k, v, attn_lib.causal_mask(T, T))
    quiet = _max(w[0, 0, 0, 1:])  # query 0's weight on future keys
    fired = w[0, 0, 0, 0].item()  # its weight on its own key: must be all of it
    return Check("attention: extreme scores", quiet == 0.0 and fired == 1.0, quiet, fired)


def check_attention_gradients(T: int = 6, seed: int = 0) -> Check:
    """d out[t] / d (k, v)[s] is exactly 0 for s > t, non-zero for s = t and for some s < t.

    This catches a mask that hides the diagonal or masks too much, which perturbing the future
    alone cannot see.
    """
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, T, 4, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    out, _ = attn_lib.attention(q, k, v, attn_lib.causal_mask(T, T))
    grads = torch.zeros(T, T, dtype=torch.float64)  # grads[t, s]: influence of key position s on query t
    for t in range(T):
        gk, gv = torch.autograd.grad(out[:, :, t].sum(), (k, v), retain_graph=True)
        grads[t] = gk.abs().sum((0, 1, 3)) + gv.abs().sum((0, 1, 3))
    return _gradient_check("attention: gradients", grads)


def _gradient_check(name: str, grads: Tensor) -> Check:
    """grads (T, T) of query t's output with respect to position s: 0 above the diagonal, > 0 on it and
    somewhere before it in every row past the first."""
    T = grads.size(0)
    quiet = _max(grads.triu(1))
    fired = min([grads.diagonal().min().item()] + [grads[t, :t].max().item() for t in range(1, T)])
    where = first_leak(grads > 0) or first_blind_spot(grads > 0)
    return Check(name, quiet == 0.0 and fired > 0, quiet, fired, where)


def check_attention_half_precision(T: int = 6, seed: int = 0) -> Check:
    """float16 and bfloat16 inputs: finite outputs close to float64, future weights exactly 0."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, T, 8, generator=g, dtype=torch.float64) for _ in range(3))
    allowed = attn_lib.causal_mask(T, T)
    ref, _ = attn_lib.attention(q, k, v, allowed)
    quiet, fired = 0.0, math.inf
    for dtype in (torch.float16, torch.bfloat16):
        out, w = attn_lib.attention(q.to(dtype), k.to(dtype), v.to(dtype), allowed)
        err = (out.double() - ref).abs()
        quiet = max(quiet, _max(w[..., ~allowed].double()), 0.0 if torch.isfinite(err).all() else math.inf)
        fired = min(fired, w[..., allowed].min().item())
        if not err.max().item() < 0.1:
            return Check("attention: half precision", False, err.max().item(), fired, f"({dtype} error)")
    return Check("attention: half precision", quiet == 0.0 and fired > 0, quiet, fired)


# --- model level ---------------------------------------------------------------------------------

def _single_token_changes(model: GPT, x: Tensor, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Change the token at one position j at a time. Returns change (T, T), change[i, j] the largest move of
    the logits at i when token j changed; layers (L, T, T) bool, layers[l, i, j] whether block l's output
    at i moved; and the unperturbed logits."""
    T, V = x.size(1), model.config.vocab_size
    outputs: list[Tensor] = []
    hooks = [b.register_forward_hook(lambda _m, _i, out: outputs.append(out)) for b in model.blocks]
    try:
        with torch.no_grad():
            base, _ = model(x)
            base_blocks, outputs[:] = list(outputs), []
            change = torch.zeros(T, T, dtype=torch.float64)
            layers = torch.zeros(len(model.blocks), T, T, dtype=torch.bool)
            for j in range(T):
                out, _ = model(_change_at(x, j, V, seed + j))
                change[:, j] = (out - base).abs().amax(dim=(0, 2)).double().cpu()
                for layer, (o, b) in enumerate(zip(outputs, base_blocks, strict=True)):
                    layers[layer, :, j] = (o != b).any(0).any(-1).cpu()
                outputs[:] = []
    finally:
        for h in hooks:
            h.remove()
    return change, layers, base


def check_future_perturbation(model: GPT, x: Tensor, seed: int = 2) -> Check:
    """For every position j: a new token at j leaves the logits before j bit-identical and moves those at j.
    A failure names the first (query, key) pair that leaked and the first layer whose output shows it."""
    change, layers, _ = _single_token_changes(model, x, seed)
    quiet, fired = _max(change.triu(1)), change.diagonal().min().item()
    pair = leak_pair(change > 0)
    where = first_leak(change > 0) or first_blind_spot(change > 0)
    if pair is not None and layers[:, pair[0], pair[1]].any():
        where += f" in layer {layers[:, pair[0], pair[1]].nonzero()[0].item()}"
    return Check(f"model: future perturbation ({model.config.attn_backend})", quiet == 0 and fired > 0,
                 quiet, fired, where)


def check_gradients(model: GPT, x: Tensor) -> Check:
    """d logits[:, t] / d input-embedding[:, s]: exactly 0 for s > t, non-zero for s = t and some s < t."""
    captured: list[Tensor] = []

    def capture(_module, _inputs, output):
        emb = output.detach().requires_grad_(True)
        captured.append(emb)
        return emb

    handle = model.tok_emb.register_forward_hook(capture)  # the token embeddings, as the blocks get them
    try:
        logits, _ = model(x)
    finally:
        handle.remove()
    emb = captured[0]
    grads = torch.zeros(x.size(1), x.size(1), dtype=torch.float64)
    for t in range(x.size(1)):
        (grad,) = torch.autograd.grad(logits[:, t].sum(), emb, retain_graph=True)
        grads[t] = grad.abs().sum(dim=(0, 2)).double().cpu()
    return _gradient_check(f"model: gradients ({model.config.attn_backend})", grads)


def check_prefix_parity(model: GPT, x: Tensor, tol: float = 1e-9) -> Check:
    """model(x[:, :t]) equals model(x)[:, :t] for every t (in float64, to rounding)."""
    with torch.no_grad():
        full, _ = model(x)
        errors = [_max(model(x[:, :t])[0] - full[:, :t]) for t in range(1, x.size(1) + 1)]
        # positive control: the last position really reads its past (another first token changes it),
        # so agreeing with the full run is not trivially true
        other_first = _change_at(x, 0, model.config.vocab_size, 9)
        fired = _max(model(other_first)[0][:, -1] - full[:, -1])
    bad = [t for t, e in enumerate(errors, 1) if e > tol]
    where = f"the first {bad[0]} tokens alone give other logits than in the full sequence" if bad else ""
    return Check(f"model: prefix parity ({model.config.attn_backend})", not bad and fired > 0, max(errors), fired,
                 where)


def check_dropout_causality(backend: str = "manual", seed: int = 3, **options) -> Check:
    """Train mode, dropout 0.3, the same RNG state for every forward: a new token at j changes nothing
    before j. options: further GPTConfig options (e.g. pos_emb="rope")."""
    model = leak_test_model(backend, dropout=0.3, **options).train()
    x = random_tokens(3, 8, model.config.vocab_size, seed)
    T = x.size(1)
    change = torch.zeros(T, T, dtype=torch.float64)
    with torch.no_grad():
        torch.manual_seed(seed)
        base, _ = model(x)
        for j in range(T):
            torch.manual_seed(seed)
            out, _ = model(_change_at(x, j, model.config.vocab_size, seed + j))
            change[:, j] = (out - base).abs().amax(dim=(0, 2))
        torch.manual_seed(seed + 100)  # and dropout is really on: another draw changes the output
        other, _ = model(x)
    quiet, fired = _max(change.triu(1)), min(change.diagonal().min().item(), _max(other - base))
    return Check(f"model: dropout causality ({backend})", quiet == 0 and fired > 0, quiet, fired,
                 first_leak(change > 0))


def check_cache_parity(model: GPT, prompt: Tensor, new_tokens: int = 10, seed: int = 4, slide: int = 1) -> Check:
    """Cached and uncached generation draw identical tokens from the same generator (with the window
    sliding `slide` tokens at a time once it is full)."""
    def gen(s: int) -> torch.Generator:
        return torch.Generator(device=prompt.device).manual_seed(s)

    runs = [model.generate(prompt, new_tokens, temperature=1.0, generator=gen(seed), use_cache=use_cache,
                           slide=slide)
            for use_cache in (True, False)]
    differ = (runs[0] != runs[1]).sum().item()
    # positive control: a different seed draws different tokens, so equality above is informative
    other = model.generate(prompt, new_tokens, temperature=1.0, generator=gen(seed + 1), slide=slide)
    fired = (other != runs[0]).sum().item()
    return Check(f"model: KV-cache parity ({model.config.attn_backend}, slide={slide})",
                 differ == 0 and fired > 0, float(differ), float(fired))


def check_chunked_prefill(model: GPT, x: Tensor, split: int | None = None) -> Check:
    """Feeding x through the KV cache in two chunks (T2 queries against a longer key history, the
    case causal_mask's offset exists for) gives the same logits as one full forward."""
    T = x.size(1)
    split = split or T // 2
    with torch.no_grad():
        full, _ = model(x)
        cache = model.new_cache(x.size(0))
        first, _ = model(x[:, :split], cache=cache)
        second, _ = model(x[:, split:], cache=cache)
        chunked = torch.cat([first, second], dim=1)
        # positive control: without the cache the second chunk alone reads a different context
        alone, _ = model(x[:, split:])
    quiet = _max(chunked - full)
    fired = _max(alone - full[:, split:])
    return Check(f"model: chunked prefill ({model.config.attn_backend})", quiet <= 1e-9 and fired > 0, quiet, fired)


# --- label shift ---------------------------------------------------------------------------------

def check_batch_shift(batch_size: int = 64, block_size: int = 8, n: int = 40) -> Check:
    """On data 0, 1, 2, ... (as a numpy array, and as the tensor train.py batches from):
    y[:, :-1] == x[:, 1:], y[:, -1] is the token after the window, y == x + 1, and the offsets
    reach the last valid window without running past the end."""
    wrong, reach, window_ok, top, shifts = 0, True, True, 0, set()
    for corpus in (np.arange(n, dtype=np.uint16), torch.arange(n)):
        x, y = data.get_batch(corpus, batch_size * 20, block_size, torch.Generator().manual_seed(0))
        starts = x[:, 0]
        wrong += ((y[:, :-1] != x[:, 1:]).sum() + (y[:, -1] != starts + block_size).sum() + (y != x + 1).sum()).item()
        window_ok &= bool((x == starts[:, None] + torch.arange(block_size)).all())
        # the last valid offset is n - T - 1: its target window ends exactly at the last token
        reach &= starts.max().item() == n - block_size - 1 and starts.min().item() == 0
        top = max(top, y.max().item())
        shifts |= set((y - x).unique().tolist())
    where = "" if shifts == {1} else f"targets are the inputs shifted by {sorted(shifts)}, not by 1"
    if not reach:
        where += ("; " if where else "") + "the window offsets do not reach both ends of the data"
    return Check("data: targets are next tokens", wrong == 0 and window_ok and reach,
                 float(wrong), float(top == n - 1), where)


def find_offsets(corpus: np.ndarray, x: Tensor) -> list[int]:
    """Where each row of x starts in the corpus (each window must occur exactly once)."""
    T = x.size(1)
    windows = np.lib.stride_tricks.sliding_window_view(corpus.astype(np.int64), T)  # (N - T + 1, T)
    offsets = []
    for row in x.numpy():
        hits = np.flatnonzero((windows == row).all(axis=1))
        if len(hits) != 1:
            raise ValueError(f"a batch row occurs {len(hits)} times in the corpus; use a corpus with unique windows")
        offsets.append(int(hits[0]))
    return offsets


def check_loss_is_next_token_cross_entropy(model: GPT, corpus: np.ndarray, seed: int = 5) -> Check:
    """The loss model(x, y) gives for a get_batch batch equals mean CE(logits[:, t], corpus[i + t + 1]),
    computed by hand from the corpus itself (not from y), where i is found by locating x in the corpus."""
    T = model.config.block_size
    x, y = data.get_batch(corpus, 4, T, torch.Generator().manual_seed(seed))
    offsets = find_offsets(corpus, x)
    with torch.no_grad():
        logits, loss = model(x, y)

        def by_hand(shift: int) -> float:
            return torch.stack([-torch.log_softmax(logits[b, t], -1)[int(corpus[i + t + shift])]
                                for b, i in enumerate(offsets) for t in range(T)]).mean().item()

    quiet = abs(loss.item() - by_hand(1))
    # positive control: the same computation against the unshifted tokens gives another number
    fired = abs(loss.item() - by_hand(0))
    return Check("loss: CE against the next token", quiet < 1e-9 and fired > 1e-6, quiet, fired)


def check_exact_loss_is_next_token_cross_entropy(model: GPT, corpus: np.ndarray) -> Check:
    """The exact loss (training.exact_loss, the final_val_loss of every run) equals the mean CE of
    every corpus token after the first, predicted from the tokens before it in its block_size window,
    recomputed here window by window from the corpus (not from the code's windows or shift)."""
    from training import exact_loss

    T, n = model.config.block_size, len(corpus)
    tokens = torch.from_numpy(corpus.astype(np.int64))
    with torch.no_grad():
        def by_hand(shift: int) -> float:
            losses = []
            for s in range(0, n - 1, T):
                length = min(T, n - 1 - s)
                logits, _ = model(tokens[s:s + length][None])
                targets = tokens[s + shift:s + shift + length]
                losses.append(-torch.log_softmax(logits[0], -1).gather(-1, targets[:, None]))
            return torch.cat(losses).mean().item()

        got = exact_loss(model, corpus, T, 3, "cpu")
        quiet = abs(got - by_hand(1))
        fired = abs(got - by_hand(0))  # positive control: the unshifted targets give another number
    # exact_loss takes the cross-entropy of float32 logits (as in training): agreement to <1e-6, while a
    # wrong shift moves the loss by ~0.1
    return Check("loss: exact val against the next token", quiet < 1e-5 and fired > 1e-3, quiet, fired)


# --- everything at once --------------------------------------------------------------------------

def run_check(name: str, fn: Callable[..., Check], *args) -> Check:
    """Run a check under `name`; an exception (e.g. the ValueError for a query row with no allowed key, or
    a float16 overflow) is a failed check that reports the error, not a crash of the whole run."""
    try:
        check = fn(*args)
    except Exception as e:  # noqa: BLE001 - every failure mode of the code under test counts
        return Check(name, False, math.nan, math.nan, f"raised {type(e).__name__}: {e}")
    check.name = name
    return check


def model_checks(model: GPT, x: Tensor) -> list[Check]:
    """The model-level checks that run on any model (random or trained), in float64."""
    c = model.config
    modern = (c.pos_emb, c.qk_norm) != ("learned", False)
    tag = c.attn_backend + (f", {c.pos_emb}, qk_norm={c.qk_norm}" if modern else "")
    return [run_check(f"model: future perturbation ({tag})", check_future_perturbation, model, x),
            run_check(f"model: gradients ({tag})", check_gradients, model, x),
            run_check(f"model: prefix parity ({tag})", check_prefix_parity, model, x),
            run_check(f"model: KV-cache parity ({tag})", check_cache_parity, model, x[:, :3]),
            run_check(f"model: chunked prefill ({tag})", check_chunked_prefill, model, x)]


def iter_checks() -> Iterator[Check]:
    """Every check, on both backends, on re-drawn random models, one at a time (the mutant tests stop at the
    first that fails): the mask, attention alone, the batches, four models, and the losses."""
    yield run_check("mask: causal_mask is the lower triangle", check_causal_mask)
    yield run_check("data: targets are next tokens", check_batch_shift)
    for name, check in (("future perturbation", check_attention_future_perturbation),
                        ("weights", check_attention_weights), ("extreme scores", check_attention_extreme_scores),
                        ("gradients", check_attention_gradients), ("half precision", check_attention_half_precision)):
        yield run_check(f"attention: {name}", check)
    for backend in ("manual", "sdpa"):
        for options in ({}, MODERN):  # rotary positions reach attention another way than a table
            m = leak_test_model(backend, **options)
            yield from model_checks(m, random_tokens(4, m.config.block_size, m.config.vocab_size))
        yield run_check(f"model: dropout causality ({backend})", check_dropout_causality, backend)
    m = leak_test_model("manual")
    corpus = np.random.default_rng(0).integers(0, m.config.vocab_size, 500).astype(np.uint16)
    yield run_check("loss: CE against the next token", check_loss_is_next_token_cross_entropy, m, corpus)
    # 2 full windows and a short one: the end of the split is scored too
    yield run_check("loss: exact val against the next token", check_exact_loss_is_next_token_cross_entropy, m,
                    corpus[:2 * m.config.block_size + 5])


def all_checks() -> list[Check]:
    """Every check of iter_checks."""
    return list(iter_checks())


def checkpoint_checks(path: str, T: int | None = None) -> list[Check]:
    """The model-level checks on a trained checkpoint's real weights (float64, eval mode, both backends)."""
    from training import load_checkpoint, model_from_checkpoint

    ckpt = load_checkpoint(path)
    checks = []
    for backend in ("manual", "sdpa"):
        m, _ = model_from_checkpoint(ckpt, "cpu", attn_backend=backend, dropout=0.0)
        m = m.double().eval()
        length = min(T or 16, m.config.block_size)
        checks += model_checks(m, random_tokens(3, length, m.config.vocab_size))
    return checks


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Run the causality checks and print each one's numbers.")
    p.add_argument("--ckpt", help="a checkpoint to check (default: re-drawn random models, every check)")
    p.add_argument("--T", type=int, default=16, help="sequence length for checkpoint checks")
    args = p.parse_args(argv)
    try:
        checks = checkpoint_checks(args.ckpt, args.T) if args.ckpt else all_checks()
    except ValueError as e:  # no checkpoint there, or not one of ours: say so in one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    for c in checks:
        print(c)
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
