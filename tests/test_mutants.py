"""The suite proves it bites: every catalogued bug (tests/mutants.py), put in place of the real
piece, makes one of the suite's own checks fail, saying what kind of bug it is (a LEAK, or a mask that is
not the declared rule), and the real code passes them all."""

import pytest

import causality as C
from mutants import MUTANTS, substitute

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask


@pytest.fixture(scope="module")
def real_checks() -> list[C.Check]:
    return list(C.iter_checks())


def test_real_code_passes_every_check(real_checks):
    C.require(*real_checks)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_every_mutant_is_caught_and_named_for_what_it_is(mutant, monkeypatch, real_checks):
    if not all(c.ok for c in real_checks):
        pytest.skip("the real code fails the checks itself")
    substitute(monkeypatch, mutant.piece, mutant.replacement)
    failed = next((c for c in C.iter_checks() if not c.ok), None)
    assert failed is not None, f"mutant {mutant.name!r} passed every check"
    assert mutant.says in str(failed), f"mutant {mutant.name!r} was caught as: {failed}"


def test_the_mask_report_puts_leaks_first_one_whole_line_per_kind_saying_where(monkeypatch):
    """What the mask command prints after its failures (tests/conftest.py, from their first lines), even in a narrow
    terminal."""
    import conftest

    what = "no leak, but not the causal rule: query 4 does not read key 0, which the rule allows"
    monkeypatch.setattr(conftest, "_failures", [
        ("test_a", f"mask: causal_mask (the causal rule) — {what} | max change where none allowed 0"),
        ("test_b", "model: perturbation (manual) — LEAK: query 0 reads key 1 (1 ahead) | max 0.5"),
        ("test_c", f"model: decoding — {what} | min change where one is required 0"),
        ("test_d", "assert 1 == 2")])
    monkeypatch.setenv("COLUMNS", "40")
    lines = []
    reporter = type("Reporter", (), {"write_sep": lambda self, sep, title: lines.append(title),
                                     "write_line": lambda self, line: lines.append(line)})()
    conftest.pytest_terminal_summary(reporter)
    assert lines == ["4 failed (python -m pytest -m mask --tb=short for tracebacks)",
                     "LEAK: query 0 reads key 1 (1 ahead)  [model: perturbation (manual)]",
                     f"{what}  [mask: causal_mask (the causal rule) and 1 more]",
                     "assert 1 == 2  [test_d]"]
