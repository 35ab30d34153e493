"""A catalogue of classic causality and label-shift bugs, kept as data: one line per mutant.

Each mutant replaces ONE piece of the real code (the mask function, the attention function, the
fused kernel, or the batcher) for the duration of a test; the model itself is never copied. The
meta-tests in tests/test_mutants.py run the same checks as the suite (tests/causality.py) with each
mutant in place and require that at least one check fails. To add a mutant, write the broken piece
(a few lines) and add a `Mutant(...)` line to MUTANTS.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

import data
import model.attention as attn_lib

REAL = {"causal_mask": attn_lib.causal_mask, "attention": attn_lib.attention, "get_batch": data.get_batch,
        "inputs_and_targets": data.inputs_and_targets}
_REAL_SDPA = F.scaled_dot_product_attention


@dataclass(frozen=True)
class Mutant:
    name: str
    piece: str  # "causal_mask", "attention", "get_batch", "inputs_and_targets" or "sdpa"
    replacement: Callable


def substitute(monkeypatch, piece: str, replacement: Callable) -> None:
    """Put `replacement` wherever the project holds the real piece (every module that imported it)."""
    if piece == "sdpa":
        monkeypatch.setattr(F, "scaled_dot_product_attention", replacement)
        return
    original = REAL[piece]
    for name, module in list(sys.modules.items()):
        top = name.split(".")[0]
        if top in ("model", "data", "training", "train", "sample", "causality") and \
                getattr(module, piece, None) is original:
            monkeypatch.setattr(module, piece, replacement)


# --- broken masks ----------------------------------------------------------------------------------

def _positions(Tq: int, Tk: int, device) -> tuple[Tensor, Tensor]:
    q = torch.arange(Tq, device=device)[:, None] + (Tk - Tq)  # (Tq, 1) absolute query positions
    return q, torch.arange(Tk, device=device)[None, :]  # (1, Tk)


def mask_none(Tq, Tk, device=None):
    return torch.ones(Tq, Tk, dtype=torch.bool, device=device)


def mask_hides_diagonal(Tq, Tk, device=None):
    q, k = _positions(Tq, Tk, device)
    return k < q


def mask_leaks_one_step(Tq, Tk, device=None):
    q, k = _positions(Tq, Tk, device)
    return k <= q + 1


def mask_transposed(Tq, Tk, device=None):
    return REAL["causal_mask"](Tk, Tk, device).T[Tk - Tq:]  # the last Tq rows of the transposed square


# --- broken attention functions (each is the real one with one step done wrong) --------------------
# They take attention's arguments: `mask` is the additive M (0 / -inf) the model passes, or a bool mask.

def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))


def _allowed(mask):
    return mask if mask.dtype == torch.bool else mask == 0


def attention_mask_after_softmax(q, k, v, mask=None, dropout_p=0.0):
    w = torch.softmax(_scores(q, k), dim=-1)  # normalised over the future too
    if mask is not None:
        w = w * _allowed(mask)  # zeroed afterwards, rows no longer sum to 1
    return w @ v, w


def attention_scores_times_zero(q, k, v, mask=None, dropout_p=0.0):
    s = _scores(q, k)
    if mask is not None:
        s = s * _allowed(mask)  # exp(0) = 1: the future keeps weight (0.4965 in the seeds' example)
    w = torch.softmax(s, dim=-1)
    return w @ v, w


def attention_softmax_over_queries(q, k, v, mask=None, dropout_p=0.0):
    s = _scores(q, k)
    if mask is not None:
        s = s.masked_fill(~_allowed(mask), float("-inf"))
    w = torch.softmax(s, dim=-2)  # over the query axis: each column sums to 1
    return w @ v, w


def attention_fill_minus_1e9(q, k, v, mask=None, dropout_p=0.0):
    s = _scores(q, k)
    if mask is not None:
        s = s.masked_fill(~_allowed(mask), -1e9)  # overflows float16 (max 65504)
    w = torch.softmax(s, dim=-1)  # and in the input dtype, not float32
    return w @ v, w


def attention_fill_minus_1e4(q, k, v, mask=None, dropout_p=0.0):
    s = _scores(q, k)
    if mask is not None:
        s = s.masked_fill(~_allowed(mask), -1e4)  # "small enough": until an allowed score is smaller still
    w = torch.softmax(s, dim=-1, dtype=torch.promote_types(s.dtype, torch.float32)).to(q.dtype)
    return w @ v, w


def sdpa_ignores_the_mask(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
    return _REAL_SDPA(q, k, v, attn_mask=None, dropout_p=dropout_p, is_causal=False, **kw)


# --- broken batchers -----------------------------------------------------------------------------

def batcher(shift: int) -> Callable:
    """get_batch whose targets are data[i + shift : i + shift + T] (the real one has shift = 1)."""

    def get_batch(data_, batch_size, block_size, generator=None, device="cpu"):
        n = len(data_)
        offsets = torch.randint(2, n - block_size - 2, (batch_size,), generator=generator)  # room for any shift
        idx = offsets[:, None] + torch.arange(block_size)
        arr = data_ if isinstance(data_, Tensor) else torch.from_numpy(np.asarray(data_, dtype=np.int64))
        return arr[idx].long().to(device), arr[idx + shift].long().to(device)

    return get_batch


def targets_equal_inputs(windows: Tensor) -> tuple[Tensor, Tensor]:
    """inputs_and_targets with the shift forgotten: y = x."""
    return windows[:, :-1], windows[:, :-1]


MUTANTS = [
    Mutant("no mask", "causal_mask", mask_none),
    Mutant("mask hides the diagonal", "causal_mask", mask_hides_diagonal),
    Mutant("mask leaks one step ahead", "causal_mask", mask_leaks_one_step),
    Mutant("mask transposed", "causal_mask", mask_transposed),
    Mutant("mask applied after softmax, not renormalised", "attention", attention_mask_after_softmax),
    Mutant("future scores multiplied by 0 instead of masked", "attention", attention_scores_times_zero),
    Mutant("softmax over the query axis", "attention", attention_softmax_over_queries),
    Mutant("-1e9 fill (overflows float16)", "attention", attention_fill_minus_1e9),
    Mutant("-1e4 fill instead of -inf (float32)", "attention", attention_fill_minus_1e4),
    Mutant("sdpa without the mask", "sdpa", sdpa_ignores_the_mask),
    Mutant("targets equal inputs (y = x)", "get_batch", batcher(0)),
    Mutant("targets shifted by two", "get_batch", batcher(2)),
    Mutant("targets shifted backwards", "get_batch", batcher(-1)),
    Mutant("the shared shift forgotten (y = x in batches and the exact loss)", "inputs_and_targets",
           targets_equal_inputs),
]
