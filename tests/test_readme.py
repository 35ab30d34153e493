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


def _train_commands(text: str) -> list[str]:
    """The arguments of every `train.py configs/...` command (python or torchrun): in code blocks up
    to a comment or the line's end, in inline code up to the closing backtick (across a line break)."""
    found = set()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    for line in (line for block in blocks for line in block.splitlines()):
        found.update(m.strip() for m in re.findall(r"train\.py (configs/[^#]*)", line))
    for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.S)):
        found.update(" ".join(m.split()) for m in re.findall(r"train\.py (configs/.*)", span, re.S))
    return sorted(found)


TRAIN_COMMANDS = _train_commands(README)


def test_the_readme_names_files_and_commands_at_all():
    assert len(PATHS) > 20 and len(TRAIN_COMMANDS) > 5  # the patterns still match the README's style
    assert any(c.endswith("--gradient_accumulation_steps=2") for c in TRAIN_COMMANDS)  # torchrun lines too


@pytest.mark.parametrize("path", PATHS)
def test_every_path_the_readme_names_exists(path):
    assert (ROOT / path).exists(), f"README.md names {path}, which is not in the repository"


@pytest.mark.parametrize("command", TRAIN_COMMANDS)
def test_every_train_command_in_the_readme_parses(command, monkeypatch):
    monkeypatch.chdir(ROOT)  # config paths are relative to the repository root, as in the README
    parse_args(shlex.split(command))  # raises ValueError naming an unknown field, a bad value or file
