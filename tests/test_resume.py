"""--resume continues the same run: on CPU, N/2 steps + resume to N is bit-identical to N steps
(weights, optimizer, RNG states, every logged loss, the TensorBoard curves), and a compiled model
writes the same checkpoint an uncompiled one does."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from test_tensorboard import read_events, sample_texts, values
from tiny_runs import tiny_config

import train
from training import load_checkpoint

N = 8


def config(folder, **overrides):
    # dropout > 0 so training draws from the global RNG (a lost RNG state would change the weights);
    # lr_decay_iters is fixed, so the lr schedule is the same whatever max_iters a run stops at
    return tiny_config(folder, max_iters=N, eval_interval=4, dropout=0.1, always_save_checkpoint=True,
                       lr_decay_iters=N, **overrides)


def wait_for_next_second(out_dir) -> None:
    """TensorBoard reads a run's event files in name order and names start with whole seconds: a
    resume in the same second as the run it continues could sort first. Real resumes never do."""
    stamps = [int(p.name.split(".")[3]) for p in out_dir.glob("events.out.tfevents.*")]
    while int(time.time()) <= max(stamps, default=0):
        time.sleep(0.02)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run of N steps, and one stopped at N/2 then resumed to N."""
    folder = tmp_path_factory.mktemp("resume")
    whole = config(folder, out_dir=str(folder / "whole"))
    split = config(folder, out_dir=str(folder / "split"))
    # verbose (output captured by pytest): a silent run writes no TensorBoard events
    summaries = {"half": train.train(split.replace(max_iters=N // 2))}
    summaries["whole"] = train.train(whole)
    wait_for_next_second(folder / "split")
    summaries["resumed"] = train.train(split.replace(resume=True))
    return whole, split, summaries


def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(runs):
    whole, split, summaries = runs
    a = load_checkpoint(f"{whole.out_dir}/ckpt.pt")
    b = load_checkpoint(f"{split.out_dir}/ckpt.pt")
    assert a["step"] == b["step"] == N and summaries["resumed"]["steps_this_run"] == N // 2
    assert a["model"].keys() == b["model"].keys()
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    for param, state in a["optimizer"]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(tensor, b["optimizer"]["state"][param][key]), (param, key)
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]) and torch.equal(a["rng"]["batch"], b["rng"]["batch"])
    for key in ("best_val_loss", "final_val_loss", "last_val_estimate"):
        assert summaries["whole"][key] == summaries["resumed"][key], key


def test_resumed_summary_lists_every_eval_of_the_run(runs):
    """summary.json's history after a resume holds the evals before the resumed step too (carried in
    the checkpoint), with the same losses as the uninterrupted run's."""
    _, _, summaries = runs
    evals = {name: [(h["step"], h["train_loss"], h["val_loss"]) for h in summaries[name]["history"]]
             for name in ("whole", "resumed")}
    assert [step for step, _, _ in evals["whole"]] == [0, 4, 8]
    assert evals["resumed"] == evals["whole"]


def test_resumed_tensorboard_curves_equal_the_uninterrupted_ones(runs):
    whole, split, _ = runs
    a, b = read_events(whole.out_dir), read_events(split.out_dir)
    for tag in ("train/loss", "val/loss", "train/loss_estimate", "lr", "grad_norm", "val/loss_exact"):
        steps_a = [s for s, _ in values(a, tag)]
        steps_b = [s for s, _ in values(b, tag)]
        assert steps_b == steps_a, tag  # the half run's points from N/2 on are purged, none doubled
        assert [float(v) for _, v in values(b, tag)] == [float(v) for _, v in values(a, tag)], tag
    assert sample_texts(b) == sample_texts(a)
    assert [s for s, _ in values(b, "attention/layer_0")] == [0, N // 2, N]
    # one HParams session: the half run's (written at its last step, N/2) is purged with its points
    assert [s for s, _ in values(b, "_hparams_/session_start_info")] == [N]


def test_the_half_run_alone_differs_without_a_restored_rng(tmp_path):
    """Positive control: resuming with a fresh global RNG (dropout draws) changes the weights, so the
    bit-identity above is evidence that the RNG state is restored, not an accident."""
    whole = config(tmp_path, out_dir=str(tmp_path / "whole"), tensorboard=False, exact_val=False)
    split = whole.replace(out_dir=str(tmp_path / "split"))
    train.train(whole, verbose=False)
    train.train(split.replace(max_iters=N // 2), verbose=False)
    ckpt_path = tmp_path / "split" / "ckpt.pt"
    ckpt = torch.load(ckpt_path, weights_only=True)
    ckpt["rng"]["torch"] = torch.Generator().manual_seed(0).get_state()  # not the state it saved
    torch.save(ckpt, ckpt_path)
    train.train(split.replace(resume=True), verbose=False)
    a = load_checkpoint(tmp_path / "whole" / "ckpt.pt")["model"]
    b = load_checkpoint(ckpt_path)["model"]
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_compiled_run_saves_plain_keys_and_resumes_uncompiled_bit_identically(runs, tmp_path, monkeypatch):
    whole, _, _ = runs
    # The eager backend traces the model with dynamo and wraps it in the same OptimizedModule as
    # inductor does (state_dict keys "_orig_mod.*"), in a second instead of a minute of C++ compiling.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    compiled = whole.replace(out_dir=str(tmp_path / "compiled"), compile="true", tensorboard=False)
    train.train(compiled.replace(max_iters=N // 2), verbose=False)
    ckpt = load_checkpoint(tmp_path / "compiled" / "ckpt.pt")
    reference = load_checkpoint(f"{whole.out_dir}/ckpt.pt")
    assert list(ckpt["model"]) == list(reference["model"])  # no "_orig_mod." prefixes
    from model import GPT

    wrapper = torch.compile(GPT(whole.model_config(len(ckpt["vocab"]["chars"]))))
    assert all(k.startswith("_orig_mod.") for k in wrapper.state_dict())  # what saving `fwd` would give
    train.train(compiled.replace(compile="false", resume=True), verbose=False)
    resumed = load_checkpoint(tmp_path / "compiled" / "ckpt.pt")["model"]
    for name, tensor in reference["model"].items():
        assert torch.equal(tensor, resumed[name]), name


def test_bfloat16_cpu_run_resumes_bit_identically(tmp_path):
    """The dtype dtype=auto picks for the laptop recipe on an AMX CPU: bf16 autocast over float32
    weights. N/2 + resume must again equal N steps exactly (weights and the last estimate)."""
    common = dict(dtype="bfloat16", tensorboard=False, exact_val=False)
    whole = config(tmp_path, out_dir=str(tmp_path / "whole"), **common)
    split = config(tmp_path, out_dir=str(tmp_path / "split"), **common)
    s_whole = train.train(whole, verbose=False)
    train.train(split.replace(max_iters=N // 2), verbose=False)
    s_resumed = train.train(split.replace(resume=True), verbose=False)
    assert s_whole["dtype"] == s_resumed["dtype"] == "bfloat16"
    a, b = load_checkpoint(f"{whole.out_dir}/ckpt.pt"), load_checkpoint(f"{split.out_dir}/ckpt.pt")
    assert a["step"] == b["step"] == N
    for name, tensor in a["model"].items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, b["model"][name]), name
    assert s_whole["last_val_estimate"] == s_resumed["last_val_estimate"]
