"""The suite proves it bites: every catalogued bug (tests/mutants.py), put in place of the real
piece, makes at least one of the suite's own checks fail, and the real code passes them all."""

from __future__ import annotations

import pytest

import causality as C
from mutants import MUTANTS, substitute

pytestmark = pytest.mark.mask  # in the mask command: python -m pytest -m mask


def test_real_code_passes_every_check():
    C.require(*C.all_checks())


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_every_mutant_is_caught(mutant, monkeypatch):
    substitute(monkeypatch, mutant.piece, mutant.replacement)
    assert any(not c.ok for c in C.iter_checks()), f"mutant {mutant.name!r} passed every check"
