"""The README stays true to the repository: every file it names exists, and every train.py command
line it shows parses into a valid config (so a renamed field or config file fails CI, not a reader)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from training import parse_args

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
PATH_PATTERN = r"\b(?:configs|tests|benchmarks|model|data|training)/[\w./-]+\.(?:py|toml|json|jsonl|md|sh)"
PATHS = sorted(set(re.findall(PATH_PATTERN, README)))
# `python train.py configs/...` lines, up to a comment, a closing backtick or the end of the line
TRAIN_COMMANDS = sorted(set(m.strip() for m in re.findall(r"python train\.py (configs/[^`#\n]*)", README)))


def test_the_readme_names_files_and_commands_at_all():
    assert len(PATHS) > 20 and len(TRAIN_COMMANDS) > 5  # the patterns still match the README's style


@pytest.mark.parametrize("path", PATHS)
def test_every_path_the_readme_names_exists(path):
    assert (ROOT / path).exists(), f"README.md names {path}, which is not in the repository"


@pytest.mark.parametrize("command", TRAIN_COMMANDS)
def test_every_train_command_in_the_readme_parses(command, monkeypatch):
    monkeypatch.chdir(ROOT)  # config paths are relative to the repository root, as in the README
    parse_args(shlex.split(command))  # raises ValueError naming an unknown field, a bad value or file
