"""The suite proves it bites: every catalogued bug (tests/mutants.py), put in place of the real
piece, makes one of the suite's own checks fail, saying what kind of bug it is (a LEAK, or a mask that is
not the declared rule), and the real code passes them all. The mask command's report says what broke, and where."""

import functools
import operator
import re
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

import causality as C
import reference
from mutants import LEAK, MUTANTS, attention_mask_after_softmax, put_back_shipped, shipped, shipped_declared, substitute

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask


@pytest.fixture(scope="module")
def real_checks() -> list[C.Check]:
    return list(C.iter_checks())


@pytest.fixture(scope="module")
def unfit() -> Callable[[], C.Check | None]:
    """The first check your code fails with the shipped rule, documents and cache put back (None: none), run once and
    only when a mutant's test needs it: edits of yours that fit your rule alone (a cache of its own) fail there."""
    @functools.cache
    def first_failure() -> C.Check | None:
        with pytest.MonkeyPatch.context() as mp:
            put_back_shipped(mp)
            return next((c for c in C.iter_checks() if not c.ok), None)
    return first_failure


def test_real_code_passes_every_check(real_checks):
    C.require(*real_checks)


def skip_if_unfit(unfit: Callable[[], C.Check | None], ok: bool) -> None:
    """Skip a test of the shipped rule that did not go as it must (not ok) where your code does not fit that rule."""
    if not ok and (check := unfit()):
        pytest.skip(f"the catalogue's bugs are bugs of the shipped rule, documents and cache, and your code fails "
                    f"with those put back: {check}")


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_every_mutant_is_caught_and_named_for_what_it_is(mutant, monkeypatch, real_checks, unfit):
    if not all(c.ok for c in real_checks):
        pytest.skip("the real code fails the checks itself")
    put_back_shipped(monkeypatch, but=mutant.piece)  # a rule changed on purpose may hide a catalogued bug
    substitute(monkeypatch, mutant.piece, mutant.replacement)
    failed = next((c for c in C.iter_checks() if not c.ok), None)
    skip_if_unfit(unfit, failed is not None and mutant.says in str(failed))
    assert failed is not None, f"mutant {mutant.name!r} passed every check"
    assert mutant.says in str(failed), f"mutant {mutant.name!r} was caught as: {failed}"


def test_the_judge_counts_any_change_where_none_is_allowed():
    """Exact: a masked key given a finite fill instead of -inf moves an output by a tiny amount, a leak all the same;
    a NaN is named as such."""
    expected = torch.ones(4, 4, dtype=torch.bool).tril()
    change = expected.double()
    change[0, 3] = 1e-300
    check = C.judge("perturbation", change, expected, "the causal rule")
    assert not check.ok and check.detail == "LEAK: query 0 reads key 3 (3 ahead)", check
    change[2, 1] = float("nan")  # NaN compares false: it must not read as "does not read key 1"
    check = C.judge("perturbation", change, expected, "the causal rule")
    assert not check.ok and check.detail.startswith("NaN: query 2 computes NaN (key 1 changed)"), check


def test_a_failed_test_says_first_that_rows_mix_then_leaks_then_the_rest():
    """Rows that mix look like leaks within a row to the checks that batch their variants: that line leads."""
    checks = [C.Check(name, False, 1.0, 1.0, detail) for name, detail in (
        ("a", "no leak, but not the causal rule: query 2 reads key 0"), ("b", "LEAK: query 0 reads key 1 (1 ahead)"),
        ("c", "LEAK across rows: row 1's logit 0 moves when row 0's tokens change (forward)"))]
    with pytest.raises(pytest.fail.Exception) as report:
        C.require(*checks)
    assert [line.split(" — ")[0] for line in str(report.value).splitlines()] == ["FAIL c", "FAIL b", "FAIL a"]


def test_a_check_whose_required_change_is_missing_names_the_code_not_itself(monkeypatch):
    substitute(monkeypatch, "visible", shipped)  # whatever rule model/attention.py holds
    substitute(monkeypatch, "attention", attention_mask_after_softmax)  # query 0's own weight went to the future
    check = C.check_attention_extreme_scores()
    assert check.detail == "query 0 gives its only allowed key, its own, weight 0, not 1", check


def test_a_catalogued_rule_that_reads_ahead_must_be_named_a_leak():
    """The catalogue's own claims, checked: a broken rule that admits a later key anywhere must say LEAK."""
    cells = [(torch.arange(8)[:, None], torch.arange(8)[None, :]), C.far_positions()]  # near, far out
    for m in (m for m in MUTANTS if m.piece == "visible"):
        ahead = any((m.replacement(q, k, window) & (k > q)).any() for window in (0, 3) for q, k in cells)
        assert (m.says == LEAK) == ahead, f"{m.name!r} reads ahead: {ahead}, but says {m.says!r}"


def test_a_declared_rule_must_give_every_query_a_key_and_none_a_later_one(monkeypatch):
    """The declaration itself is checked (the checks clip it to the past): one that reads ahead, or leaves query 0 no
    key, is refused by name, not by a crash in the checks."""
    put_back_shipped(monkeypatch)
    for edit, says in ((lambda q, k: k <= q + 1, "declared_rule lets query 0 read key 1, a later one: no rule may"),
                       (lambda q, k: k < q, "declared_rule gives query 0 no key: every query must read one")):
        monkeypatch.setattr(reference, "declared_rule", lambda q, k, window=0, same_document=True, e=edit: e(q, k))
        check = C.check_mask(0)
        assert not check.ok and says in check.detail, check
    monkeypatch.setattr(reference, "declared_rule", lambda q, k, window=0, same_document=True: k < 0)  # no key at all
    assert [c.detail for c in C.attention_checks(0) if "raised" in c.detail] == []  # each says what is wrong


def test_the_rolling_cache_holds_what_the_declared_rule_needs(monkeypatch):
    """A rule narrower than the window (chunks of 8) needs no more than the window's last W keys; a sink at key 0 needs
    key 0 kept too, which the shipped cache drops."""
    model = C.leak_test_model("manual", attn_window=3)
    put_back_shipped(monkeypatch)
    for op, extra, says in ((operator.and_, lambda q, k: k // 8 == q // 8, ""),
                            (operator.or_, lambda q, k: k == 0, "holds positions [7, 8, 9], not [0], which")):
        monkeypatch.setattr(reference, "declared_rule", lambda q, k, window=0, same_document=True, op=op, e=extra:
                            op(shipped_declared(q, k, window, same_document), e(q, k)))
        check = C.check_rolling_cache(model, C.test_tokens(model))
        assert check.ok if not says else not check.ok and says in check.detail, check


def mask_report(monkeypatch, failures: list[tuple[str, str]], broken: dict[str, list[str]] | None = None) -> list[str]:
    """The lines the mask command's summary (tests/conftest.py) writes for these failures, in a narrow terminal."""
    import conftest

    monkeypatch.setattr(conftest, "_failures", failures)
    monkeypatch.setattr(conftest, "_unimportable", broken or {})
    monkeypatch.setenv("COLUMNS", "40")
    lines = []
    conftest.pytest_terminal_summary(SimpleNamespace(write_sep=lambda sep, title: lines.append(title),
                                                     write_line=lines.append))
    return lines


def test_the_mask_report_puts_leaks_first_one_whole_line_per_kind_saying_where(monkeypatch):
    """Each failing test's first line, without its figures, grouped by what it says, and where."""
    what = "no leak, but not the causal rule: query 4 does not read key 0, which the rule allows"
    assert mask_report(monkeypatch, [
        ("test_a", f"mask: causal_mask (the causal rule) — {what} | max change where none allowed 0"),
        ("test_b", "model: perturbation (manual) — LEAK: query 0 reads key 1 (1 ahead) | max 0.5"),
        ("test_c", f"model: decoding — {what} | min change where one is required 0"),
        ("test_d", "assert 1 == 2"), ("test_e", "model: decode (sdpa) — LEAK: query 2 reads key 5 (3 ahead) | max 0.1"),
        ("test_f", "assert 3 == 4")]) == [  # another leak's pair stays apart; other numbers do not
        "6 failed (python -m pytest -m mask --tb=short for tracebacks)",
        "LEAK: query 0 reads key 1 (1 ahead)  [model: perturbation (manual)]",
        "LEAK: query 2 reads key 5 (3 ahead)  [model: decode (sdpa)]",
        f"{what}  [mask: causal_mask (the causal rule) and 1 more]",
        "assert 1 == 2  [test_d and 1 more]"]


def test_the_mask_report_shows_where_an_edit_that_does_not_import_broke(monkeypatch):
    """A typo in the edited code stops every test file's import: the error's own lines, once (pytest's hidden)."""
    import conftest

    lines = ["tests/test_a.py:8: in <module>", "    from model.attention import visible",
             'E     File "model/attention.py", line 29', "E       allowed = k_pos <=", "E                        ^",
             "E   SyntaxError: invalid syntax"]
    broken: dict[str, list[str]] = {}
    monkeypatch.setattr(conftest, "_failures", [])
    monkeypatch.setattr(conftest, "_unimportable", broken)
    for nodeid in ("tests/test_a.py", "tests/test_b.py"):
        conftest.pytest_collectreport(SimpleNamespace(failed=True, longrepr="\n".join(lines), nodeid=nodeid))
    want = ['  File "model/attention.py", line 29', "    allowed = k_pos <=", "                     ^",
            "SyntaxError: invalid syntax", "  [importing tests/test_a.py, tests/test_b.py]"]
    assert mask_report(monkeypatch, [], broken) == [
        "the code does not import (2 test files stopped): nothing ran", "\n".join(want)]


def test_an_error_the_code_raises_is_reported_with_its_file_and_line(monkeypatch):
    """By the report (a test that raised) and by a check (run_check's "raised ..."): the code's frame, not a test's."""
    import conftest

    monkeypatch.setattr(conftest, "_failures", failures := [])
    for path in (conftest.ROOT / "model" / "attention.py", conftest.ROOT / "tests" / "causality.py"):
        crash = SimpleNamespace(path=str(path), lineno=29, message="NameError: name 'x' is not defined")
        conftest.pytest_runtest_logreport(SimpleNamespace(failed=True, longrepr=SimpleNamespace(reprcrash=crash),
                                                          nodeid="tests/test_x.py::test_a"))
    bare = SimpleNamespace(path=__file__, lineno=test_real_code_passes_every_check.__code__.co_firstlineno + 1,
                           message="assert False\n +  where False = ...")  # a bare assert in a test: its statement
    regex = SimpleNamespace(path=__file__, lineno=1, message="AssertionError: Regex pattern did not match.\n  "
                            "Expected regex: 'may read no key'\n  Actual message: 'query 3 is empty'")
    for crash, test in ((bare, "test_b"), (regex, "test_c")):
        conftest.pytest_runtest_logreport(SimpleNamespace(failed=True, longrepr=SimpleNamespace(reprcrash=crash),
                                                          nodeid=f"tests/test_x.py::{test}"))
    assert failures == [("test_a", "NameError: name 'x' is not defined (model/attention.py:29)"),
                        ("test_a", "NameError: name 'x' is not defined"),
                        ("test_b", f"C.require(*real_checks) failed (test_mutants.py:{bare.lineno})"),
                        ("test_c", "the error says 'query 3 is empty', where the test expects 'may read no key'")]
    check = C.run_check("mask: empty", lambda: C.attn_lib.causal_mask(0, 1))
    assert re.fullmatch(r"raised ValueError: causal_mask needs .* \(model/attention\.py:\d+\)", check.detail), check


@pytest.mark.parametrize("edit, declared, says", [("dilated", True, None), ("dilated", False, "no leak, but not"),
                                                  ("one key ahead", True, "LEAK")])
def test_a_rule_changed_on_purpose_passes_once_declared_and_a_leak_fails_even_then(edit, declared, says,
                                                                                   monkeypatch, unfit):
    """A rule edited into the shipped one (every other key; or also the next key): every check passes once
    tests/reference.py declares it too, fails as 'not the declared rule' until then, and reading ahead is a LEAK on
    every path even declared."""
    op, extra = {"dilated": (operator.and_, lambda q, k: (q - k) % 2 == 0),
                 "one key ahead": (operator.or_, lambda q, k: k == q + 1)}[edit]
    edited = lambda q, k, window=0, q_doc=None, k_doc=None: op(shipped(q, k, window, q_doc, k_doc), extra(q, k))
    written = lambda q, k, window=0, same_document=True: op(shipped_declared(q, k, window, same_document), extra(q, k))
    put_back_shipped(monkeypatch)
    substitute(monkeypatch, "visible", edited)
    monkeypatch.setattr(reference, "declared_rule", written if declared else shipped_declared)
    checks = list(C.iter_checks())
    failed = [str(c) for c in checks if not c.ok]
    skip_if_unfit(unfit, not failed if says is None else bool(failed) and says in failed[0])
    if says is None:
        return C.require(*checks)  # the mask command's lines for what fails
    assert failed and says in failed[0], "\n".join(failed[:3]) or "every check passed"
    with pytest.raises(pytest.fail.Exception) as report:  # a test's lines: leaks first, whatever the checks' order
        C.require(*reversed(checks))
    assert ("— LEAK" in str(report.value).splitlines()[0]) == (says == "LEAK"), str(report.value)[:300]
    leaks = [line.split(" — ")[0] for line in failed if "— LEAK" in line]  # the mask and one forward too, declared
    assert (says == "LEAK") == any("mask:" in c for c in leaks) == any("perturbation, forward" in c for c in leaks)
