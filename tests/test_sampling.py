"""sample_next's distribution for every temperature, top_k and top_p, row by row, against the definitions."""

import itertools
import math

import pytest
import torch

from model import sample_next

pytestmark = pytest.mark.mask  # sample_next lives in model/gpt.py: in the mask command
V = 7
# three rows in different orders and at different scales: their thresholds differ row by row
ROWS = torch.randn(3, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64) \
    * torch.tensor([[0.5], [2.0], [4.0]], dtype=torch.float64)
# p on the tokens in keep, rescaled to sum to 1; 0 elsewhere
renormalised = lambda p, keep: [p[i] / sum(p[j] for j in keep) if i in keep else 0.0 for i in range(len(p))]


def reference_distribution(row: list[float], temperature: float, top_k: int | None, top_p: float | None) -> list[float]:
    """softmax(row / temperature); top_k keeps the k likeliest; top_p then keeps, of those renormalised, the
    smallest set (likeliest first) whose mass reaches top_p; what is kept is renormalised."""
    p = [math.exp((x - max(row)) / temperature) for x in row]
    keep = sorted(range(len(row)), key=lambda i: -p[i])[:top_k or len(row)]
    if top_p is not None and top_p < 1:
        mass = sum(p[i] for i in keep)
        before = list(itertools.accumulate([p[i] / mass for i in keep], initial=0.0))  # kept mass before each token
        keep = [i for i, acc in zip(keep, before[:-1], strict=True) if acc < top_p]
    return renormalised(p, keep)


def drawn_from(monkeypatch, logits: torch.Tensor, **options) -> torch.Tensor:
    """The (B, V) probabilities sample_next hands to torch.multinomial."""
    seen = []
    monkeypatch.setattr(torch, "multinomial", lambda p, num_samples, generator=None: seen.append(p) or
                        torch.zeros(p.size(0), 1, dtype=torch.long))
    sample_next(logits, **options)
    return seen[0]


@pytest.mark.parametrize("temperature, top_k, top_p", list(itertools.product(
    [0.5, 1.0, 2.0], [None, 1, 2, 4, V], [None, 0.3, 0.6, 0.9, 1.0])))
def test_each_row_is_drawn_from_its_own_filtered_distribution(monkeypatch, temperature, top_k, top_p):
    got = drawn_from(monkeypatch, ROWS, temperature=temperature, top_k=top_k, top_p=top_p)
    for b, row in enumerate(ROWS.tolist()):
        want = torch.tensor(reference_distribution(row, temperature, top_k, top_p), dtype=torch.float64)
        torch.testing.assert_close(got[b].double(), want, rtol=0, atol=1e-12,
                                   msg=f"row {b}, temperature {temperature}, top_k {top_k}, top_p {top_p}")
        assert torch.equal(got[b] == 0, want == 0), f"row {b}: another set of tokens kept"


def test_top_p_stops_where_the_kept_mass_reaches_it_exactly(monkeypatch):
    """Four tokens at 0.25 (exact in binary): top_p = 0.5 keeps two (the mass before the third reaches it)."""
    for top_p, n_kept in ((0.5, 2), (0.5 + 1e-9, 3), (0.25, 1), (0.75, 3), (0.75 + 1e-9, 4)):
        probs = drawn_from(monkeypatch, torch.zeros(1, 4, dtype=torch.float64), temperature=1.0, top_p=top_p)[0]
        assert (probs > 0).sum().item() == n_kept, f"top_p={top_p}"
        assert torch.allclose(probs[probs > 0], torch.full((n_kept,), 1 / n_kept, dtype=torch.float64))
    wide = drawn_from(monkeypatch, torch.zeros(1, 128, dtype=torch.float64), temperature=1.0, top_p=0.75)[0]
    assert (wide > 0).sum().item() == 96  # and over a vocabulary of 128: a nucleus of any width


def test_the_table_tells_the_orders_of_the_steps_apart():
    """Control: tempering after the nucleus, or the nucleus of all tokens, not top_k's, is off the table somewhere."""
    def untempered_nucleus(row, temperature, top_k, top_p):
        keep = [i for i, x in enumerate(reference_distribution(row, 1.0, top_k, top_p)) if x > 0]
        return renormalised(reference_distribution(row, temperature, None, None), keep)

    def nucleus_of_everything(row, temperature, top_k, top_p):
        in_k = set(sorted(range(len(row)), key=lambda i: -row[i])[:top_k or len(row)])
        keep = [i for i, x in enumerate(reference_distribution(row, temperature, None, top_p)) if x > 0 and i in in_k]
        return renormalised(reference_distribution(row, temperature, None, None), keep)
    cells = list(itertools.product(ROWS.tolist(), [0.5, 2.0], [2, 4], [0.3, 0.6, 0.9]))
    for wrong in (untempered_nucleus, nucleus_of_everything):
        assert any(max(abs(a - b) for a, b in zip(wrong(*c), reference_distribution(*c), strict=True)) > 1e-6
                   for c in cells), wrong.__name__


@pytest.mark.parametrize("options", [dict(temperature=0), dict(temperature=1e-308), dict(top_k=1), dict(top_p=1e-9)],
                         ids=["greedy", "tiny-temperature", "top_k-1", "tiny-top_p"])
def test_the_degenerate_settings_all_draw_the_argmax(options):
    """A tiny temperature would overflow float32 to inf (and the softmax to NaN) without the float64 shift."""
    assert torch.equal(sample_next(ROWS, generator=torch.Generator().manual_seed(1), **options)[:, 0], ROWS.argmax(-1))


@pytest.mark.parametrize("options, message", [
    (dict(temperature=-1.0), "temperature must be a finite number"), (dict(top_p=0.0), "top_p must be in"),
    (dict(temperature=math.nan), "temperature must be a finite number"), (dict(top_k=0), "top_k must be >= 1, got 0"),
    (dict(temperature=math.inf), "temperature must be a finite number")])  # inf: every token alike, silently
def test_impossible_settings_are_refused_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        sample_next(ROWS, **options)
