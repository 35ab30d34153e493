"""The benchmark scripts' own checks: shipped ablation plans stay runnable as the config changes."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import ablate
import bench
import summarize

ROOT = Path(__file__).resolve().parent.parent

PLANS = sorted((ROOT / "benchmarks" / "plans").glob("*.toml"))


def test_there_are_plans():
    assert PLANS, "benchmarks/plans/*.toml is empty: the README's ablation command has nothing to run"


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_every_shipped_plan_is_a_valid_config(plan):
    # a plan naming a retired option would otherwise fail minutes into its timing runs
    ablate.check_plan(tomllib.loads(plan.read_text()))


@pytest.mark.parametrize("overrides, message", [
    ({"norm": "rmsnorm"}, "unknown config key 'norm'"),
    ({"n_head": 5}, "divisible by n_head=5"),
])
def test_check_plan_names_the_bad_variant(overrides, message):
    plan = {"base": "configs/debug.toml", "budget_seconds": 1.0,
            "variant": [{"name": "fine"}, {"name": "broken", "overrides": overrides}]}
    with pytest.raises(ValueError, match=rf"variant 'broken': .*{message}"):
        ablate.check_plan(plan)


def test_check_plan_needs_a_budget_or_steps():
    plan = {"base": "configs/debug.toml", "variant": [{"name": "no budget"}]}
    with pytest.raises(ValueError, match="no steps and the plan no budget_seconds"):
        ablate.check_plan(plan)
    ablate.check_plan({**plan, "variant": [{"name": "fixed", "steps": 10}]})


def test_summarize_pools_seeds_and_compares_with_the_baseline():
    row = dict(steps=10, ms_per_step_timing_run=1.0, train_seconds=1.0, wall_seconds=2.0, tokens_per_second=5.0)
    rows = [{"name": "a", "final_val_loss": 2.0, **row}, {"name": "a", "final_val_loss": 2.2, **row},
            {"name": "b", "final_val_loss": 1.9, **row}]
    lines = summarize.table(rows).splitlines()
    assert lines[2].startswith("| a | 2.0000, 2.2000 | 2.1000 | +0.0000 |")
    assert lines[3].startswith("| b | 1.9000 | 1.9000 | -0.2000 |")
    assert "| a | 2.0000, 2.2000 | 2.1000 | +0.2000 |" in summarize.table(rows, baseline="b")


@pytest.mark.parametrize("script", ["ablate.py", "summarize.py"])
def test_help_exits_zero(script):
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout.lower() or "python benchmarks/" in proc.stdout


@pytest.mark.parametrize("steps", [0, -5, 2.5])
def test_check_plan_refuses_a_step_count_that_is_not_a_positive_integer(steps):
    plan = {"base": "configs/debug.toml", "budget_seconds": 1.0, "variant": [{"name": "odd", "steps": steps}]}
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        ablate.check_plan(plan)


def test_summarize_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    """`summarize.py rows.jsonl | head -c 20`: a table longer than the pipe's buffer meets a closed
    pipe; that ends the script without a traceback."""
    row = {"steps": 1, "ms_per_step_timing_run": 1.0, "train_seconds": 1.0, "wall_seconds": 1.0,
           "tokens_per_second": 1.0, "final_val_loss": 1.0}
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({**row, "name": f"variant-{i}"}) + "\n" for i in range(3000)))
    proc = subprocess.Popen([sys.executable, "benchmarks/summarize.py", str(rows)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = proc.stdout.read(20)
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert len(head) == 20
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert proc.returncode == 1


def test_bench_leaves_the_configs_own_out_dir_alone(tmp_path, capsys):
    """bench.py on a config whose out_dir holds a trained run: the benchmark trains elsewhere (a
    temporary directory), so the run's checkpoint survives; --out_dir still chooses a directory."""
    from tiny_runs import tiny_config

    cfg = tiny_config(tmp_path, max_iters=2, eval_interval=1)
    real = tmp_path / "out"
    real.mkdir()
    (real / "ckpt.pt").write_bytes(b"a trained model")
    toml = tmp_path / "tiny.toml"
    toml.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in cfg.to_dict().items()))
    assert bench.main([str(toml)]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 2
    assert sorted(p.name for p in real.iterdir()) == ["ckpt.pt"]
    assert (real / "ckpt.pt").read_bytes() == b"a trained model"
    assert bench.main([str(toml), f"--out_dir={tmp_path / 'chosen'}"]) == 0
    assert (tmp_path / "chosen" / "summary.json").exists()


def test_ablate_refuses_unknown_variant_names_and_non_integer_seeds():
    plan = str(PLANS[0])
    with pytest.raises(SystemExit, match=r"--only names \['nosuch'\], not variants of .*; it has: \["):
        ablate.main([plan, "--dataset=x", "--only=nosuch"])
    with pytest.raises(SystemExit, match="--seeds='1,a' is not a comma-separated list of integers"):
        ablate.main([plan, "--dataset=x", "--seeds=1,a"])


@pytest.mark.parametrize("content, message", [(None, "No such file"), ("not json\n", "Expecting value")])
def test_summarize_names_a_missing_or_malformed_file(tmp_path, capsys, content, message):
    path = tmp_path / "rows.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit):
        summarize.main([str(path)])
    err = capsys.readouterr().err
    assert f"error: {path}: " in err and message in err and "Traceback" not in err


def test_nanogpt_exact_val_refuses_a_checkpoint_that_is_not_nanogpts(tmp_path):
    import torch

    import nanogpt_exact_val

    ours = tmp_path / "ckpt.pt"
    torch.save({"model": {}, "model_config": {}}, ours)
    with pytest.raises(SystemExit, match="is not a nanoGPT checkpoint"):
        nanogpt_exact_val.main([str(ours), "--dataset=x"])
    with pytest.raises(SystemExit, match="cannot read"):
        nanogpt_exact_val.main([str(tmp_path / "missing.pt"), "--dataset=x"])


def test_vs_nanogpt_checks_the_checkout_before_running_anything(tmp_path, capsys):
    import vs_nanogpt

    with pytest.raises(SystemExit):
        vs_nanogpt.main([f"--nanogpt={tmp_path}", "--dataset=x"])
    assert "no nanoGPT train.py there" in capsys.readouterr().err


def test_causality_script_names_a_missing_checkpoint_in_one_line(tmp_path, capsys):
    import causality

    assert causality.main(["--ckpt", str(tmp_path / "missing.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing.pt" in err and "Traceback" not in err
