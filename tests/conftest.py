"""Shared fixtures: small corpora written to temp dirs (tests never download or read ../shared)."""

from __future__ import annotations

import sys

import pytest
import torch

# Tests are about exactness, not speed: one thread keeps float results reproducible and avoids
# oversubscribing the 2-core CI machine when pytest runs subprocesses.
torch.set_num_threads(1)

PANGRAMS = (
    "The quick brown fox jumps over the lazy dog.\n"
    "Pack my box with five dozen liquor jugs!\n"
    "How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow?\n"
)


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """Forget what torch.compile traced once a test ends. Its caches are per process and keyed on the
    code, so a later test compiling GPT.forward at another batch size would otherwise get a
    dynamic-shape recompile instead of the fresh compile it means to test."""
    yield
    if "torch._dynamo" in sys.modules:  # never imported by tests that do not compile: no cost there
        sys.modules["torch._dynamo"].reset()


@pytest.fixture
def corpus_file(tmp_path):
    """A 20 KB UTF-8 text file: enough for a debug model's train and val splits."""
    path = tmp_path / "corpus.txt"
    path.write_text(PANGRAMS * 120, encoding="utf-8")
    return path


def pytest_addoption(parser):
    parser.addoption("--ckpt", default=None,
                     help="run tests/test_leakage.py's checkpoint checks on this trained checkpoint")
