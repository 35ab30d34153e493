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
