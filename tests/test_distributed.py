"""A real torchrun run (2 ranks, gloo) against one process replaying its ranks' batches; the rank helpers alone."""

import itertools
import math
import os
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import train
from data import get_batch
from tiny import ROOT, cli_args, tiny_config
from training import CKPT_NAME, load_checkpoint, model_from_checkpoint
from training.distributed import Dist, init_distributed
from training.faults import RunGuard

TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
# 4: two micro-batches per rank, so the gradients are all-reduced once, after both; float32: the replay is compared
# to rounding
QUIET = dict(gradient_accumulation_steps=4, dtype="float32", tensorboard=False, exact_val=False,
             always_save_checkpoint=True)
gap = lambda a, b: max((a["model"][k] - w).abs().max().item() for k, w in b["model"].items())  # checkpoints' weights
val_losses = lambda history: [h["val_loss"] for h in history]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """torchrun --nproc_per_node=2: (the config, its stdout, the checkpoint rank 0 saved)."""
    cfg = tiny_config(tmp_path_factory.mktemp("ddp"), **QUIET)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "train.py", *cli_args(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path_factory.mktemp("tmp"))})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cfg, proc.stdout, load_checkpoint(os.path.join(cfg.out_dir, CKPT_NAME))


def one_process(tmp_path, monkeypatch, name: str, streams: list[torch.Generator] | None):
    """train.train in this process; streams: micro-batch k is drawn from streams[k % len(streams)]."""
    if streams:
        calls = itertools.count()
        monkeypatch.setattr(train, "get_batch", lambda data, B, T, _gen, device:
                            get_batch(data, B, T, streams[next(calls) % len(streams)], device))
    summary = train.train(tiny_config(tmp_path, out_dir=str(tmp_path / name), **QUIET), verbose=False)
    return summary, load_checkpoint(tmp_path / name / CKPT_NAME)


def test_two_ranks_end_with_the_weights_of_one_process_replaying_both_ranks_batches(two_ranks, tmp_path, monkeypatch):
    """Rank 0's micro-batch (seed) then rank 1's (seed + 1), twice per step: the same losses and weights; one
    stream: far off."""
    cfg, _, ddp = two_ranks
    streams = [torch.Generator().manual_seed(cfg.seed + rank) for rank in range(2)]
    summary, replayed = one_process(tmp_path, monkeypatch, "replay", streams)
    assert [h["step"] for h in ddp["history"]] == [0, 3, 6] and ddp["step"] == cfg.max_iters
    assert val_losses(summary["history"]) == pytest.approx(val_losses(ddp["history"]), abs=1e-6)
    assert gap(replayed, ddp) < 1e-5
    assert torch.equal(ddp["rng"]["batch"], streams[0].get_state())  # the checkpoint holds rank 0's stream
    monkeypatch.undo()
    assert gap(one_process(tmp_path, monkeypatch, "alone", None)[1], ddp) > 1e-3
    assert not torch.distributed.is_initialized()  # a plain run never creates a process group


def test_only_rank_zero_logs_and_writes_a_checkpoint_of_the_unwrapped_model(two_ranks):
    cfg, stdout, ckpt = two_ranks
    assert sorted(os.listdir(cfg.out_dir)) == ["ckpt.pt", "config.json", "summary.json"]
    assert stdout.count("| 2 processes") == 1 and stdout.count("checkpoint: ") == 1
    assert [stdout.count(f"step {s}: train loss") for s in (0, 3, 6)] == [1, 1, 1]
    model_from_checkpoint(ckpt)  # strict load_state_dict: every key is the plain GPT's (no module., _orig_mod.)


def test_a_two_rank_checkpoint_resumes_in_one_process(two_ranks, tmp_path):
    cfg, _, ckpt = two_ranks
    shutil.copytree(cfg.out_dir, tmp_path / "out")
    summary = train.train(tiny_config(tmp_path, **QUIET, resume=True, max_iters=cfg.max_iters + 2), verbose=False)
    assert (summary["steps"], summary["steps_this_run"], summary["world_size"]) == (cfg.max_iters + 2, 2, 1)
    # the first evaluation is of the weights saved by the two ranks, on the same eval windows
    assert [h["step"] for h in summary["history"]] == [0, 3, 6, 8]
    assert val_losses(summary["history"][:3]) == pytest.approx(val_losses(ckpt["history"]), abs=1e-6)
    assert load_checkpoint(tmp_path / "out" / CKPT_NAME)["step"] == cfg.max_iters + 2


def test_under_torchrun_a_bad_command_line_is_said_once_per_node(monkeypatch, capsys):
    for local_rank, says in (("1", False), ("0", True)):  # by LOCAL_RANK 0 only
        monkeypatch.setattr(os, "environ", {**os.environ, **TORCHRUN, "LOCAL_RANK": local_rank})
        assert train.main(["--max_iter=3"]) == 1 and ("unknown config key" in capsys.readouterr().err) == says


@pytest.mark.parametrize("world, accum, suggestion", [(2, 3, 4), (4, 6, 8), (3, 1, 3)])
def test_an_accumulation_count_the_ranks_cannot_share_is_refused_with_the_next_multiple(world, accum, suggestion):
    assert Dist(world_size=world).micro_steps(world * accum) == accum
    with pytest.raises(ValueError, match=rf"gradient_accumulation_steps={accum} cannot be split across {world} "
                                         rf"processes.*--gradient_accumulation_steps={suggestion}$"):
        Dist(world_size=world).micro_steps(accum)


def test_each_rank_and_restart_step_gets_its_own_seed_and_a_resumed_rank_draws_from_it(run_dir, monkeypatch):
    assert Dist().seed(100) == Dist(world_size=4).seed(100, step=0) == 100
    seeds = [Dist(rank=r, world_size=4).seed(100, s) for r, s in itertools.product(range(4), range(50))]
    assert len(set(seeds)) == len(seeds)
    cfg, drawn = run_dir[0].replace(gradient_accumulation_steps=2), []
    monkeypatch.setattr(train, "init_distributed", lambda env, device: Dist(rank=1, world_size=2))
    monkeypatch.setattr(train, "get_batch", lambda data, B, T, gen, device, real=train.get_batch:
                        drawn.append(gen.initial_seed()) or real(data, B, T, gen, device))
    train.train(cfg, verbose=False)
    assert drawn and set(drawn) == {cfg.seed + 1 + 2 * 4}  # rank 1 of 2 at step 4: a checkpoint holds rank 0's RNG
    assert torch.initial_seed() == cfg.seed + 1 + 2 * 4  # and its dropout's


def test_only_rank_zero_hands_its_run_to_the_cpu_speed_record(run_dir, monkeypatch):
    """compile='auto' reads one record per machine and shape: rank 0's run goes to it, another rank's never."""
    given = []
    monkeypatch.setattr(train.runtime, "record_speed", lambda cfg, summary: given.append(summary["steps_this_run"]))
    for rank in (1, 0):  # rank 1 writes no checkpoint: rank 0 resumes from the same step
        monkeypatch.setattr(train, "init_distributed", lambda env, device, rank=rank: Dist(rank=rank, world_size=2))
        train.train(run_dir[0].replace(gradient_accumulation_steps=2), verbose=False)
    assert given == [2]  # rank 0's 2 steps (record_speed itself keeps runs of 20 steps and more)


def test_a_run_leaves_no_process_group_behind_however_it_ends(run_dir, monkeypatch, tmp_path):
    """A group of one (gloo) stands in for torchrun's: a finished run and one refused in set-up destroy it (NCCL
    warns at exit otherwise, and a second run in the process could not join one)."""
    stores = itertools.count()
    monkeypatch.setattr(train, "init_distributed", lambda env, device: torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store{next(stores)}", rank=0, world_size=1) or Dist(enabled=True))
    train.train(run_dir[0], verbose=False)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="seed: checkpoint 1337 vs config 1338"):
        train.train(run_dir[0].replace(seed=1338), verbose=False)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("device, message", [("cuda:1", "under torchrun each process uses cuda:LOCAL_RANK"),
                                             ("mps", "device='mps' cannot run distributed"),
                                             ("cuda", "LOCAL_RANK=1 but this machine has 1 CUDA devices")])
def test_torchrun_refuses_a_cuda_index_mps_or_more_ranks_than_gpus_before_a_process_group(monkeypatch, device, message):
    """A plain run is fine (resolve_device, device_count stand in for a one-GPU machine); under torchrun not."""
    monkeypatch.setattr("training.distributed.resolve_device", lambda name: torch.device(name))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # LOCAL_RANK 1 needs a second GPU
    for partial in ({k: v for k, v in TORCHRUN.items() if k != name} for name in TORCHRUN):  # torchrun sets all 3
        assert init_distributed(partial, device) == Dist(device=torch.device(device)), partial
    with pytest.raises(ValueError, match=message):
        init_distributed(TORCHRUN, device)
    assert not torch.distributed.is_initialized()
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kwargs: None)  # rank 3 of 4, on node 2
    assert init_distributed({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, "cpu") == Dist(
        rank=3, world_size=4, device=torch.device("cpu"), enabled=True)


def agree(rank: int, store: str, out) -> None:
    """Rank `rank` of 2 (gloo): check_step's verdicts, unsynced then synced, for a SIGTERM to rank 0 only, a NaN at
    step 4 on rank 1 only, and NaNs at step 7 on rank 0 and step 4 on rank 1."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    run = SimpleNamespace(dist=Dist(rank=rank, world_size=2, enabled=True), guard=RunGuard("ckpt.pt", True, False),
                          bad_loss=torch.tensor(math.nan), saved=None)
    said, ok = [], train.NO_STEP
    cases = [(signal.SIGTERM, ok), (None, ok), (None, 7)] if rank == 0 else [(None, ok), (None, 4), (None, 4)]
    for signum, bad in cases:  # (the signal, the first bad step) on this rank
        run.guard.signum, run.first_bad = signum, torch.tensor(bad)
        for sync in (False, True):
            try:
                said.append(train.check_step(run, sync))
            except FloatingPointError as e:
                said.append(str(e).split(";")[0])
    out.put((rank, said))
    torch.distributed.destroy_process_group()


def test_the_ranks_agree_to_stop_for_a_signal_or_a_non_finite_loss_that_one_of_them_met(tmp_path):
    """At log steps only (no sync between them), every rank stops for either, the first bad step named by all."""
    out = torch.multiprocessing.get_context("spawn").SimpleQueue()
    torch.multiprocessing.spawn(agree, (str(tmp_path / "store"), out), nprocs=2)
    said = dict(out.get() for _ in range(2))
    for rank, nan in ((0, "loss is not finite (on another rank) at step 4"), (1, "loss is nan at step 4")):
        assert said[rank] == [None, signal.SIGTERM, None, nan, None, nan], rank
