"""Checkpoints and --resume, through train.train and train.main: a run stopped at step K and resumed ends
bit-identical to one that never stopped; a checkpoint holds tensors and plain data only, read with weights_only=True;
one that cannot be continued is refused before out_dir is touched; every write is atomic and leaves no temporary."""

import ast
import errno
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

import train
from model import GPT, GPTConfig
from tiny import ARCHITECTURE, ROOT, TEXT, cli_args, ctrl_c_in_batch, tiny_config
from training import CKPT_NAME, TrainConfig, load_checkpoint, model_from_checkpoint, save_checkpoint
from training.checkpoint import FORMAT, prepare_run_folder, run_folder, write_atomic, write_json

N, K = 8, 4  # an uninterrupted run of N steps; its twin stops at K and resumes to N


def config(folder: Path, name: str, **overrides) -> TrainConfig:
    # dropout > 0: training draws from the global RNG, so a resume that lost its state would change the
    # weights; lr_decay_iters is fixed, so the schedule does not depend on the max_iters a run stops at
    fields = dict(max_iters=N, eval_interval=K, dropout=0.1, lr_decay_iters=N, always_save_checkpoint=True)
    return tiny_config(folder, out_dir=str(folder / name), **{**fields, **overrides})


def assert_same(a, b, where: str = "") -> None:
    """a and b hold equal tensors (bit for bit) and equal plain values, at every nesting level."""
    if isinstance(a, dict | list | tuple):
        a, b = (x if isinstance(x, dict) else dict(enumerate(x)) for x in (a, b))
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    else:
        assert (a.dtype == b.dtype and torch.equal(a, b)) if isinstance(a, torch.Tensor) else a == b, where


@pytest.fixture(scope="module", params=["adamw", "muon"])
def pair(request, tmp_path_factory):
    """(folder, whole's summary, resumed's): `whole` trains N steps; `split` trains K, is copied to `stopped`, and
    resumes to N. (A compiled first half, even traced by dynamo's eager backend, costs ~2 s on a CPU: left out.)"""
    folder = tmp_path_factory.mktemp(request.param)
    split = config(folder, "split", optimizer=request.param)
    whole = train.train(config(folder, "whole", optimizer=request.param), verbose=False)
    train.train(split.replace(max_iters=K), verbose=False)
    shutil.copytree(folder / "split", folder / "stopped")
    return folder, whole, train.train(split.replace(resume=True), verbose=False)


def test_a_run_stopped_at_step_k_and_resumed_ends_bit_identical_to_an_uninterrupted_one(pair, tmp_path):
    """The twins match bit for bit; the control: another RNG state at the resume (dropout draws from it) does not."""
    folder, whole, resumed = pair
    a, b = load_checkpoint(folder / "whole" / CKPT_NAME), load_checkpoint(folder / "split" / CKPT_NAME)
    assert a["step"] == b["step"] == N
    assert resumed["steps_this_run"] == N - K  # it continued from K: it did not start over
    for key in ("model", "optimizers", "rng", "best_val_loss"):
        assert_same(a[key], b[key], key)
    curves = [[(h["step"], h["train_loss"], h["val_loss"]) for h in r["history"]] for r in (a, b, resumed)]  # no clocks
    assert [s for s, _, _ in curves[0]] == [0, K, N] and curves[0] == curves[1] == curves[2]
    assert whole["final_val_loss"] == resumed["final_val_loss"]
    out = shutil.copytree(folder / "stopped", tmp_path / "split")
    ckpt = load_checkpoint(out / CKPT_NAME)
    ckpt["rng"]["torch"] = torch.Generator().manual_seed(0).get_state()
    save_checkpoint(out / CKPT_NAME, ckpt)
    train.train(TrainConfig(**{**ckpt["config"], "out_dir": str(out), "max_iters": N, "resume": True}), verbose=False)
    other = load_checkpoint(out / CKPT_NAME)["model"]
    assert any(not torch.equal(a["model"][k], other[k]) for k in other), "the control: another RNG state, same weights"


def test_a_resumed_run_keeps_the_dtype_auto_chose_at_its_start(tmp_path, monkeypatch):
    """bfloat16 at the start, float32 by the probe at the resume: the run stays bfloat16 (float32 forced does not)."""
    monkeypatch.setattr("training.runtime.bf16_pays", lambda *a, **k: (True, "bf16 pays"))
    whole, split = train.train(config(tmp_path, "whole"), verbose=False), config(tmp_path, "split")
    train.train(split.replace(max_iters=K), verbose=False)
    shutil.copytree(tmp_path / "split", tmp_path / "forced")
    monkeypatch.setattr("training.runtime.bf16_pays", lambda *a, **k: (False, "bf16 does not pay"))
    resumed = train.train(split.replace(resume=True), verbose=False)
    forced = train.train(split.replace(resume=True, dtype="float32", out_dir=str(tmp_path / "forced")), verbose=False)
    assert whole["dtype"] == resumed["dtype"] == "bfloat16" and forced["dtype"] == "float32"
    a, b, c = (load_checkpoint(tmp_path / name / CKPT_NAME)["model"] for name in ("whole", "split", "forced"))
    assert all(torch.equal(a[k], b[k]) for k in a) and any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("always", [False, True])
def test_a_worse_estimate_never_replaces_the_best_checkpoint_even_across_a_resume(tmp_path, monkeypatch, capsys,
                                                                                  always):
    """Val estimates 2.0, 1.0 | 1.001, 0.5, 0.5, 0.7 (train: 3 minus those) at steps 0, 2 | 4, 6, 8, 10, Ctrl-C
    (saving step 3) at |: the best is 1.0 over it, then 0.5 (a near miss or a tie is no improvement), also when
    always_save_checkpoint saves at every eval (the best val is the best, not the last). The last line says which step
    the checkpoint holds when it is not the last."""
    values, saves, real_save = iter([2.0, 1.0, 1.001, 0.5, 0.5, 0.7]), [], train.checkpoint.save_checkpoint
    monkeypatch.setattr(train, "estimate_loss", lambda *a, **k: {"val": (v := next(values)), "train": 3 - v})
    monkeypatch.setattr(train.checkpoint, "save_checkpoint", lambda path, state: saves.append(state["step"]) or
                        real_save(path, state))
    cfg = tiny_config(tmp_path, max_iters=10, eval_interval=2, lr_decay_iters=10, always_save_checkpoint=always)
    assert ctrl_c_in_batch(3, cfg, verbose=False)["interrupted"] == "SIGINT"  # the 3rd batch: step 2's
    summary, path = train.train(cfg.replace(resume=True, tensorboard=False)), Path(cfg.out_dir) / CKPT_NAME
    assert saves == ([2, 3, 4, 6, 8, 10] if always else [2, 3, 6]), f"checkpoints written at steps {saves}"
    older = "" if always else (" (step 6, where the val estimate was best; the last step's weights were not saved: "
                               "--always_save_checkpoint keeps them)")
    assert capsys.readouterr().out.splitlines()[-1] == f"checkpoint: {path}{older}; sample it: python sample.py " \
        f"--out_dir={cfg.out_dir}"
    assert summary["best_val_loss"] == load_checkpoint(path)["best_val_loss"] == 0.5


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_run_whose_estimates_only_get_worse_saves_nothing_and_says_so(tmp_path, monkeypatch, capsys, overwrite):
    """Step 0's estimate (the init's weights, never saved) is the one to beat: a run that never beats it writes no
    checkpoint, and its last line says so and how to keep one; a replaced run's checkpoint (--overwrite) is gone."""
    values = iter([1.0, 2.0, 3.0])
    monkeypatch.setattr(train, "estimate_loss", lambda *a, **k: {"val": next(values), "train": 1.0})
    cfg = tiny_config(tmp_path, max_iters=4, eval_interval=2, tensorboard=False, exact_val=False, overwrite=overwrite)
    if overwrite:
        Path(cfg.out_dir).mkdir()
        (Path(cfg.out_dir) / CKPT_NAME).write_bytes(b"the replaced run's")
    assert train.train(cfg)["checkpoint_step"] is None
    assert not (Path(cfg.out_dir) / CKPT_NAME).exists()  # sample.py and --resume would take it for this run's
    assert capsys.readouterr().out.splitlines()[-1] == ("no checkpoint was saved: the val estimate never improved on "
                                                        "step 0's (--always_save_checkpoint saves at every eval)")


def test_resume_trains_on_with_the_dropout_given_on_its_command_line(tmp_path):
    """--resume --dropout=0.5 after a run at 0.0 trains at 0.5: its checkpoint says so, its weights differ."""
    cfg = config(tmp_path, "run", dropout=0.0, max_iters=K)
    train.train(cfg, verbose=False)
    shutil.copytree(tmp_path / "run", tmp_path / "same")
    train.train(cfg.replace(resume=True, max_iters=N, dropout=0.5), verbose=False)
    train.train(cfg.replace(resume=True, max_iters=N, out_dir=str(tmp_path / "same")), verbose=False)
    a, b = (load_checkpoint(tmp_path / name / CKPT_NAME) for name in ("run", "same"))
    assert a["model_config"]["dropout"] == 0.5 and b["model_config"]["dropout"] == 0.0
    assert any(not torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_the_state_dict_has_no_wrapper_prefixes_and_config_and_vocab_are_plain_data(pair):
    ckpt = load_checkpoint((folder := pair[0]) / "split" / CKPT_NAME)
    assert list(ckpt["model"]) == list(GPT(GPTConfig(**ckpt["model_config"])).state_dict())  # no _orig_mod., module.
    assert ckpt["format"] == FORMAT
    for key in ("model_config", "config", "vocab", "step", "best_val_loss", "history"):  # plain data: JSON's
        assert json.loads(json.dumps(ckpt[key])) == ckpt[key], key
    assert TrainConfig(**ckpt["config"]).out_dir == str(folder / "split")
    for other in ({"n_kv_head": 2}, {"n_layer": 1}):  # a newer field (not a TypeError); fewer layers than weights
        with pytest.raises(ValueError, match="checkpoint model_config does not fit its weights") as e:
            model_from_checkpoint({**ckpt, "model_config": {**ckpt["model_config"], **other}})
        newer = "'n_kv_head' (a newer version's checkpoint: use that version)"
        assert (newer in str(e.value)) == ("n_kv_head" in other), str(e.value)


def test_every_torch_load_in_the_repository_passes_weights_only_true():
    calls = {}  # "path:line" of each torch.load(...) -> whether it says weights_only=True
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "out")]  # out/: runs, not code
        for path in (Path(folder) / f for f in files if f.endswith(".py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                    calls[f"{path.relative_to(ROOT)}:{node.lineno}"] = any(
                        k.arg == "weights_only" and ast.unparse(k.value) == "True" for k in node.keywords)
    assert any(where.startswith("training/checkpoint.py:") and safe for where, safe in calls.items())
    # the one unsafe call is this file's deliberate one (the armed payload's control): the scan sees them
    assert [where.split(":")[0] for where, safe in calls.items() if not safe] == ["tests/test_checkpoints.py"]


# --- refusals, before anything is written ----------------------------------------------------
def snapshot(out: Path) -> dict | None:
    """Every file under out with its bytes and mtime; None when out does not exist."""
    return ({str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.rglob("*"))}
            if out.exists() else None)


def flip_a_weight_byte(path: Path) -> None:
    """Flip one byte in the middle of the largest record's data (a tensor's bytes)."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    raw[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


class WritesMarker(str):  # a path that, unpickled, calls open(path, "w"): the file's existence shows that code ran
    __reduce__ = lambda self: (open, (str(self), "w"))


def stopped_at(out: Path, step: int) -> None:
    """out's checkpoint as if saved by a Ctrl-C after `step` steps."""
    torch.save({**load_checkpoint(out / CKPT_NAME), "step": step, "interrupted": "SIGINT"}, out / CKPT_NAME)


def interrupted_then_finished(out: Path, step: int) -> None:
    """out's run as if stopped at `step` (saved) and resumed to its end without a better val, so never saved again."""
    stopped_at(out, step)
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "checkpoint_step": step}))


REFUSALS = {  # what is done to run_dir (conftest.py): (the change, to its config and/or out_dir), the message's parts
    "no_checkpoint": (lambda cfg, out: (out / CKPT_NAME).unlink() or cfg,
                      ["--resume: no checkpoint at", "without --resume the run starts afresh beside it (--overwrite"]),
    "no_out_dir": (lambda cfg, out: shutil.rmtree(out) or cfg, ["--resume: no checkpoint at"]),
    "architecture": (lambda cfg, out: cfg.replace(**ARCHITECTURE), [f"{k}: checkpoint " for k in ARCHITECTURE] + [
        "n_layer: checkpoint 2 vs config 1", "attn_window: checkpoint 0 vs config 4",  # a window: no weights
        "Drop --resume to start afresh, or give a new --out_dir"]),
    "vocabulary": (lambda cfg, out: (out.parent / "other.txt").write_text(TEXT.replace("R", "ZQ") * 100) and  # beside
                   cfg.replace(dataset=str(out.parent / "other.txt")),  # out_dir: the snapshot stays out_dir's
                   ["another vocabulary", "differing: ['Q', 'R', 'Z']", "drop --resume"]),  # not "vocab_size: ..."
    "past_max_iters": (lambda cfg, out: cfg.replace(max_iters=3), ["is at step 4, past max_iters=3; give --max_iter"
                                                                   "s > 4"]),
    "finished": (lambda cfg, out: cfg.replace(max_iters=4), ["is at step 4 = max_iters: the run is finished",
                                                            "summary.json", "--max_iters > 4"]),
    "finished_after_its_best": (lambda cfg, out: torch.save({**load_checkpoint(out / CKPT_NAME), "step": 2}, out /
        CKPT_NAME) or cfg.replace(max_iters=4), ["at step 2 (the best val estimate's), and the run ended at step 4",
                                                 "give --max_iters > 4"]),
    "finished_after_an_interruption": (lambda cfg, out: interrupted_then_finished(out, step=2) or
                                       cfg.replace(max_iters=4), ["at step 2 (the best val estimate's), and the run "
                                                                  "ended at step 4"]),
    "optimizer": (lambda cfg, out: cfg.replace(optimizer="muon"), ["optimizer: checkpoint 'adamw' vs config 'muon'"]),
    "optimizer_unrecorded": (lambda cfg, out: torch.save({**(c := load_checkpoint(out / CKPT_NAME)), "config": {  # old
        k: v for k, v in c["config"].items() if k != "optimizer"}}, out / CKPT_NAME) or cfg.replace(optimizer="muon"),
        ["optimizer: checkpoint 'adamw' vs config 'muon'"]),
    "seed": (lambda cfg, out: cfg.replace(seed=1338), ["seed: checkpoint 1337 vs config 1338. Give --seed=1337"]),
    "newer_version": (lambda cfg, out: torch.save({**(c := load_checkpoint(out / CKPT_NAME)), "model_config": {
        **c["model_config"], "n_kv_head": 2}}, out / CKPT_NAME) or cfg, ["model_config does not fit", "n_kv_head"]),
    "truncated": (lambda cfg, out: (out / CKPT_NAME).write_bytes((out / CKPT_NAME).read_bytes()[:20000]) and cfg,
                  ["is not a checkpoint: not a complete PyTorch archive"]),
    "flipped_byte": (lambda cfg, out: flip_a_weight_byte(out / CKPT_NAME) or cfg, ["fails its CRC-32 check"]),
    "not_ours": (lambda cfg, out: torch.save({"model": {}, "step": 4}, out / CKPT_NAME) or cfg,
                 ["is not a checkpoint written by this project"]),
    "incomplete": (lambda cfg, out: torch.save({k: v for k, v in load_checkpoint(out / CKPT_NAME).items()
                                                if k not in ("vocab", "rng")}, out / CKPT_NAME) or cfg,
                   ["is an incomplete checkpoint: it has no vocab, rng; use another"]),
    "not_a_dict": (lambda cfg, out: torch.save(["a", "list"], out / CKPT_NAME) or cfg,
                   ["is not a checkpoint written by this project"]),
    "pickled_object": (lambda cfg, out: torch.save({**load_checkpoint(out / CKPT_NAME), "vocab": WritesMarker(
        out.parent / "code_ran")}, out / CKPT_NAME) or cfg,
        ["holds pickled objects other than tensors and plain data; refused (they could run code): io.open\n"]),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_checkpoint_that_cannot_be_continued_is_refused_before_out_dir_is_touched(run_dir, capsys, case):
    """The message names the cause; out_dir stays byte-identical; a pickled object's code never runs."""
    (cfg, out), (change, needles) = run_dir, REFUSALS[case]
    cfg, before = change(cfg, out), snapshot(out)
    rc, err = train.main(cli_args(cfg)), capsys.readouterr().err
    assert rc == 1 and all(needle in err for needle in needles), (needles, err)
    assert snapshot(out) == before, "out_dir changed"
    assert not (out.parent / "code_ran").exists(), "the pickled object's code ran"
    if case == "incomplete":  # sampling needs only the model and its vocabulary
        with pytest.raises(ValueError, match="it has no vocab; use"):
            load_checkpoint(out / CKPT_NAME)
    if case == "pickled_object":  # positive control: the payload is armed
        torch.load(out / CKPT_NAME, weights_only=False)
        assert (out.parent / "code_ran").exists()


def test_the_same_copy_resumes_when_nothing_is_wrong(run_dir, capsys):
    """Positive control of the refusals (the harness sees a resume's writes); an older checkpoint resumes, on sdpa,
    with another eval_interval: its history keeps the step resumed from, which it does not evaluate again."""
    cfg, out = run_dir
    ckpt, new = load_checkpoint(path := out / CKPT_NAME), ("pos_emb", "qk_norm", "attn_window", "doc_sep")
    torch.save({**ckpt, "model_config": {k: v for k, v in ckpt["model_config"].items() if k not in new}}, path)
    before = snapshot(out)
    assert train.main(cli_args(cfg.replace(attn_backend="sdpa", eval_interval=3))) == 0, capsys.readouterr().err
    assert "\nnote: resumed with attn_backend manual -> sdpa, eval_interval 2 -> 3\n" in capsys.readouterr().out
    assert snapshot(out) != before and load_checkpoint(out / CKPT_NAME)["step"] == 6
    assert [h["step"] for h in json.loads((out / "summary.json").read_text())["history"]] == [0, 2, 4, 6]


def test_a_checkpoint_saved_at_a_stop_after_the_summary_was_written_resumes(run_dir, capsys):
    """A checkpoint saved at a stop that summary.json (of an earlier, finished run) does not hold, as when the process
    was killed before writing its own summary: that checkpoint continues."""
    cfg, out = run_dir
    stopped_at(out, step=2)
    assert train.main(cli_args(cfg.replace(max_iters=4))) == 0, capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["steps_this_run"] == 2
    assert "note: resumed with" not in (said := capsys.readouterr().out)  # nothing changed but max_iters
    assert "\ndone: 4 steps, 2 of them in " in said  # this run's time is 2 steps


# --- atomic writes ---------------------------------------------------------------------------
@pytest.mark.parametrize("fault, target", [("write", "torch.save"), ("fsync", "os.fsync"), ("ctrl_c", "torch.save")])
def test_a_failed_save_leaves_the_old_file_byte_identical_and_no_temp_file(tmp_path, monkeypatch, fault, target):
    save_checkpoint(path := tmp_path / CKPT_NAME, {"step": 1})
    old = path.read_bytes()

    def fail(*args, **kwargs):
        if target == "torch.save":
            args[1].write(b"x" * 4096)  # some bytes reached the temporary file first
        raise KeyboardInterrupt() if fault == "ctrl_c" else OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(target, fail)
    with pytest.raises(KeyboardInterrupt if fault == "ctrl_c" else OSError) as caught:
        save_checkpoint(path, {"step": 2})
    if fault != "ctrl_c":
        assert caught.value.errno == errno.ENOSPC
        assert f"could not write checkpoint {path}: No space left on device" in str(caught.value)
        assert "the previous checkpoint there (if any) is intact" in str(caught.value)
    assert path.read_bytes() == old and os.listdir(tmp_path) == [CKPT_NAME]
    monkeypatch.undo()  # positive control: the same save, without the fault, does replace the file
    save_checkpoint(path, {"step": 2})
    assert torch.load(path, weights_only=True)["step"] == 2 and os.listdir(tmp_path) == [CKPT_NAME]


def test_a_run_never_writes_into_another_runs_folder_unless_told_to_and_tidies_killed_writes(tmp_path, capsys,
                                                                                            monkeypatch):
    """Another dataset goes (saying so) to out-mytext, the same one again to out-2; --overwrite replaces the run in
    place: its old curves and the temporary files of killed writes go, the user's own files stay."""
    cfg = tiny_config(tmp_path, max_iters=2, eval_interval=2)
    assert train.main(cli_args(cfg)) == 0
    out = Path(cfg.out_dir)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert any(name.startswith("events.out.tfevents") for name in before)
    (other := tmp_path / "mytext.txt").write_text("Another corpus, of other characters. " * 40)
    assert train.main(cli_args(cfg.replace(dataset=str(other)))) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert f"{out} holds another run (of {cfg.dataset}): this one writes to {tmp_path / 'out-mytext'} (--resume " \
        "continues that run, --overwrite replaces it)\n" in capsys.readouterr().out
    assert load_checkpoint(tmp_path / "out-mytext" / CKPT_NAME)["config"]["dataset"] == str(other)
    assert train.train(cfg, verbose=False) and (tmp_path / "out-2" / CKPT_NAME).exists()
    assert run_folder(cfg)[0] == tmp_path / "out-3"  # out-2 is taken now too
    assert run_folder(cfg.replace(dataset="hf:someone/mytext:train"))[0] == tmp_path / "out-mytext-2"  # hf: its name
    monkeypatch.chdir(tmp_path)  # a config without out_dir: a folder in out/, beside the runs there, not out/ itself
    assert run_folder(TrainConfig(dataset=cfg.dataset))[0] == Path("out", "run")
    seen = []  # the name a write in progress really has: what a SIGKILL would leave
    write_atomic(out / CKPT_NAME, lambda f: seen.extend(set(os.listdir(out)) - set(before)))
    stale = [out / seen[0], out / ".config.json.1234.0badf00d.tmp", out / ".summary.json.1234.0badf00d.tmp"]
    assert len(seen) == 1 and stale[0].name.startswith(f".{CKPT_NAME}.") and stale[0].name.endswith(".tmp")
    for p in [*stale, out / "notes.txt", out / "draft.tmp"]:  # the user's own files, a .tmp too, stay
        p.write_bytes(b"torn")
    assert train.main(cli_args(cfg.replace(overwrite=True, max_iters=3, lr_decay_iters=3))) == 0
    assert load_checkpoint(out / CKPT_NAME)["step"] == 3 and len(list(out.glob("events.out.tfevents.*"))) == 1
    assert not any(p.exists() for p in stale) and (out / "notes.txt").exists() and (out / "draft.tmp").exists()
    shutil.copytree(out, solo := tmp_path / "solo", ignore=lambda _, names: set(names) - {CKPT_NAME})  # ckpt.pt alone
    assert run_folder(tiny_config(tmp_path, out_dir=str(solo)))[0] == tmp_path / "solo-2"  # is a run
    for resume in (True, False):  # --resume continues the run: its checkpoint, curves and summary stay
        prepare_run_folder(cfg.replace(overwrite=not resume, resume=resume), {})
        assert (out / "summary.json").exists() == resume == any(out.glob("events.out.tfevents.*")) == \
            (out / CKPT_NAME).exists()


def test_runs_started_at_once_never_share_a_folder_and_a_failed_one_gives_its_folder_back(tmp_path, monkeypatch):
    """A second run starting while the first loads its corpus (both found out/ free) goes beside it. An empty folder
    of the user's is claimed by its config.json; a run there that fails before a step leaves it empty again."""
    cfg, load, other = tiny_config(tmp_path, max_iters=2, exact_val=False), train.load_corpus, []
    monkeypatch.setattr(train, "load_corpus", lambda *a: other.append(run_folder(cfg, claim=True)) or load(*a))
    assert train.train(cfg, verbose=False)["steps"] == 2 and (tmp_path / "out" / CKPT_NAME).exists()
    assert other == [(tmp_path / "out-2", f"{tmp_path / 'out'} holds another run: this one writes to "
                      f"{tmp_path / 'out-2'} (--overwrite replaces it)", True)]  # no checkpoint to --resume yet
    assert os.listdir(tmp_path / "out-2") == ["config.json"]  # claimed: the next run goes to out-3
    assert run_folder(cfg)[0] == tmp_path / "out-3"
    (empty := tmp_path / "mine").mkdir()
    assert run_folder(cfg.replace(out_dir=str(empty)), claim=True) == (empty, None, False)
    assert run_folder(cfg.replace(out_dir=str(empty)), claim=True)[:2] == (tmp_path / "mine-2", f"{empty} holds "
        f"another run: this one writes to {tmp_path / 'mine-2'} (--overwrite replaces it)")
    (empty / "config.json").unlink()
    monkeypatch.setattr(train, "train_step", lambda run, step: [][step])  # a bug, after step 0's eval was logged
    for folder, overwrite in ((empty, False), (empty, True), (tmp_path / "new", True)):
        with pytest.raises(IndexError):
            train.train(cfg.replace(out_dir=str(folder), overwrite=overwrite))  # verbose: curves too
    assert os.listdir(empty) == [] and not (tmp_path / "new").exists()


def test_a_checkpoint_this_user_may_not_read_is_refused_in_one_line(tmp_path, monkeypatch):
    """Permission denied (as root the suite cannot be denied: the archive's open is made to fail)."""
    save_checkpoint(path := tmp_path / CKPT_NAME, {"step": 1})
    monkeypatch.setattr(zipfile, "ZipFile", lambda *_: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(ValueError, match=f"^cannot read checkpoint {path}: Permission denied$"):
        load_checkpoint(path)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_a_new_file_gets_the_permissions_of_the_umask_not_0600(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        write_atomic(tmp_path / "summary.json", lambda f: f.write(b"{}"))
    finally:
        os.umask(previous)
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == mode


def test_json_files_are_strict_json_with_non_finite_floats_as_null(tmp_path):
    """A run stopped in its first estimate has best_val_loss = inf: jq and JavaScript refuse Infinity."""
    write_json(tmp_path / "s.json", {"best_val_loss": float("inf"), "losses": [float("nan"), 1.5]})
    strict = json.loads((tmp_path / "s.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert strict == {"best_val_loss": None, "losses": [None, 1.5]}
