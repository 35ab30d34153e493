"""No query reads a later key, and every path reads exactly what the declared rule allows (tests/reference.py): the
mask, attention alone, and the model's perturbation, gradient, prefix, cache and dropout checks, for every combination
of the model's options, with and without a window and documents. Every check lives in tests/causality.py, with its
positive control; a failure says LEAK with the (query, key) pair and layer, or how the mask differs from the rule.

On a trained model:  python -m pytest -m mask -k checkpoint --ckpt=out/RUN/ckpt.pt -s  (with "=": pytest reads a bare
path as a test path)
"""

import dataclasses
import itertools
from pathlib import Path

import pytest

import causality as C
from model import GPT, GPTConfig
from mutants import put_back_shipped, rule_window_one_wider, substitute

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask

OPTION_VALUES = {"attn_backend": ["manual", "sdpa"], "attn_window": list(C.WINDOWS), "doc_sep": [None, 0],
                 "pos_emb": ["learned", "rope"], "qk_norm": [False, True]}
# every combination of what shapes the mask (backend, window, documents), each with learned and rotary positions,
# qk_norm on for one of the two: every value of every option meets every value of every other (16 models, not 32)
MASKING = list(itertools.product(*list(OPTION_VALUES.values())[:3]))
COMBINATIONS = [dict(zip(OPTION_VALUES, m + (pos, (i // 2 + (pos == "rope")) % 2 == 1), strict=True))
                for i, m in enumerate(MASKING) for pos in OPTION_VALUES["pos_emb"]]


@pytest.mark.parametrize("window", [*C.WINDOWS, 1])  # 1: each query reads itself alone
def test_the_mask_and_attention_read_exactly_what_the_rule_allows(window):
    """The mask is the rule's grid (drawn on failure); output i moves with q, k, v at j, its weight on j is > 0
    and its gradient reaches j exactly where the rule allows; half precision stays finite and on the rule."""
    C.require(*C.attention_checks(window))


def test_a_masked_key_gets_exactly_zero_weight_however_high_it_scores():
    C.require(C.check_attention_extreme_scores())


def test_the_option_matrix_covers_every_model_option():
    options = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "block_size", "n_layer", "n_head",
                                                                 "n_embd", "dropout", "bias"}
    assert options == set(OPTION_VALUES), f"add {options - set(OPTION_VALUES)} to OPTION_VALUES"
    pairs = {(a, va, b, vb) for a, b in itertools.combinations(OPTION_VALUES, 2) for va in OPTION_VALUES[a]
             for vb in OPTION_VALUES[b]}
    assert {(a, c[a], b, c[b]) for c in COMBINATIONS for a, b in itertools.combinations(OPTION_VALUES, 2)} == pairs


@pytest.mark.parametrize("options", COMBINATIONS, ids=lambda o: "-".join(map(str, o.values())))
def test_every_path_reads_exactly_what_the_rule_allows_for_any_combination_of_options(options):
    """Perturbation through one forward, a chunked prefill and one-token decoding (past block_size where the model
    runs on), gradients, cached against uncached logits and tokens, prefix parity, the rolling cache's contents,
    then the same perturbation in train mode with dropout."""
    model = C.leak_test_model(**options)
    C.require(*C.model_checks(model, C.test_tokens(model)), C.check_dropout_causality(**options))


@pytest.mark.parametrize("options, slide", [
    *(pytest.param(o, s, id=f"{name}-{s}") for name, o in (("learned", {}), ("rope-qk_norm", C.MODERN))
      for s in (1, 3, 10)),
    pytest.param({**C.MODERN, "attn_window": 10, "n_layer": 3}, 1, id="endless-reach-28")])
def test_cached_and_uncached_generation_agree_when_the_window_slides(options, slide):
    """After a prompt of 15 tokens, 40 new ones past block_size 10: a re-prefill every `slide` tokens, cached steps
    in between; an endless model (window 10, three layers, two heads) never slides: it reads 28 tokens back."""
    for backend in ("manual", "sdpa"):
        model = C.leak_test_model(backend, **options)
        tag = ", ".join([backend, *(f"{k}={v}" for k, v in options.items()), f"slide={slide}"])  # which failed
        prompt = C.random_tokens(3, 15, model.config.vocab_size)
        C.require(C.run_check(f"model: KV-cache parity ({tag})", C.check_cache_parity, model, prompt, 40, 4, slide))


def saved(model: GPT, path: Path) -> Path:
    """A checkpoint of model at path, as train.py writes one (13 symbols: a to m)."""
    from training import save_checkpoint

    save_checkpoint(path, {"model": model.state_dict(), "model_config": model.config.to_dict(), "config": {},
                           "vocab": {"chars": [chr(97 + i) for i in range(13)]}, "step": 0})
    return path


def test_the_checks_pass_on_checkpoint_weights(request, tmp_path):
    """With --ckpt PATH: on that trained model. Without: on a checkpoint of a re-drawn model written here."""
    path = request.config.getoption("--ckpt")
    if path is None:
        path = saved(C.leak_test_model("manual").float(), tmp_path / "ckpt.pt")
    checks = C.checkpoint_checks(str(path))
    print(*checks, sep="\n")
    C.require(*checks)


def test_the_checkpoint_command_exits_1_on_a_leak_and_2_on_a_bad_length(tmp_path, capsys, monkeypatch):
    """`python tests/causality.py --ckpt PATH`: a line per check, exit 0; a leaky rule: its FAIL lines, exit 1."""
    model, path = C.leak_test_model("manual").float(), tmp_path / "ckpt.pt"
    saved(model, path)
    fail = lambda out: next((line for line in out if not line.startswith("ok ")), out)  # the FAIL line: what broke
    rc, out = C.main(["--ckpt", str(path)]), capsys.readouterr().out.splitlines()
    assert rc == 0, fail(out)
    assert len(out) == len(C.checkpoint_checks(str(path))) > 0 and all(line.startswith("ok ") for line in out), out
    assert all(any(f"({backend})" in line for line in out) for backend in ("manual", "sdpa")), out
    for T in (1, 99):  # a query needs an earlier key; the model, its block
        assert C.main(["--ckpt", str(path), f"--T={T}"]) == 2
        assert capsys.readouterr().err == f"error: --T={T}: give a length from 2 to block_size=" \
            f"{model.config.block_size}\n"
    saved(endless := C.leak_test_model("manual", **C.MODERN, attn_window=3), far := tmp_path / "endless.pt")
    assert C.main(["--ckpt", str(far), "--T=10000"]) == 2  # past its block, but not for hours
    assert capsys.readouterr().err == f"error: --T=10000: give a length from 2 to 2 x block_size=" \
        f"{2 * endless.config.block_size}\n"
    rc = C.main(["--ckpt", str(far), f"--T={2 * endless.config.block_size}"])  # the end of the range
    assert rc == 0, fail(capsys.readouterr().out.splitlines())
    with pytest.raises(SystemExit, match="2"):
        C.main(["--T=5"])  # without --ckpt it would be ignored
    assert "--T sets the length of a checkpoint's checks: give --ckpt too" in capsys.readouterr().err
    put_back_shipped(monkeypatch)  # a bug of the shipped rule, declared as such: no leak, the window's edge
    substitute(monkeypatch, "visible", rule_window_one_wider)
    assert C.main(["--ckpt", str(far)]) == 1 and "no leak, but not" in capsys.readouterr().out
    monkeypatch.undo()
    substitute(monkeypatch, "visible", lambda q, k, *a, **kw: k <= q + 1)  # every query reads one key ahead
    assert C.main(["--ckpt", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "LEAK" in out and out.count("\n") == len(out.splitlines()), out
