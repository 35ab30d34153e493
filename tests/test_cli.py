"""The command lines end to end: train a debug model in a temp dir, then sample from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One debug training run shared by the tests below."""
    tmp = tmp_path_factory.mktemp("run")
    corpus = tmp / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 400, encoding="utf-8")
    out = tmp / "out"
    proc = run("train.py", "configs/debug.toml", f"--dataset={corpus}", f"--out_dir={out}",
               f"--cache_dir={tmp / 'cache'}", "--max_iters=30", "--eval_interval=10")
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_train_writes_checkpoint_summary_config_and_events(trained):
    out, proc = trained
    summary = json.loads((out / "summary.json").read_text())
    for key in ("best_val_loss", "final_val_loss", "steps", "train_seconds", "tokens_per_second", "params"):
        assert key in summary
    assert summary["steps"] == 30 and summary["params"] > 0
    assert 0 < summary["final_val_loss"] < summary["best_val_loss"] + 1
    assert (out / "ckpt.pt").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["max_iters"] == 30 and "torch" in config["run"]
    assert any(p.name.startswith("events.out.tfevents") for p in out.iterdir())
    assert "exact val loss" in proc.stdout and "step 30: train loss" in proc.stdout


def test_sample_continues_the_prompt(trained):
    out, _ = trained
    proc = run("sample.py", f"--out_dir={out}", "--prompt=To be", "--max_new_tokens=40", "--device=cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("To be")
    assert len(proc.stdout.rstrip("\n")) >= len("To be") + 30
    assert "tokens/s" in proc.stderr


def test_sample_is_reproducible_with_a_seed(trained):
    out, _ = trained
    a = run("sample.py", f"--out_dir={out}", "--max_new_tokens=30", "--seed=7", "--device=cpu")
    b = run("sample.py", f"--out_dir={out}", "--max_new_tokens=30", "--seed=7", "--device=cpu")
    assert a.stdout == b.stdout


def test_sample_rejects_prompt_characters_outside_the_vocabulary(trained):
    out, _ = trained
    proc = run("sample.py", f"--out_dir={out}", "--prompt=Zulu", "--device=cpu")
    assert proc.returncode == 1
    assert "'Z'" in proc.stderr and "'l'" in proc.stderr and "'u'" not in proc.stderr


def test_train_help_and_bad_key():
    proc = run("train.py", "--help")
    assert proc.returncode == 0 and "--learning_rate=float" in proc.stdout
    proc = run("train.py", "--n_layers=2")
    assert proc.returncode == 1 and "unknown config key 'n_layers'" in proc.stderr
