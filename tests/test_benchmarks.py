"""Smoke tests of the benchmark scripts: each starts, runs a tiny case, and reports what it measured."""

import json
import re
import tempfile

import numpy as np
import pytest
import torch

import ablate
import bench
import kv_cache
import nanogpt_exact_val
import profile_step
import summarize
import vs_nanogpt
from data import load_corpus
from model import GPT, GPTConfig
from tiny import cli_args, tiny_config
from training import exact_loss


@pytest.mark.parametrize("script", [ablate, bench, kv_cache, nanogpt_exact_val, profile_step, summarize, vs_nanogpt])
def test_every_benchmark_script_explains_itself(script, capsys):
    try:
        assert script.main(["--help"]) == 0
    except SystemExit as e:  # argparse's --help
        assert e.code == 0
    assert len(capsys.readouterr().out) > 100


def test_bench_trains_a_config_and_reports_its_figures(tmp_path, capsys):
    cfg, out = tiny_config(tmp_path), tmp_path / "bench.json"
    assert bench.main([f"--dataset={cfg.dataset}", "--device=cpu", "--n_layer=1", "--n_embd=16", "--n_head=2",
                       "--block_size=16", "--batch_size=4", "--max_iters=4", "--eval_interval=2", "--eval_iters=1",
                       "--target_val=100", f"--json={out}"]) == 0
    assert (figures := json.loads(out.read_text()))["ms_per_step_median"] > 0 and figures["final_val_loss"] > 0
    assert figures["time_to_target"]["step"] == 0 and [h["step"] for h in figures["history"]] == [0, 2, 4]  # at once
    assert figures["best_val_loss"] == min(h["val_loss"] for h in figures["history"])
    assert 0.01 < figures["ms_per_step_mean"] / figures["ms_per_step_median"] < 100  # both in ms, not 1000x apart
    # (one of four steps stalled by a busy machine moved the mean 14x once)
    assert not (tmp_path / "out").exists()  # it trained in a temporary directory


def test_nanogpt_exact_val_scores_a_nanogpt_checkpoint_as_our_exact_loss_scores_its_weights(tmp_path, capsys):
    corpus, shape = load_corpus(tiny_config(tmp_path).dataset), dict(block_size=16, n_layer=2, n_head=2, n_embd=16)
    model = GPT(GPTConfig(vocab_size=corpus.tokenizer.vocab_size, **shape)).eval()
    theirs = {v: k for k, v in nanogpt_exact_val.TOP.items()} | {
        f"blocks.{i}.{v}": f"transformer.h.{i}.{k}" for i in range(2) for k, v in nanogpt_exact_val.BLOCK.items()}
    torch.save({"model": {theirs[k]: v for k, v in model.state_dict().items()}, "model_args": {
        "vocab_size": corpus.tokenizer.vocab_size, "bias": False, **shape}}, tmp_path / "ckpt.pt")
    assert nanogpt_exact_val.main([str(tmp_path / "ckpt.pt"), f"--dataset={tmp_path / 'corpus.txt'}"]) == 0
    ours = exact_loss(model, torch.from_numpy(corpus.val.astype(np.int64)), 16, 64, "cpu")
    assert json.loads(capsys.readouterr().out)["exact_val_loss"] == pytest.approx(ours, abs=1e-5)


def test_profile_step_splits_a_step_into_kinds_of_operator(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its run folder is removed afterwards
    assert profile_step.main([*cli_args(tiny_config(tmp_path)), "--steps=4"]) == 0
    assert not list(tmp_path.glob("profile_step-*"))
    out = capsys.readouterr().out
    assert "ms a step by the clock" in out and "matmuls" in out and "Python, dispatch, autograd engine" in out
    clock, ops = map(float, re.search(r"([\d.]+) ms a step by the clock .*, operators ([\d.]+) ms", out).groups())
    assert 0 < ops <= clock  # a step's share of the operators' time, within its own


def test_kv_cache_benchmark_finds_identical_tokens(capsys):
    figures = kv_cache.run(new_tokens=20, repeats=1, n_layer=1, n_head=2, n_embd=16, block_size=16)
    assert figures["identical_tokens"] and figures["cached_tokens_per_second"] > 0
    rates = figures["cached_tokens_per_second"], figures["uncached_tokens_per_second"]
    assert figures["speedup"] == pytest.approx(rates[0] / rates[1])
    rolling = kv_cache.rolling(window=4, n_layer=1, n_head=2, n_embd=16, block_size=16)
    assert rolling["identical_tokens_4_blocks"] and [s["blocks"] for s in rolling["stretches"]] == [1, 4, 16]
    assert len({s["cache_bytes"] for s in rolling["stretches"]}) == 1  # the same memory at 1, 4 and 16 blocks
    assert all(s["peak_rss_mb"] > 50 for s in rolling["stretches"])  # MB of a process with torch loaded


def test_summarize_turns_ablation_rows_into_a_table(tmp_path, capsys):
    rows = [dict(name=v, seed=s, final_val_loss=1.9 + 0.1 * i + 0.01 * s, steps=100, ms_per_step_timing_run=10.0,
                 train_seconds=1.0, wall_seconds=2.0, tokens_per_second=1000.0)
            for i, v in enumerate(["base", "rope"]) for s in (1, 2)]
    (path := tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert summarize.main([str(path)]) == 0
    assert "| rope |" in (table := capsys.readouterr().out) and "+0.1000" in table
    assert summarize.main([str(path), "--baseline=rope"]) == 0
    assert "-0.1000" in capsys.readouterr().out  # base against rope
