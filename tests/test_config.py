"""TOML + command-line configuration: typed, validated, errors that name the key."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from training import TrainConfig, help_text, lr_at, parse_args

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_file_then_overrides_in_order(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('n_layer = 3\nlearning_rate = 1\ndataset = "x.txt"\n')
    cfg, _ = parse_args([str(path), "--n_layer=5", "--dropout", "0.1", "--bias"])
    assert cfg.n_layer == 5 and cfg.dropout == 0.1 and cfg.bias is True
    assert cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)  # TOML int for a float
    assert cfg.dataset == "x.txt"


def test_unknown_config_key_raises(tmp_path):
    with pytest.raises(ValueError, match="unknown config key 'n_layers'"):
        parse_args(["--n_layers=3"])
    path = tmp_path / "c.toml"
    path.write_text("lerning_rate = 0.1\n")
    with pytest.raises(ValueError, match="unknown config key 'lerning_rate'"):
        parse_args([str(path)])


def test_ill_typed_values_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="config key n_layer: 'four' is not a valid int"):
        parse_args(["--n_layer=four"])
    with pytest.raises(ValueError, match="config key bias: 'maybe'"):
        parse_args(["--bias=maybe"])
    path = tmp_path / "c.toml"
    path.write_text('batch_size = "12"\n')
    with pytest.raises(ValueError, match="batch_size must be int"):
        parse_args([str(path)])


@pytest.mark.parametrize(
    "override, match",
    [
        ("--n_embd=100", "n_embd=100 must be divisible by n_head=6"),
        ("--max_iters=0", "max_iters must be > 0"),
        ("--learning_rate=-1", "learning_rate must be > 0"),
        ("--batch_size=-2", "batch_size must be > 0"),
        ("--attn_backend=flash", "attn_backend='flash' is not one of manual, sdpa"),
        ("--dtype=int8", "dtype='int8' is not one of"),
        ("--device=tpu", "device='tpu' is not one of"),
    ],
)
def test_invalid_values_name_the_field(override, match):
    with pytest.raises(ValueError, match=match):
        parse_args([override])


def test_shipped_configs_load_and_match_nanogpt_recipes():
    gpu, _ = parse_args([str(CONFIGS / "shakespeare_char.toml")])
    assert (gpu.n_layer, gpu.n_head, gpu.n_embd, gpu.block_size, gpu.batch_size) == (6, 6, 384, 256, 64)
    assert (gpu.dropout, gpu.learning_rate, gpu.min_lr, gpu.warmup_iters, gpu.max_iters) == (0.2, 1e-3, 1e-4, 100, 5000)
    assert (gpu.beta2, gpu.eval_interval) == (0.99, 250)
    cpu, _ = parse_args([str(CONFIGS / "shakespeare_char_cpu.toml")])
    assert (cpu.n_layer, cpu.n_head, cpu.n_embd, cpu.block_size, cpu.batch_size) == (4, 4, 128, 64, 12)
    assert (cpu.max_iters, cpu.lr_decay_iters, cpu.dropout, cpu.eval_iters) == (2000, 2000, 0.0, 20)
    parse_args([str(CONFIGS / "debug.toml")])


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_trains_on_the_from_scratch_attention(path):
    """The from-scratch attention is what trains: said once, as the field's default, in no file."""
    cfg, _ = parse_args([str(path)])
    assert cfg.attn_backend == "manual"
    assert "attn_backend" not in tomllib.loads(path.read_text())


def test_help_lists_every_field_with_type_and_default():
    text = help_text()
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name}=" in text
        assert f.metadata["help"] in text
    assert "--n_layer=int  (default: 6)" in text
    assert "--attn_backend=manual|sdpa" in text


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    cfg = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_iters=200)
    assert lr_at(0, cfg) == pytest.approx(1 / 11)
    assert lr_at(9, cfg) == pytest.approx(10 / 11)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # halfway down the cosine
    assert lr_at(110, cfg) == lr_at(199, cfg) == 0.1
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_a_decay_that_ends_before_the_warmup_is_refused_unless_the_run_never_leaves_warmup():
    """lr_decay_iters=0 with a warmup used to pass: the lr climbed for warmup_iters steps, then sat at
    min_lr for the rest of the run, never decaying. Refused, naming both fields and the step of the
    jump; a run no longer than its warmup, and a decay ending with the warmup, stay valid."""
    with pytest.raises(ValueError, match=r"lr_decay_iters=0 ends the decay before warmup_iters=10 ends.*"
                                         r"straight to min_lr at step 10.*max_iters=50"):
        TrainConfig(warmup_iters=10, lr_decay_iters=0, max_iters=50)
    cfg = TrainConfig(warmup_iters=10, lr_decay_iters=0, max_iters=10)  # never past the warmup
    assert [lr_at(s, cfg) for s in (0, 9)] == [cfg.learning_rate / 11, cfg.learning_rate * 10 / 11]
    TrainConfig(warmup_iters=10, lr_decay_iters=10, max_iters=50)


def test_wsd_schedule_holds_the_peak_then_decays_linearly_to_min_lr():
    """warmup 10, decay ends at 110, cooldown 0.3: stable from 10 until 110 - 33 = 77, then linear."""
    cfg = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_iters=200,
                      lr_schedule="wsd", cooldown_frac=0.3)
    assert lr_at(9, cfg) == pytest.approx(10 / 11)  # the same warmup as cosine
    assert lr_at(10, cfg) == lr_at(50, cfg) == lr_at(76, cfg) == 1.0
    assert lr_at(77, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(1 - (22 / 33) * 0.9)
    assert lr_at(109, cfg) == pytest.approx(1 - (32 / 33) * 0.9)
    assert lr_at(110, cfg) == lr_at(199, cfg) == 0.1
