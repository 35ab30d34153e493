"""The causality and label-shift checks, in one place, for the tests, the mutants and real checkpoints.

Each check measures which outputs move when which inputs move and judges that pattern twice:
- no leak: no query reads a later key, and every query reads its own (whatever the rule);
- the declared rule, exactly: the pattern is the reference's (tests/reference.py: declared_rule, composed over
  the model's layers), so a mask that is narrower or wider than declared is caught and told apart from a leak.
A failure says which: `LEAK: query 3 reads key 5 (2 ahead) in layer 0`, or `no leak, but not attn_window=3:
query 9 does not read key 6, which the rule allows`. Every check carries its positive control: it passes only
if what must not move stays bit-identical AND what must move does move.

The checks look the pieces under test up at call time (`model.attention.visible`, `data.get_batch`, ...), so a
test can substitute a broken piece and watch them fail: see tests/mutants.py.

Run on a trained model:  python tests/causality.py --ckpt out/shakespeare_char/ckpt.pt
"""

import argparse
import math
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data  # noqa: E402
import data.text  # noqa: E402
import model.attention as attn_lib  # noqa: E402
import reference  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.gpt import sample_next  # noqa: E402
from reference import reach, rule_grid, rule_name  # noqa: E402
from training import exact_loss, load_checkpoint, model_from_checkpoint  # noqa: E402

WINDOWS = (0, 3)  # the rule without and with a window shorter than every test sequence
LONG = 300  # the mask's length past every recipe's block_size (256)
T_ATTENTION = 8
PATHS = ("forward", "chunked prefill", "decode")  # logits_by's ways to compute a model's logits


@dataclass
class Check:
    """Outcome of one check. `quiet` must be 0 (what must not change); `fired` must be > 0."""

    name: str
    ok: bool
    quiet: float  # largest change where nothing may change
    fired: float  # smallest change where something must change
    detail: str = ""  # what is wrong, in words: the first (query, key) pair, the layer, ...

    def __str__(self) -> str:
        figures = f"max change where none allowed {self.quiet:.3g} | min change where one is required {self.fired:.3g}"
        if self.ok:
            return f"ok   {self.name:<44} | {figures}"
        unfired = "" if self.fired > 0 else "its positive control did not fire: the check proves nothing"
        return f"FAIL {self.name} — {self.detail or unfired or 'see the figures'} | {figures}"


def require(*checks: Check) -> None:
    """In a test: fail with one line per failed check (what broke and where), not a traceback."""
    # leaks first, rows that mix before all (the batched checks read them as leaks within a row)
    failed = sorted((str(c) for c in checks if not c.ok), key=lambda line: ("— LEAK across" not in line,
                                                                            "— LEAK" not in line))
    if failed:
        import pytest

        pytest.fail("\n".join(failed), pytrace=False)


def _max(x: Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


def _also(check: Check, ok: bool, detail: str) -> Check:
    """check, failing also where not ok, and then saying `detail` unless it already says what is wrong."""
    check.ok, check.detail = check.ok and ok, check.detail or ("" if ok else detail)
    return check


def describe(reads: Tensor, expected: Tensor, rule: str, exact: bool = True, q: Tensor | None = None,
             k: Tensor | None = None) -> str:
    """What is wrong with reads (Tq, Tk) bool (query at position Tk - Tq + i depends on key j; or at q, k, tensors of
    reads' shape) against the rule's expected cells: a leak, a query blind to its own key, other cells than the
    rule's (only forbidden ones unless exact), in that order. '' if nothing."""
    if q is None:
        Tq, Tk = reads.shape
        q, k = torch.arange(Tk - Tq, Tk)[:, None].expand(Tq, Tk), torch.arange(Tk)[None, :].expand(Tq, Tk)
    wrong = [(reads & (k > q), "LEAK: query {q} reads key {k} ({ahead} ahead)"),
             (~reads & (k == q), "query {q} does not read key {k}, its own (every rule must allow it)"),
             (reads & ~expected, "no leak, but not {rule}: query {q} reads key {k}, which the rule forbids"),
             (expected & ~reads & exact, "no leak, but not {rule}: query {q} does not read key {k}, which the rule "
                                         "allows")]
    for cells, text in wrong:
        if cells.any():
            at = tuple(cells.nonzero()[0])
            return text.format(q=q[at].item(), k=k[at].item(), ahead=(k[at] - q[at]).item(), rule=rule)
    return ""


def judge(name: str, change: Tensor, expected: Tensor, rule: str, tol: float = 0.0, exact: bool = True) -> Check:
    """change (Tq, Tk) >= 0: how far query Tk - Tq + i moved when key j did. ok iff it moved by more than tol
    exactly where `expected` (the rule) allows, by at most tol elsewhere (not exact: only its own key need move)."""
    change, (Tq, Tk) = change.double().cpu(), change.shape
    must = expected if exact else torch.eye(Tk, dtype=torch.bool)[Tk - Tq:]
    quiet, fired = _max(change[~expected]), change[must].min().item() if must.any() else 0.0  # a rule of no key
    detail = describe(change > tol, expected, rule, exact)
    if change.isnan().any():  # not "does not read": NaN compares false with everything
        i, j = change.isnan().nonzero()[0].tolist()
        detail = f"NaN: query {Tk - Tq + i} computes NaN (key {j} changed); a -inf score times 0, or inf - inf?"
    return Check(name, quiet <= tol and fired > tol, quiet, fired, detail)


def judge_rows(name: str, change: Tensor, expected: Tensor, rule: str, exact: bool = True) -> Check:
    """judge() for each row of change and expected (B, T, T) (rows differ by documents); the first failure speaks."""
    checks = [judge(name, c, e, rule, exact=exact) for c, e in zip(change, expected, strict=True)]
    bad = next((b for b, c in enumerate(checks) if not c.ok), None)
    detail = "" if bad is None else checks[bad].detail + (f" (row {bad})" if (expected != expected[:1]).any() else "")
    return Check(name, bad is None, max(c.quiet for c in checks), min(c.fired for c in checks), detail)


def mask_picture(window: int, T: int = 6) -> str:
    """causal_mask(T, T) next to the declared rule's grid (■ allowed, · masked)."""
    got, want, width = attn_lib.causal_mask(T, T, window=window).cpu(), rule_grid(T, T, window), max(2 * T + 2, 20)
    row = lambda r: " ".join("■" if a else "·" for a in r.tolist())
    lines = [f"{'causal_mask':<{width}}{rule_name(window)} (tests/reference.py)"]
    return "\n".join(lines + [f"{row(g):<{width}}{row(w)}" for g, w in zip(got, want, strict=True)])


# --- models with no dead paths -------------------------------------------------------------------

def redraw_parameters_(model: torch.nn.Module, seed: int = 0, gain: float = 1.5) -> torch.nn.Module:
    """Re-draw every parameter so that every path carries signal and no softmax is flat or saturated.

    GPT-2's init (std 0.02) gives near-uniform attention, through which a leak can move logits by less than
    rounding, unseen. Here matrices get std gain/sqrt(fan_in) (activations and scores O(1): softmax neither flat
    nor one-hot), norm gains 1 +- 0.5, biases +- 0.5. Tied weights are drawn once."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=p.dtype)  # a norm gain (a 1-d weight): 1 + 0.5 r
            p.copy_(r * gain / math.sqrt(p.shape[-1]) if p.dim() >= 2 else 0.5 * r + name.endswith("weight"))
    return model


MODERN = dict(pos_emb="rope", qk_norm=True)  # every later technique the model has
DOCUMENTS = dict(doc_sep=0)  # token 0 separates documents


def leak_test_model(backend: str = "manual", dropout: float = 0.0, seed: int = 0, **kw) -> GPT:
    """A float64 GPT with two layers (a leak can take two hops) and re-drawn weights, in eval mode."""
    cfg = dict(vocab_size=13, block_size=10, n_layer=2, n_head=2, n_embd=16, bias=True, attn_backend=backend)
    torch.manual_seed(seed)
    return redraw_parameters_(GPT(GPTConfig(**{**cfg, "dropout": dropout, **kw})).double(), seed).eval()


def test_tokens(model: GPT, B: int = 4, seed: int = 1, T: int | None = None) -> Tensor:
    """(B, T) random tokens, by default block_size of them, or 2 blocks for a model that runs past it (its rolling
    cache wraps again and again); with documents, separators at places that differ row by row."""
    x = random_tokens(B, T or model.config.block_size * (2 if model.endless else 1), model.config.vocab_size, seed)
    if (sep := model.config.doc_sep) is not None:
        x[x == sep] = (sep + 1) % model.config.vocab_size
        for b in range(B):
            x[b, [2 + b, 6 + b % 3]] = sep  # (position 0 may start mid-document: no separator needed)
    return x


def expected_reach(model: GPT, x: Tensor) -> Tensor:
    """(B, T, T) bool: the declared rule's reach over the model's layers, for each row's documents."""
    c, (B, T) = model.config, x.shape
    if c.doc_sep is None:
        return reach(rule_grid(T, T, c.attn_window), c.n_layer).expand(B, T, T)
    return torch.stack([reach(rule_grid(T, T, c.attn_window, reference.document_ids(row, c.doc_sep)), c.n_layer)
                        for row in x.tolist()])


def random_tokens(B: int, T: int, V: int, seed: int = 1) -> Tensor:
    """(B, T) token ids; rows differ from each other."""
    return torch.randint(V, (B, T), generator=torch.Generator().manual_seed(seed))


def _change_at(x: Tensor, j: int, V: int, seed: int) -> Tensor:
    """x with the token at position j of every row replaced by a different token."""
    y, shift = x.clone(), 1 + torch.randint(V - 1, (x.size(0),), generator=torch.Generator().manual_seed(seed))
    y[:, j] = (x[:, j] + shift.to(x.device)) % V
    return y


# --- the mask and attention alone ------------------------------------------------------------------

def far_positions(seed: int = 0) -> tuple[Tensor, Tensor]:
    """(Q, 53) query and key positions past LONG, where a rule may change (a chunk's edge, a long window's, an
    overflow): queries at powers of 2 and 10 (and +-1) and at random up to 2^24 (and 0, 1), each against the 40 keys
    before it, itself, the 2 after it, the first 2 and 8 at random."""
    g, bases = torch.Generator().manual_seed(seed), [2**n for n in range(9, 25)] + [10**n for n in range(3, 8)]
    q = torch.tensor([0, 1, *(b + d for b in bases for d in (-1, 0, 1)),  # 0, 1: where a declaration may read ahead
                      *torch.randint(LONG, 2**24, (32,), generator=g).tolist()])
    near, first = (q[:, None] + torch.arange(-40, 3)).clamp(min=0), torch.tensor([[0, 1]]).expand(len(q), 2)
    k = torch.cat([near, first, (torch.rand(len(q), 8, generator=g) * q[:, None]).long()], 1)
    return q[:, None].expand_as(k), k


def check_rule_far_out(window: int) -> str:
    """What is wrong with `visible` against the declared rule at far_positions (positions alone: documents are the
    model checks'), or with the declared rule itself (a later key allowed); '' if nothing."""
    q, k = far_positions()
    want = torch.tensor([reference.declared_rule(a, b, window)
                         for a, b in zip(q.flatten().tolist(), k.flatten().tolist(), strict=True)]).view(q.shape)
    if (ahead := want & (k > q)).any():  # the checks clip it to the past: say so here
        i = tuple(ahead.nonzero()[0])
        return (f"tests/reference.py's declared_rule lets query {q[i]} read key {k[i]}, a later one: no rule may (the "
                "checks hold the model to the rule without the later keys)")
    detail = describe(attn_lib.visible(q, k, window), want, rule_name(window), q=q, k=k)
    return detail and f"{detail} (model/attention.py:visible, checked out to 2^24 positions)"


def check_mask(window: int = 0, T: int = 6) -> Check:
    """causal_mask(Tq, Tk) is the declared rule's grid for every Tq <= Tk <= T (queries aligned with the last keys, as
    a cache decodes at every position), and at LONG (past the recipes' block_size, where a rule may change far back);
    `visible` is the rule up to 2^24 positions (check_rule_far_out). On failure the detail draws the mask next to the
    rule. The declared rule must give every query a key, and none a later one."""
    sizes = [*((Tq, Tk) for Tk in range(T, 0, -1) for Tq in range(Tk, 0, -1)), (LONG, LONG)]  # the drawn ones first
    grids = [rule_grid(Tq, Tk, window) for Tq, Tk in sizes]
    if empty := (~grids[-1].any(-1)).nonzero().flatten().tolist():  # else 0/0 in every check
        return Check("mask: causal_mask", False, math.nan, 0.0, f"tests/reference.py's declared_rule gives query "
                     f"{empty[0]} no key: every query must read one, its own at least")
    checks = [(judge("mask: causal_mask", attn_lib.causal_mask(Tq, Tk, window=window).cpu().double(), grid,
                     rule_name(window)), Tq, Tk) for (Tq, Tk), grid in zip(sizes, grids, strict=True)]
    check, Tq, Tk = next((c for c in checks if not c[0].ok), checks[0])
    if not check.ok:  # a grid not drawn below (queries the last of more keys) says so
        check.detail += f" (causal_mask({Tq}, {Tk}): queries at the last {Tq} of {Tk} positions)" * (Tq < Tk)
        check.detail += "\n" + mask_picture(window, T) + "\n(model/attention.py:visible)"
    elif far := check_rule_far_out(window):
        check.ok, check.detail = False, far
    return check


def _qkv(T: int, seed: int, D: int = 4, **kw) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, T, D, generator=g, dtype=torch.float64, **kw) for _ in range(3))


def check_attention_perturbation(window: int = 0, T: int = T_ATTENTION, seed: int = 0, scale: float = 100.0) -> Check:
    """Perturb q, k and v at one position j (x100): output i moves exactly where the rule lets i read j."""
    (q, k, v), allowed = _qkv(T, seed), attn_lib.causal_mask(T, T, window=window)
    base, _ = attn_lib.attention(q, k, v, allowed)
    change = torch.zeros(T, T, dtype=torch.float64)  # change[i, j]: output i moved when position j did
    for j in range(T):
        s = torch.where(torch.arange(T)[:, None] == j, scale, 1.0).double()  # (T, 1): x scale at j, x 1 elsewhere
        change[:, j] = (attn_lib.attention(q * s, k * s, v * s, allowed)[0] - base).abs().amax(dim=(0, 1, 3))
    return judge("attention: perturbation", change, rule_grid(T, T, window), rule_name(window))


def check_attention_weights(window: int = 0, T: int = T_ATTENTION, seed: int = 0) -> Check:
    """Weights are > 0 exactly where the rule allows (exactly 0 elsewhere) and every row sums to 1."""
    _, w = attn_lib.attention(*_qkv(T, seed), attn_lib.causal_mask(T, T, window=window))
    rows = _max(w.sum(-1) - 1)
    return _also(judge("attention: weights", w.amax(dim=(0, 1)), rule_grid(T, T, window), rule_name(window)),
                 rows < 1e-12, f"rows sum to 1 +- {rows:.3g}, not 1")


def check_attention_extreme_scores(scale: float = 1e150) -> Check:
    """A masked key gets weight exactly 0 however far its score rises above the allowed ones: query 0 may read only
    key 0 (any rule), at score -scale**2, while keys 1.. score +scale**2. -inf in the masked places still gives key 0
    weight 1; a finite fill above -scale**2 (-1e4, -1e9, ..., not float64's finfo.min) hands it to the future."""
    T = 4
    q, k = (torch.full((1, 1, T, 1), scale, dtype=torch.float64) for _ in range(2))
    k[..., 0, 0] = -scale
    v = torch.randn(1, 1, T, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    _, w = attn_lib.attention(q, k, v, attn_lib.causal_mask(T, T))
    quiet, fired = _max(w[0, 0, 0, 1:]), w[0, 0, 0, 0].item()  # query 0's weight on later keys, on its own (all of it)
    return Check("attention: extreme scores", quiet == 0.0 and fired == 1.0, quiet, fired,
                 f"LEAK: query 0 gives weight {quiet:.3g} to a later key" if quiet else "" if fired == 1.0 else
                 f"query 0 gives its only allowed key, its own, weight {fired:.3g}, not 1")


def check_attention_gradients(window: int = 0, T: int = T_ATTENTION, seed: int = 0) -> Check:
    """d out[t] / d (k, v)[s] is non-zero exactly where the rule lets t read s: catches a mask that hides
    the diagonal or masks too much, which perturbing the future alone cannot see."""
    q, k, v = _qkv(T, seed, requires_grad=True)
    out, _ = attn_lib.attention(q, k, v, attn_lib.causal_mask(T, T, window=window))
    grads = torch.zeros(T, T, dtype=torch.float64)  # grads[t, s]: influence of key position s on query t
    for t in range(T):
        gk, gv = torch.autograd.grad(out[:, :, t].sum(), (k, v), retain_graph=True)
        grads[t] = gk.abs().sum((0, 1, 3)) + gv.abs().sum((0, 1, 3))
    return judge("attention: gradients", grads, rule_grid(T, T, window), rule_name(window))


def check_attention_half_precision(window: int = 0, T: int = T_ATTENTION, seed: int = 0) -> Check:
    """float16 and bfloat16 inputs: finite outputs close to float64, weights > 0 exactly where the rule allows."""
    (q, k, v), allowed = _qkv(T, seed, D=8), attn_lib.causal_mask(T, T, window=window)
    ref, _ = attn_lib.attention(q, k, v, allowed)
    for dtype in (torch.float16, torch.bfloat16):
        out, w = attn_lib.attention(q.to(dtype), k.to(dtype), v.to(dtype), allowed)
        err = _max(out.double() - ref)
        check = _also(judge("attention: half precision", w.double().amax(dim=(0, 1)), rule_grid(T, T, window),
                            rule_name(window)), err < 0.1, f"{dtype} output off by {err:.3g}")
        if not check.ok:
            break
    return check


# --- the model, on every path -------------------------------------------------------------------------

def logits_by(model: GPT, x: Tensor, path: str, decoded: int | None = None) -> Tensor:
    """(B, T, V) logits of x computed by one path: "forward" (one call), "chunked prefill" (two chunks through
    the KV cache) or "decode" (one token at a time through it, past block_size for an endless model; the last
    `decoded` tokens only, after a prefill of the others)."""
    if path == "forward":
        return model(x)[0]
    cache, chunks = model.new_cache(x.size(0)), x.split(x.size(1) // 2 if path == "chunked prefill" else 1, dim=1)
    if path == "decode" and decoded:
        chunks = (x[:, :-decoded], *chunks[-decoded:])
    return torch.cat([model(chunk, cache=cache)[0] for chunk in chunks], dim=1)


def model_rule(model: GPT) -> str:
    """The declared rule's name for the model."""
    return rule_name(model.config.attn_window, model.config.doc_sep is not None)


def perturbed_reach(model: GPT, x: Tensor, variants: Tensor) -> Tensor:
    """expected[b, i, j] (B, T, T): whether logit i of row b may move when token j changes to variants[j, b]: j is in
    i's reach before or after, or i's reach itself changed (a separator added or removed moves documents)."""
    before = expected_reach(model, x)
    if model.config.doc_sep is None:
        return before
    after = torch.stack([expected_reach(model, v) for v in variants])  # (T, B, T, T): [j, b, i, k]
    j = torch.arange(x.size(1))
    moved = (after != before).any(-1) | after[j, :, :, j] | before.permute(2, 0, 1)  # (T, B, T): [j, b, i]
    return moved.permute(1, 2, 0)


def check_perturbation(model: GPT, x: Tensor, path: str = "forward", seed: int = 2) -> Check:
    """For every position j: a new token at j moves the logits exactly at the positions the rule lets reach j
    through the model's layers, and leaves every other logit bit-identical. On the forward path a leak also
    names the first layer whose output shows it. (The T variants of x run as one batch: two passes per path.)"""
    (B, T), V = x.shape, model.config.vocab_size
    outputs: list[Tensor] = []
    hooks = [b.register_forward_hook(lambda _m, _i, o: outputs.append(o)) for b in model.blocks if path == "forward"]
    variants = torch.stack([_change_at(x, j, V, seed + j) for j in range(T)])  # (T, B, T)
    try:
        with torch.no_grad():
            # x runs in the rows its variants run in, in a batch of the same size: a CPU BLAS may round a row by its
            # place in its tiles (AVX2 MKL does), and x elsewhere would differ in the last bits where nothing moved
            same = logits_by(model, x.repeat(T, 1), path)
            logits = logits_by(model, variants.flatten(0, 1), path)  # variant j's row b at row j * B + b
    finally:
        for h in hooks:
            h.remove()
    change = (logits - same).abs().amax(dim=-1).view(T, B, T).permute(1, 2, 0).double().cpu()  # [b, i, j]
    check = judge_rows(f"model: perturbation, {path}", change, perturbed_reach(model, x, variants), model_rule(model))
    if check.detail.startswith("LEAK") and hooks:
        b, i, j = ((change > 0) & torch.ones(T, T, dtype=torch.bool).triu(1)).nonzero()[0].tolist()
        refs, outs = outputs[:len(hooks)], outputs[len(hooks):]  # x's pass, then the variants'
        moved = [(o[j * B + b, i] != ref[j * B + b, i]).any().item() for ref, o in zip(refs, outs, strict=True)]
        if any(moved):
            head, row, tail = check.detail.partition(" (row")
            check.detail = f"{head} in layer {moved.index(True)}{row}{tail}"
    return check


def check_rows_apart(model: GPT, x: Tensor) -> Check:
    """Each row of a batch is its own sequence, on every path: new tokens in row 0 leave every other row's logits
    bit-identical. (The perturbation checks batch their variants, where rows that mix would read as a leak.)"""
    other = x.clone()
    other[0] = random_tokens(1, x.size(1), model.config.vocab_size, seed=9)[0]
    with torch.no_grad():
        moved = {path: (logits_by(model, x, path) - logits_by(model, other, path)).abs().amax(-1)  # (B, T)
                 for path in PATHS}
    where = next((f"LEAK across rows: row {b + 1}'s logit {i} moves when row 0's tokens change ({path})"
                  for path, m in moved.items() for b, i in (m[1:] > 0).nonzero()[:1].tolist()), "")
    return Check("model: rows apart", not where, max(_max(m[1:]) for m in moved.values()),
                 min(m[0].max().item() for m in moved.values()), where)


def check_long_range(backend: str, seed: int = 6, **options) -> Check:
    """A model of block_size LONG (past every recipe's), on every path: a new token at key 0 or LONG // 2 moves
    exactly the logits the rule's reach allows, and the cached paths give the forward's logits (a window or a
    cache shorter than block_size hidden in the model shows only at such a length)."""
    model = leak_test_model(backend, block_size=LONG, **options)
    x, V, keys = random_tokens(1, LONG, model.config.vocab_size, seed), model.config.vocab_size, [0, LONG // 2]
    expected = expected_reach(model, x)[0]  # (T, T)
    variants = torch.cat([_change_at(x, j, V, seed + j) for j in keys])  # (K, T)
    checks = []
    for path in PATHS:
        with torch.no_grad():
            moved = (logits_by(model, variants, path, 8) - logits_by(model, x.repeat(len(keys), 1), path, 8)).abs()
        change = expected.double()  # the keys not changed: read as the rule says
        change[:, keys] = moved.amax(-1).T.double().cpu()  # (T, K)
        checks.append(judge(f"model: long range, {path}", change, expected, model_rule(model)))
        checks[-1].detail += f" ({path})" * (not checks[-1].ok)
    return next((c for c in [*checks, check_chunked_prefill(model, x, decoded=8)] if not c.ok), checks[0])


def check_gradients(model: GPT, x: Tensor) -> Check:
    """d logits[:, t] / d input-embedding[:, s] is non-zero exactly where the rule's reach lets t read s."""
    captured: list[Tensor] = []  # the token embeddings, as the blocks get them, made a leaf to differentiate by
    handle = model.tok_emb.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().requires_grad_(True))
                                                 or captured[-1])
    try:
        logits, _ = model(x)
    finally:
        handle.remove()
    emb, (B, T) = captured[0], x.shape
    grads = torch.zeros(B, T, T, dtype=torch.float64)  # [b, t, s]
    for t in range(T):
        (grad,) = torch.autograd.grad(logits[:, t].sum(), emb, retain_graph=True)
        grads[:, t] = grad.abs().sum(dim=2).double().cpu()
    return judge_rows("model: gradients", grads, expected_reach(model, x), model_rule(model))


def check_prefix_parity(model: GPT, x: Tensor, tol: float = 1e-9) -> Check:
    """model(x[:, :t]) equals model(x)[:, :t] for every t (in float64, to rounding)."""
    with torch.no_grad():
        full, _ = model(x)
        errors = [_max(model(x[:, :t])[0] - full[:, :t]) for t in range(1, x.size(1) + 1)]
        # positive control: the last position really reads the furthest token the rule lets it reach
        other = _change_at(x, expected_reach(model, x)[0, -1].nonzero()[0].item(), model.config.vocab_size, 9)
        fired = _max(model(other)[0][:, -1] - full[:, -1])
    bad = [t for t, e in enumerate(errors, 1) if e > tol]
    where = f"the first {bad[0]} tokens alone give other logits than in the full sequence" if bad else ""
    return Check("model: prefix parity", not bad and fired > 0, max(errors), fired, where)


def check_dropout_causality(backend: str = "manual", seed: int = 3, attn_window: int = 0, **options) -> Check:
    """Train mode with targets (the training forward), dropout 0.3, the same RNG state for every forward: a new token
    at j moves no logit the rule does not let reach j (dropout may zero a path, never open one). options: GPTConfig
    options."""
    model = leak_test_model(backend, dropout=0.3, attn_window=attn_window, **options).train()
    x = test_tokens(model, 3, seed)[:, :model.config.block_size]
    variants = torch.stack([_change_at(x, j, model.config.vocab_size, seed + j) for j in range(x.size(1))])

    def run(tokens: Tensor, draw: int = seed) -> Tensor:
        torch.manual_seed(draw)
        return model(tokens, tokens)[0]  # any targets: the path train.py takes

    with torch.no_grad():
        base = run(x)
        change = torch.stack([(run(v) - base).abs().amax(dim=2) for v in variants], dim=-1)  # [b, i, j]
        other = run(x, seed + 100)  # and dropout is really on: another draw changes the output
    return _also(judge_rows("model: training", change, perturbed_reach(model, x, variants), model_rule(model),
                            exact=False), _max(other - base) > 0, "dropout does not act in train mode")


def check_cache_parity(model: GPT, prompt: Tensor, new_tokens: int = 16, seed: int = 4, slide: int = 1) -> Check:
    """Cached and uncached generation draw identical tokens from the same generator, past block_size (a full
    window sliding `slide` tokens at a time; an endless model's cache rolling), and where slide is 1 or the model
    endless, the tokens of the definition: each drawn from one forward over all it may read (nanoGPT's crop)."""
    gen = lambda s: torch.Generator(device=prompt.device).manual_seed(s)
    draw = lambda cache: model.generate(prompt, new_tokens, temperature=1.0, generator=gen(seed), use_cache=cache,
                                        slide=slide)
    runs = {"cached": draw(True), "uncached": draw(False)}
    if slide == 1 or model.endless:
        seq, g = prompt, gen(seed)
        with torch.no_grad():
            for _ in range(new_tokens):
                logits = model(seq if model.endless else seq[:, -model.config.block_size:])[0][:, -1]
                seq = torch.cat([seq, sample_next(logits, 1.0, generator=g)], dim=1)
        runs["one-forward-per-token"] = seq
    truth = runs.pop("one-forward-per-token", runs["cached"])  # the definition where there is one: it names the path
    differ = {path: (run != truth).any(0).nonzero() for path, run in runs.items()}
    # positive control: a different seed draws different tokens, so equality above is informative
    other = model.generate(prompt, 4, temperature=1.0, generator=gen(seed + 1), slide=slide)
    fired = (other != runs["cached"][:, :other.size(1)]).sum().item()
    by = "one forward per token" if truth is not runs["cached"] else "the cached path"
    where = next((f"the {p} path parts from {by} at token {d[0].item()}" for p, d in differ.items() if len(d)), "")
    return Check("model: KV-cache parity", not where and fired > 0, float(sum(map(len, differ.values()))),
                 float(fired), where)


def check_chunked_prefill(model: GPT, x: Tensor, decoded: int | None = None) -> Check:
    """Feeding x through the KV cache in two chunks (queries against a longer key history) and one token at a
    time (the last `decoded`, None: all) gives the full forward's logits (to rounding)."""
    with torch.no_grad():
        full = model(x)[0]
        errors = {path: (logits_by(model, x, path, decoded) - full).abs().amax((0, 2))  # (T,)
                  for path in ("chunked prefill", "decode")}
        # positive control: without the cache the second chunk alone reads a different context
        split = x.size(1) // 2
        fired = _max(model(x[:, split:])[0] - full[:, split:])
    bad = [(path, (e > 1e-9).nonzero()[0, 0].item()) for path, e in errors.items() if e.max() > 1e-9]
    return Check("model: cache values", not bad and fired > 0, max(_max(e) for e in errors.values()), fired,
                 "the {} path gives other logits than one forward from position {}".format(*bad[0]) if bad else "")


def check_rolling_cache(model: GPT, x: Tensor) -> Check:
    """Fed x (B, T) a token at a time, the cache holds every key a later query may read (the declared rule's
    positions), in no more slots than the window W or those keys and the next one need: memory stays bounded."""
    W, T, cache = model.config.attn_window, x.size(1), model.new_cache(x.size(0))
    with torch.no_grad():
        for t in range(T):
            model(x[:, t:t + 1], cache=cache)
    held = sorted(cache.positions(0)[1].tolist())
    want = [k for k in range(T) if any(reference.declared_rule(q, k, W) for q in range(T, T + LONG))]
    missing, slots = sorted(set(want) - set(held)), max(W, len(want) + 1)
    detail = (f"it holds positions {held}, not {missing}, which {rule_name(W)} lets a later query read" if missing else
              f"it holds {len(held)} positions {held}, more than {slots}: later queries need {want}"
              if len(held) > slots else "")
    return Check("model: rolling cache", not detail, float(len(missing) + max(0, len(held) - slots)), float(len(want)),
                 detail)


# --- label shift ---------------------------------------------------------------------------------

def check_batch_shift(batch_size: int = 64, block_size: int = 8, n: int = 40) -> Check:
    """On data 0, 1, 2, ...: y[:, :-1] == x[:, 1:], y[:, -1] is the token after the window, y == x + 1, and the
    offsets reach the last valid window without running past the end."""
    wrong, reach_ends, window_ok, top, shifts = 0, True, True, 0, set()
    for corpus in (torch.arange(n), torch.arange(n, dtype=torch.int32)):  # int32: as train.py holds its splits
        x, y = data.get_batch(corpus, batch_size * 20, block_size, torch.Generator().manual_seed(0))
        starts = x[:, 0]
        wrong += ((y[:, :-1] != x[:, 1:]).sum() + (y[:, -1] != starts + block_size).sum() + (y != x + 1).sum()).item()
        window_ok &= bool((x == starts[:, None] + torch.arange(block_size)).all())
        # the last valid offset is n - T - 1: its target window ends exactly at the last token
        reach_ends &= starts.max().item() == n - block_size - 1 and starts.min().item() == 0
        top = max(top, y.max().item())
        shifts |= set((y - x).unique().tolist())
    where = "; ".join([f"targets are the inputs shifted by {sorted(shifts)}, not by 1"] * (shifts != {1}) +
                      ["the window offsets do not reach both ends of the data"] * (not reach_ends))
    return Check("data: targets are next tokens", wrong == 0 and window_ok and reach_ends,
                 float(wrong), float(top == n - 1), where)


def check_documents_joined() -> Check:
    """A folder's files, and a file's lines with documents="lines", load as documents each opened by the
    separator, none glued to the one before; a single file without the option loads as it is."""
    sep = data.SEPARATOR
    with tempfile.TemporaryDirectory() as folder:
        for name, text in (("a.txt", "ab\n"), ("b.txt", "cd")):
            (Path(folder) / name).write_text(text)
        got = [data.text.load_text(folder)[0], data.text.load_text(f"{folder}/a.txt", documents="lines")[0],
               data.text.load_text(f"{folder}/b.txt")[0]]
    want = [f"{sep}ab\n{sep}cd", f"{sep}ab", "cd"]
    wrong = sum(g != w for g, w in zip(got, want, strict=True))
    return Check("data: documents joined by the separator", wrong == 0, float(wrong), float(len(want)),
                 "" if not wrong else f"loaded {got}, not {want}: documents glued or mis-split")


def find_offsets(corpus: np.ndarray, x: Tensor) -> list[int]:
    """Where each row of x starts in the corpus (each window must occur exactly once)."""
    windows = np.lib.stride_tricks.sliding_window_view(corpus.astype(np.int64), x.size(1))  # (N - T + 1, T)
    hits = [np.flatnonzero((windows == row).all(axis=1)) for row in x.numpy()]
    if (bad := next((len(h) for h in hits if len(h) != 1), None)) is not None:
        raise ValueError(f"a batch row occurs {bad} times in the corpus; use a corpus with unique windows")
    return [int(h[0]) for h in hits]


def check_loss_is_next_token_cross_entropy(model: GPT, corpus: np.ndarray, seed: int = 5) -> Check:
    """model(x, y)'s loss on a get_batch batch is mean CE(logits[:, t], corpus[i + t + 1]), by hand from the corpus
    (not from y), i found by locating x in it."""
    T = model.config.block_size
    x, y = data.get_batch(torch.from_numpy(corpus.astype(np.int64)), 4, T, torch.Generator().manual_seed(seed))
    offsets = find_offsets(corpus, x)
    with torch.no_grad():
        logits, loss = model(x, y)

        def by_hand(shift: int) -> float:
            return torch.stack([-torch.log_softmax(logits[b, t], -1)[int(corpus[i + t + shift])]
                                for b, i in enumerate(offsets) for t in range(T)]).mean().item()

    # positive control: the same computation against the unshifted tokens gives another number
    quiet, fired = (abs(loss.item() - by_hand(shift)) for shift in (1, 0))
    return Check("loss: CE against the next token", quiet < 1e-9 and fired > 1e-6, quiet, fired,
                 "" if quiet < 1e-9 else "the training loss is not the cross-entropy of the next tokens")


def check_exact_loss_is_next_token_cross_entropy(model: GPT, corpus: np.ndarray) -> Check:
    """training.exact_loss (every run's final_val_loss) is the mean CE of every corpus token after the first, given
    the tokens before it in its block_size window: recomputed window by window, not from the code's windows or shift."""
    T, n, tokens = model.config.block_size, len(corpus), torch.from_numpy(corpus.astype(np.int64))
    with torch.no_grad():
        def by_hand(shift: int) -> float:
            losses = []
            for s in range(0, n - 1, T):
                length = min(T, n - 1 - s)
                logits = model(tokens[s:s + length][None])[0][0]
                losses.append(-torch.log_softmax(logits, -1).gather(-1, tokens[s + shift:s + shift + length, None]))
            return torch.cat(losses).mean().item()

        got = exact_loss(model, tokens, T, 3, "cpu")
        quiet, fired = (abs(got - by_hand(shift)) for shift in (1, 0))  # control (0): not the same loss
    # exact_loss takes the cross-entropy of float32 logits (as in training): agreement to <1e-6, while a
    # wrong shift (or another mask) moves the loss by ~0.1
    return Check("loss: exact val against the next token", quiet < 1e-5 and fired > 1e-3, quiet, fired, "" if
                 quiet < 1e-5 else "the exact val loss is not the cross-entropy of the next tokens under the rule")


# --- everything at once --------------------------------------------------------------------------

def run_check(name: str, fn: Callable[..., Check], *args) -> Check:
    """Run a check under `name`; an exception (e.g. the ValueError for a query row with no allowed key, or
    a float16 overflow) is a failed check that reports the error, not a crash of the whole run."""
    try:
        check = fn(*args)
    except Exception as e:  # noqa: BLE001 - every failure mode of the code under test counts
        code = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).is_relative_to(ROOT)
                and not Path(f.filename).is_relative_to(ROOT / "tests")]  # where the code under test raised
        where = f" ({Path(code[-1].filename).relative_to(ROOT)}:{code[-1].lineno})" if code else ""
        return Check(name, False, math.nan, math.nan, f"raised {type(e).__name__}: {e}{where}")
    check.name = name
    return check


def model_checks(model: GPT, x: Tensor) -> Iterator[Check]:
    """The model-level checks that run on any model (random or trained), in float64; x: test_tokens(model)."""
    c = model.config  # the tag: the backend, then what differs from the defaults
    modern = f", {c.pos_emb}, qk_norm={c.qk_norm}" if (c.pos_emb, c.qk_norm) != ("learned", False) else ""
    window = f", attn_window={c.attn_window}" if c.attn_window else ""
    tag = c.attn_backend + modern + window + (", documents" if c.doc_sep is not None else "")
    if model.config.attn_window:
        yield run_check(f"model: rolling cache ({tag})", check_rolling_cache, model, x)
    yield run_check(f"model: rows apart ({tag})", check_rows_apart, model, x)
    for path in PATHS:
        yield run_check(f"model: perturbation, {path} ({tag})", check_perturbation, model, x, path)
    yield run_check(f"model: gradients ({tag})", check_gradients, model, x)
    yield run_check(f"model: cache values ({tag})", check_chunked_prefill, model, x)
    yield run_check(f"model: prefix parity ({tag})", check_prefix_parity, model, x[:, :model.config.block_size])
    yield run_check(f"model: KV-cache parity ({tag})", check_cache_parity, model, x[:, :3])


def attention_checks(window: int) -> Iterator[Check]:
    """The mask and attention() alone, under the rule with this window."""
    yield run_check(f"mask: causal_mask ({rule_name(window)})", check_mask, window)
    for name, check in (("perturbation", check_attention_perturbation), ("weights", check_attention_weights),
                        ("gradients", check_attention_gradients), ("half precision", check_attention_half_precision)):
        yield run_check(f"attention: {name} ({rule_name(window)})", check, window)


def iter_checks() -> Iterator[Check]:
    """Every check, one at a time (the mutant tests stop at the first that fails): the mask and attention under
    each window, the batches and documents, the losses, training's forward with dropout, then models on both
    backends with and without documents, rotary positions and a window, and models LONG positions long."""
    for window in WINDOWS:
        yield from attention_checks(window)
    yield run_check("attention: extreme scores", check_attention_extreme_scores)
    yield run_check("data: targets are next tokens", check_batch_shift)
    yield run_check("data: documents joined by the separator", check_documents_joined)
    for window in WINDOWS:
        m = leak_test_model("manual", attn_window=window)
        corpus = np.random.default_rng(0).integers(0, m.config.vocab_size, 500).astype(np.uint16)
        tag = f" ({rule_name(window)})"
        yield run_check("loss: CE against the next token" + tag, check_loss_is_next_token_cross_entropy, m, corpus)
        # 2 full windows and a short one: the end of the split is scored too
        yield run_check("loss: exact val against the next token" + tag, check_exact_loss_is_next_token_cross_entropy,
                        m, corpus[:2 * m.config.block_size + 5])
    yield from (run_check(f"model: training ({backend}, {rule_name(window)})", check_dropout_causality, backend, 3,
                          window) for backend in ("manual", "sdpa") for window in WINDOWS)
    for options in (DOCUMENTS, dict(attn_window=3), {}, MODERN, dict(MODERN, attn_window=3),
                    dict(MODERN, attn_window=3, **DOCUMENTS)):
        for backend in ("manual", "sdpa"):
            m = leak_test_model(backend, **options)
            yield from model_checks(m, test_tokens(m))
    for backend, options in (("manual", {}), ("sdpa", MODERN)):
        tag = ", ".join([backend, *(f"{k}={v}" for k, v in options.items())])
        yield run_check(f"model: long range ({tag})", lambda: check_long_range(backend, **options))  # noqa: B023


def checkpoint_checks(path: str, T: int | None = None) -> list[Check]:
    """The model-level checks on a trained checkpoint's real weights (float64, eval mode, both backends)."""
    ckpt, checks = load_checkpoint(path), []
    for backend in ("manual", "sdpa"):
        m = model_from_checkpoint(ckpt, "cpu", attn_backend=backend, dropout=0.0)[0].double().eval()
        # a query and an earlier key; past block_size only for an endless model, and not far: the cost grows as T³
        top, name = (2 * m.config.block_size, "2 x block_size") if m.endless else (m.config.block_size, "block_size")
        if T is not None and not 2 <= T <= top:
            raise ValueError(f"--T={T}: give a length from 2 to {name}={top}")
        length = T or min(16, m.config.block_size) + (m.config.block_size if m.endless else 0)
        checks += model_checks(m, test_tokens(m, 3, T=length))
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run the causality checks and print each one's numbers.")
    p.add_argument("--ckpt", help="a checkpoint to check (default: re-drawn random models, every check)")
    p.add_argument("--T", type=int, default=None, help="sequence length for checkpoint checks (default: 16, "
                                                        "plus block_size for a model that runs past it)")
    args = p.parse_args(argv)
    if args.T is not None and not args.ckpt:
        p.error("--T sets the length of a checkpoint's checks: give --ckpt too")
    try:
        checks = checkpoint_checks(args.ckpt, args.T) if args.ckpt else list(iter_checks())
    except ValueError as e:  # no checkpoint there, or not one of ours: say so in one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    for c in checks:
        print(c)
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
