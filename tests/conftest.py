"""Shared fixtures (helpers are in tests/tiny.py)."""

from __future__ import annotations

import sys

import pytest
import torch

# Tests are about exactness, not speed: one thread keeps float results reproducible and leaves the other
# core to the subprocesses some tests start.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """Forget what torch.compile traced once a test ends (its caches are per process)."""
    yield
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def pytest_addoption(parser):
    parser.addoption("--ckpt", default=None, help="also run the causality checks on this trained checkpoint")
