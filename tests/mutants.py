"""A catalogue of classic causality, window and label-shift bugs, kept as data: one line per mutant.

Each mutant replaces ONE piece of the real code (the rule, the attention function, the fused kernel, the KV
cache, the exact val pass or the batcher) for the duration of a test; the model itself is never copied. The
meta-tests in tests/test_mutants.py run the same checks as the suite (tests/causality.py) with each mutant in
place and require that some check fails, and that the first failure says what kind of bug it is: a LEAK, or
"no leak, but not" the declared rule. They run on the shipped rule, documents and cache, declared as such
(`put_back_shipped`), whatever yours are: a rule changed on purpose may make a catalogued bug harmless, never the
checks blunt.
To add a mutant, write the broken piece (a few lines) and add a `Mutant(...)` line to MUTANTS.
"""

import dataclasses
import itertools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import data
import data.text
import model.attention as attn_lib
import model.gpt
import reference
import training.evaluate

REAL = {"visible": attn_lib.visible, "attention": attn_lib.attention, "get_batch": data.get_batch,
        "inputs_and_targets": data.inputs_and_targets, "exact_loss": training.evaluate.exact_loss,
        "KVCache.positions": attn_lib.KVCache.positions, "GPT.new_cache": model.gpt.GPT.new_cache,
        "documents": attn_lib.documents, "KVCache.documents": attn_lib.KVCache.documents,
        "KVCache.last_document": attn_lib.KVCache.last_document, "join_documents": data.text.join_documents,
        "KVCache.append": attn_lib.KVCache.append, "GPT.forward": model.gpt.GPT.forward,
        "causal_mask": attn_lib.causal_mask}
_REAL_SDPA = F.scaled_dot_product_attention
LEAK, NARROW_OR_WIDE = "LEAK", "no leak, but not"  # what the first failing check must say


@dataclass(frozen=True)
class Mutant:
    name: str
    piece: str  # a key of REAL, or "sdpa"
    replacement: Callable
    says: str = ""  # the first failure's line must contain this ("" = any failure)


def substitute(monkeypatch, piece: str, replacement: Callable) -> None:
    """Put `replacement` wherever the project holds the real piece (every module that imported it, or the class;
    "module:name" in that module alone)."""
    if ":" in piece:
        module, name = piece.split(":")
        monkeypatch.setattr(sys.modules[module], name, replacement)
        return
    if piece == "sdpa":
        monkeypatch.setattr(F, "scaled_dot_product_attention", replacement)
        return
    if "." in piece:
        cls, name = piece.split(".")
        monkeypatch.setattr(getattr(attn_lib, cls, None) or getattr(model.gpt, cls), name, replacement)
        return
    original = REAL[piece]
    now = getattr(sys.modules[original.__module__], piece)  # a replacement put there before, or the original
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in ("model", "data", "training", "train", "sample", "causality") and \
                any(getattr(module, piece, None) is f for f in (original, now)):
            monkeypatch.setattr(module, piece, replacement)


# --- broken rules: visible(q_pos, k_pos, window, q_doc, k_doc) with one thing wrong -------------------

def _in_window(q, k, window):
    return k > q - window if window else torch.ones_like(k <= q)


def rule(positions: Callable) -> Callable:
    """A rule whose positional part is positions(q, k, window) and whose document part is the real one."""
    def broken(q, k, window=0, q_doc=None, k_doc=None):
        allowed = positions(q, k, window)
        return allowed if q_doc is None else allowed & (q_doc == k_doc)
    return broken


# the rule as shipped: the catalogue's bugs are bugs of it, whatever rule model/attention.py holds now
shipped = rule(lambda q, k, window: (k <= q) & _in_window(q, k, window))


def shipped_declared(q: int, k: int, window: int = 0, same_document: bool = True) -> bool:
    """tests/reference.py's declared_rule as shipped."""
    return k <= q and (window == 0 or q - k < window) and same_document


def shipped_documents(tokens: Tensor, sep: int, first: Tensor | int = 0) -> Tensor:
    """model/attention.py's documents as shipped: a separator opens its document."""
    return (tokens == sep).cumsum(-1) + first


def shipped_document_ids(tokens: list[int], sep: int) -> list[int]:
    """tests/reference.py's document_ids as shipped."""
    return list(itertools.accumulate(int(token == sep) for token in tokens))


def put_back_shipped(monkeypatch, but: str = "") -> None:
    """The shipped rule, documents and cache (all but the piece `but`), and their declarations, in place of yours."""
    for piece, replacement in (("visible", shipped), ("documents", shipped_documents), ("GPT.new_cache", cache_of(0))):
        if piece != but:
            substitute(monkeypatch, piece, replacement)
    monkeypatch.setattr(reference, "declared_rule", shipped_declared)
    monkeypatch.setattr(reference, "document_ids", shipped_document_ids)


rule_none = rule(lambda q, k, window: torch.ones_like(k <= q))
rule_hides_diagonal = rule(lambda q, k, window: (k < q) & _in_window(q, k, window))
rule_leaks_one_step = rule(lambda q, k, window: (k <= q + 1) & _in_window(q, k, window))
rule_transposed = rule(lambda q, k, window: shipped(k, q, window))
rule_window_one_wider = rule(lambda q, k, window: (k <= q) & (k >= q - window if window else True))  # >= for >
rule_window_one_narrower = rule(lambda q, k, window: (k <= q) & (k > q - window + 1 if window else True))
# nanochat's bug: one query (decoding), no window; and a prefill after a cache, no window
rule_without_window_when_decoding = rule(lambda q, k, window: shipped(q, k, window if q.numel() > 1 else 0))
rule_without_window_for_chunks = rule(lambda q, k, window: shipped(q, k, 0 if 1 < q.numel() < k.numel() else window))
# a default window far back, past every short test sequence ("no window" should read everything)
rule_with_a_default_window = rule(lambda q, k, window: shipped(q, k, window or 64))
# positions kept in 16 bits: past 32,767 they wrap, and the last of them reads ahead
rule_in_int16 = rule(lambda q, k, window: shipped(q.to(torch.int16), k.to(torch.int16), window))


def causal_mask_top_left(Tq, Tk, device=None, window=0):
    """causal_mask with the queries aligned to the first keys, as sdpa's is_causal (and torch.tril) does."""
    k_pos = torch.arange(Tk, device=device)
    return attn_lib.visible(k_pos[:Tq, None], k_pos[None, :], window)


# --- broken attention functions (each is the real one with one step done wrong) --------------------

def attention_weighing_by(weights: Callable) -> Callable:
    """attention whose weights are weights(scores, a), a: the allowed cells of `mask` (the additive M, 0 / -inf, the
    model passes, or a bool mask)."""
    def attention(q, k, v, mask=None, dropout_p=0.0):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        w = weights(s, torch.ones_like(s, dtype=torch.bool) if mask is None else
                    mask if mask.dtype == torch.bool else mask == 0)
        return w @ v, w
    return attention


# the mask after the softmax: normalised over the future too, zeroed afterwards, rows no longer sum to 1
attention_mask_after_softmax = attention_weighing_by(lambda s, a: torch.softmax(s, -1) * a)
# scores x 0 instead of -inf: exp(0) = 1, the future keeps weight (0.4965 in the seeds' example)
attention_scores_times_zero = attention_weighing_by(lambda s, a: torch.softmax(s * a, -1))
# the softmax over the query axis: each column sums to 1
attention_softmax_over_queries = attention_weighing_by(lambda s, a: torch.softmax(s.masked_fill(~a, -math.inf), -2))
# -1e9 overflows float16 (max 65504), and the softmax runs in the input dtype, not float32
attention_fill_minus_1e9 = attention_weighing_by(lambda s, a: torch.softmax(s.masked_fill(~a, -1e9), -1))
# -1e4, "small enough": until an allowed score is smaller still
attention_fill_minus_1e4 = attention_weighing_by(lambda s, a: torch.softmax(
    s.masked_fill(~a, -1e4), -1, dtype=torch.promote_types(s.dtype, torch.float32)).to(s.dtype))


def attention_unmasked_in_training(q, k, v, mask=None, dropout_p=0.0):
    """The real attention, but its training branch (dropout on) forgets the mask."""
    return REAL["attention"](q, k, v, None if dropout_p > 0 else mask, dropout_p)


def attention_dropout_on_scores(q, k, v, mask=None, dropout_p=0.0):
    """Dropout on the masked scores, before the softmax: a dropped -inf is 0 x -inf = NaN (in training only)."""
    M = 0 if mask is None else attn_lib.additive_mask(mask, q.dtype) if mask.dtype == torch.bool else mask
    w = torch.softmax(F.dropout(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + M, dropout_p), -1)
    return w @ v, w


def attention_unscaled_in_bfloat16(q, k, v, mask=None, dropout_p=0.0):
    """The real attention, but a bfloat16 branch that forgets the 1/√D scale."""
    return REAL["attention"](q * math.sqrt(q.size(-1)) if q.dtype == torch.bfloat16 else q, k, v, mask, dropout_p)


def sdpa_ignores_the_mask(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
    return _REAL_SDPA(q, k, v, attn_mask=None, dropout_p=dropout_p, is_causal=False, **kw)


def sdpa_is_causal_for_square_masks(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
    square = q.size(-2) == k.size(-2)  # "the mask is causal anyway": the window is lost in training
    return _REAL_SDPA(q, k, v, attn_mask=None if square else attn_mask, dropout_p=dropout_p, is_causal=square, **kw)


# --- broken caches and evaluation ------------------------------------------------------------------

def cache_of(extra: int, full: int | None = None) -> Callable:
    """GPT.new_cache whose rolling buffer holds W + extra positions (evicting too few, or too many); without a
    window, `full` positions (None: block_size)."""
    def new_cache(self, B):
        c, w = self.config, self.tok_emb.weight
        size = c.attn_window + extra if c.attn_window else min(c.block_size, full or c.block_size)
        return attn_lib.KVCache(c.n_layer, B, c.n_head, size, c.n_embd // c.n_head, w.device, w.dtype)
    return new_cache


def append_in_float32(self, layer, k, v):
    """The cache's keys and values rounded through float32, whatever the model's dtype."""
    return REAL["KVCache.append"](self, layer, k.float().to(k.dtype), v.float().to(v.dtype))


def append_to_the_next_row(self, layer, k, v):
    """The cache gives each row the keys and values of the batch's previous row (buffers written through a view
    whose layout mixes rows)."""
    k, v = REAL["KVCache.append"](self, layer, k, v)
    return k.roll(1, 0), v.roll(1, 0)


def loss_without_the_last_target(self, idx, targets=None, cache=None, start=0):
    """The training loss over every target but each row's last."""
    logits, loss = REAL["GPT.forward"](self, idx, targets, cache, start)
    return logits, loss if targets is None else F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, :-1].flatten())


def positions_by_slot(self, T):
    q, k = REAL["KVCache.positions"](self, T)
    return q % self.size, k  # the new queries (and their rotations) take their slot for their position


def exact_loss_without_window(model, *args, **kwargs):
    saved = model.config
    model.config = dataclasses.replace(saved, attn_window=0)  # a model rebuilt from a config that lost it
    try:
        return REAL["exact_loss"](model, *args, **kwargs)
    finally:
        model.config = saved


# --- broken documents ---------------------------------------------------------------------------------

# the separator closes its document instead of opening the next
separator_in_the_previous_document = lambda t, sep, first=0: shipped_documents(t, sep, first) - (t == sep).long()
# ids of the next tokens: the future
documents_from_the_targets = lambda t, sep, first=0: shipped_documents(t.roll(-1, dims=-1), sep, first)
# one document mask for the whole batch, from its first row: the other rows read across their own documents' edges
first_rows_documents = lambda t, sep, first=0: shipped_documents(t[:1], sep, first[:1] if torch.is_tensor(first)
                                                                   else first).expand_as(t)
# each forward counts documents from 0: a cached key of document 3 is foreign to a query of document 1
cache_restarts_the_count = lambda self: 0
rows_joined_with_nothing = lambda docs, name: "".join(d for d in docs if d)


def cache_forgets_the_documents(self, new):
    held = REAL["KVCache.documents"](self, new)
    return torch.cat([new[:, :1].expand(-1, held.size(1) - new.size(1)), new], dim=1)  # old keys: the new document


# --- broken batchers -----------------------------------------------------------------------------

def batcher(shift: int) -> Callable:
    """get_batch whose targets are data[i + shift : i + shift + T] (the real one has shift = 1)."""

    def get_batch(data_, batch_size, block_size, generator=None, device="cpu"):
        n = len(data_)
        offsets = torch.randint(2, n - block_size - 2, (batch_size,), generator=generator)  # room for any shift
        idx = offsets[:, None] + torch.arange(block_size)
        return data_[idx].long().to(device), data_[idx + shift].long().to(device)

    return get_batch


def targets_equal_inputs(windows: Tensor) -> tuple[Tensor, Tensor]:
    """inputs_and_targets with the shift forgotten: y = x."""
    return windows[:, :-1], windows[:, :-1]


MUTANTS = [
    Mutant("no mask", "visible", rule_none, LEAK),
    Mutant("mask hides the diagonal", "visible", rule_hides_diagonal),
    Mutant("mask leaks one step ahead", "visible", rule_leaks_one_step, LEAK),
    Mutant("mask transposed", "visible", rule_transposed, LEAK),
    Mutant("window one key wider (>= for >)", "visible", rule_window_one_wider, NARROW_OR_WIDE),
    Mutant("window one key narrower", "visible", rule_window_one_narrower, NARROW_OR_WIDE),
    Mutant("decoding ignores the window", "visible", rule_without_window_when_decoding, NARROW_OR_WIDE),
    Mutant("chunked prefill ignores the window", "visible", rule_without_window_for_chunks, NARROW_OR_WIDE),
    Mutant("a window of 64 when none is set", "visible", rule_with_a_default_window, NARROW_OR_WIDE),
    Mutant("positions in int16: the rule wraps past 32,767", "visible", rule_in_int16, LEAK),
    Mutant("the model's masks take a window of 64 when none is set", "model.gpt:visible", rule_with_a_default_window,
           NARROW_OR_WIDE),
    Mutant("causal_mask aligned top-left (fewer queries than keys)", "causal_mask", causal_mask_top_left,
           "does not read key 1, its own (every rule must allow it) (causal_mask(5, 6)"),
    Mutant("mask applied after softmax, not renormalised", "attention", attention_mask_after_softmax),
    Mutant("future scores multiplied by 0 instead of masked", "attention", attention_scores_times_zero),
    Mutant("softmax over the query axis", "attention", attention_softmax_over_queries),
    Mutant("-1e9 fill (overflows float16)", "attention", attention_fill_minus_1e9),
    Mutant("-1e4 fill instead of -inf (float32)", "attention", attention_fill_minus_1e4),
    Mutant("no mask in training (dropout on)", "attention", attention_unmasked_in_training, LEAK),
    Mutant("dropout on the scores, before the softmax", "attention", attention_dropout_on_scores, "NaN: query"),
    Mutant("no 1/sqrt(D) scale in bfloat16", "attention", attention_unscaled_in_bfloat16),
    Mutant("sdpa without the mask", "sdpa", sdpa_ignores_the_mask, LEAK),
    Mutant("sdpa is_causal instead of the mask: the window lost", "sdpa", sdpa_is_causal_for_square_masks,
           NARROW_OR_WIDE),
    Mutant("rolling cache evicts one key too few", "GPT.new_cache", cache_of(+1)),
    Mutant("rolling cache evicts two keys too many", "GPT.new_cache", cache_of(-2)),  # -1: W held + the new one
    Mutant("the cache holds 64 positions, not block_size", "GPT.new_cache", cache_of(0, 64),
           "the chunked prefill path gives other logits than one forward from position 150"),
    Mutant("rotary positions drift to the rolling cache's slots", "KVCache.positions", positions_by_slot),
    Mutant("the cache rounds keys and values to float32", "KVCache.append", append_in_float32),
    Mutant("the cache mixes the batch's rows", "KVCache.append", append_to_the_next_row, "LEAK across rows"),
    Mutant("the loss drops each row's last target", "GPT.forward", loss_without_the_last_target),
    Mutant("the exact val pass ignores the window", "exact_loss", exact_loss_without_window),
    Mutant("the separator counted in the previous document", "documents", separator_in_the_previous_document,
           NARROW_OR_WIDE),
    Mutant("document ids from the targets (one position early)", "documents", documents_from_the_targets, LEAK),
    Mutant("every row takes the first row's documents", "documents", first_rows_documents, "LEAK across rows"),
    Mutant("the cache keeps the previous document", "KVCache.documents", cache_forgets_the_documents, NARROW_OR_WIDE),
    Mutant("the cache restarts the document count each forward", "KVCache.last_document", cache_restarts_the_count,
           NARROW_OR_WIDE),
    Mutant("documents joined with nothing", "join_documents", rows_joined_with_nothing),
    Mutant("targets equal inputs (y = x)", "get_batch", batcher(0)),
    Mutant("targets shifted by two", "get_batch", batcher(2)),
    Mutant("targets shifted backwards", "get_batch", batcher(-1)),
    Mutant("the shared shift forgotten (y = x in batches and the exact loss)", "inputs_and_targets",
           targets_equal_inputs),
]
