"""train.py and sample.py as a user meets them: --help, the errors (one line that says the way out, exit 1,
nothing written), the recipe picked without a config, the duration estimate, and what sample.py prints."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import model.gpt
import sample
import train
from tiny import ROOT, TEXT, tiny_config
from training import CKPT_NAME, TrainConfig, parse_args
from training.config import field_type
from training.visualize import HIGH

CPU_FAST = ROOT / "configs" / "shakespeare_char_cpu_fast.toml"
DASHES = "\n" + "-" * 40 + "\n"


def run_train(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = train.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_sample(capsys, *argv: str) -> tuple[int, str, str]:
    code = sample.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def argv_for(cfg: TrainConfig, config: Path | None = None, skip: tuple[str, ...] = (), **changes) -> list[str]:
    """cfg (with changes, minus skip) as train.py arguments, after the config file if one is given."""
    fields = {k: v for k, v in {**cfg.to_dict(), **changes}.items() if k not in skip}
    return ([str(config)] if config else []) + [f"--{k}={v}" for k, v in fields.items()]


def assert_one_error_line(code: int, err: str, *fragments: str) -> None:
    assert code == 1
    assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two trained runs under out/: a_new (the newest) and b_old (an hour older, but last by name)."""
    tmp = tmp_path_factory.mktemp("runs")
    ckpts = {}
    for name, seed, age in (("b_old", 2, 3600), ("a_new", 1, 0)):
        cfg = tiny_config(tmp, out_dir=str(tmp / "out" / name), seed=seed, max_iters=4, eval_interval=2,
                          always_save_checkpoint=True, tensorboard=False, exact_val=False)
        train.train(cfg, verbose=False)
        ckpts[name] = tmp / "out" / name / CKPT_NAME
        os.utime(ckpts[name], (time.time() - age,) * 2)
    return tmp, ckpts


# --- --help ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("program", [train, sample])
def test_help_lists_every_option_with_its_type_and_default(capsys, program):
    kind = sample.SampleConfig if program is sample else TrainConfig  # one mechanism: dataclass fields
    assert program.main(["--help"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  --")]
    fields = dataclasses.fields(kind)
    assert len(lines) == len(fields) >= 14  # one line per field, none stale
    for f in fields:
        line = next(line for line in lines if line.startswith(f"  --{f.name}="))
        for name in f.metadata["choices"] or (field_type(f).__name__,):
            assert name in line, (f.name, line)
        assert f"(default: {f.default!r})" in line, (f.name, line)


# --- errors: one line that says the way out, exit 1, nothing written ------------------------------------------------

def bad_train_args(case: str, tmp: Path) -> tuple[list[str], list[str]]:
    """The arguments of one bad command line and what its error must say."""
    cfg = tiny_config(tmp, tensorboard=False, max_iters=1, exact_val=False)
    toml = tmp / "bad.toml"
    if case == "unknown key":
        return argv_for(cfg, learnign_rate=0.1), ["unknown config key 'learnign_rate'", "did you mean learning_rate?"]
    if case == "unknown key in toml":
        toml.write_text("learnign_rate = 0.1\n")
        return argv_for(cfg, toml), [f"'learnign_rate' in {toml}", "did you mean learning_rate?"]
    if case == "ill-typed value":
        return argv_for(cfg, n_layer="two"), ["n_layer", "'two' is not a valid int"]
    if case == "ill-typed value in toml":
        toml.write_text('n_layer = "two"\n')
        return argv_for(cfg, toml, skip=("n_layer",)), ["n_layer must be int, got 'two'"]
    if case == "config is a folder":
        return argv_for(cfg, tmp), [f"config file {tmp}: cannot read it", "give a .toml file"]
    if case == "out_dir is a file":
        (tmp / "notes.txt").write_text("keep me")
        return argv_for(cfg, out_dir=tmp / "notes.txt"), ["cannot create it as a directory", "give another --out_dir"]
    if case == "doc_mask without documents":
        return argv_for(cfg, doc_mask=True), ["doc_mask=true needs documents", "--documents=lines"]
    if case == "non-UTF-8 corpus":
        (tmp / "latin1.txt").write_bytes(TEXT.encode() * 5 + "café".encode("latin1"))
        offset = len(TEXT.encode()) * 5 + 3
        return argv_for(cfg, dataset=tmp / "latin1.txt"), [f"invalid byte 0xe9 at byte offset {offset}",
                                                           f"iconv -f latin1 -t utf-8 {tmp / 'latin1.txt'}"]
    (tmp / "short.txt").write_text("abcdefghij" * 10)  # val: the last 10 tokens, one 9-token window
    return argv_for(cfg, dataset=tmp / "short.txt"), ["val split", "block_size=16 needs at least 17",
                                                      "--block_size=9 or less"]


@pytest.mark.parametrize("case", ["unknown key", "unknown key in toml", "ill-typed value", "ill-typed value in toml",
                                  "config is a folder", "out_dir is a file", "doc_mask without documents",
                                  "non-UTF-8 corpus", "split too short"])
def test_a_bad_train_command_line_is_one_error_line_that_says_the_way_out(case, tmp_path, capsys):
    argv, fragments = bad_train_args(case, tmp_path)
    assert_one_error_line(*run_train(capsys, argv)[::2], *fragments)
    if case == "out_dir is a file":
        assert (tmp_path / "notes.txt").read_text() == "keep me"
    else:
        assert not (tmp_path / "out").exists()


def test_the_block_size_a_too_short_split_suggests_is_the_largest_that_fits(tmp_path, capsys):
    (tmp_path / "short.txt").write_text("abcdefghij" * 10)
    cfg = tiny_config(tmp_path, dataset=str(tmp_path / "short.txt"), tensorboard=False, max_iters=1, batch_size=1)
    assert_one_error_line(*run_train(capsys, argv_for(cfg, block_size=10))[::2], "--block_size=9 or less")
    assert run_train(capsys, argv_for(cfg, block_size=9))[0] == 0


@pytest.mark.parametrize("argv, fragments", [
    (["--temperature=-1"], ["temperature must be a finite number >= 0, got -1.0"]),
    (["--top_p=0"], ["top_p must be in (0, 1], got 0.0"]),
    (["--num_samples=0"], ["--num_samples must be >= 1"]),
    (["--prompt=a", "--prompt_file=prompt.txt"], ["--prompt or --prompt_file, not both"]),
    (["--prompt=RZ"], ["characters not in the vocabulary: 'Z'"]),  # R is in it, so only Z is named
    (["--prompt="], ["the prompt is empty"]),
])
def test_a_bad_sample_option_is_one_error_line_before_any_text(runs, capsys, argv, fragments):
    code, out, err = run_sample(capsys, f"--ckpt={runs[1]['a_new']}", "--device=cpu", *argv)
    assert_one_error_line(code, err, *fragments)
    assert out == "" and "'R'" not in err


def test_sample_given_a_checkpoint_as_out_dir_says_to_use_ckpt(runs, capsys):
    ckpt = runs[1]["a_new"]
    assert_one_error_line(*run_sample(capsys, f"--out_dir={ckpt}")[::2], f"give it as --ckpt={ckpt}")


@pytest.mark.parametrize("argv, fragment", [(["--top-k=5"], "unknown option 'top-k'; did you mean top_k"),
                                            (["--temprature=0"], "did you mean temperature?"),
                                            (["--seed=-1"], "--seed must be in [0, 2**62], got -1"),
                                            (["--top_k=x"], "option top_k: 'x' is not a valid int"),
                                            (["--prompt"], "option prompt needs a value: --prompt=VALUE"),
                                            (["out"], "unexpected argument 'out': options start with --")])
def test_a_bad_sample_command_line_is_one_error_line(capsys, argv, fragment):
    assert_one_error_line(*run_sample(capsys, *argv)[::2], fragment)


# --- train.py without a config; the duration estimate ---------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="picks the GPU recipe")
def test_without_a_config_the_cpu_recipe_trains_into_its_out_dir_and_says_so_first(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(TEXT * 100)
    small = dict(dataset="corpus.txt", max_iters=2, eval_interval=1, eval_iters=1, n_layer=1, n_head=2, n_embd=16,
                 block_size=8, batch_size=2, tensorboard=False, exact_val=False)
    code, out, _ = run_train(capsys, [f"--{k}={v}" for k, v in small.items()])
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("no config given: training configs/shakespeare_char_cpu_fast.toml, "), lines[0]
    recipe = tomllib.loads(CPU_FAST.read_text())
    run_dir = tmp_path / recipe["out_dir"]  # the recipe's out_dir, under the cwd
    written = json.loads((run_dir / "config.json").read_text())["config"]
    kept = {k: v for k, v in recipe.items() if k not in small}
    assert {k: written[k] for k in kept} == kept
    assert sum(TrainConfig().to_dict()[k] != v for k, v in kept.items()) >= 5  # the recipe is not the defaults
    assert (run_dir / "summary.json").is_file()
    first = {start: next(i for i, line in enumerate(lines) if line.startswith(start))
             for start in ("estimated duration on this machine: ", "step 0: ")}
    assert first["estimated duration on this machine: "] < first["step 0: "]  # before the loop
    assert "GPU-sized" not in out  # a run of seconds is not told to switch recipes


@pytest.mark.parametrize("device", [["--device=cpu"], ["--device", "cpu"]])  # parse_args takes both forms
def test_without_a_config_on_a_cuda_machine_device_cpu_picks_the_cpu_recipe(tmp_path, monkeypatch, capsys, device):
    real = train.resolve_device
    monkeypatch.setattr(train, "resolve_device", lambda d: torch.device("cuda") if d == "auto" else real(d))
    cfg = tiny_config(tmp_path, tensorboard=False, max_iters=1, exact_val=False)
    code, out, _ = run_train(capsys, [*argv_for(cfg, skip=("device",)), *device])
    assert code == 0 and out.startswith("no config given: training configs/shakespeare_char_cpu_fast.toml, "), out[:99]


@pytest.mark.parametrize("kind, recipe", [("cuda", "shakespeare_char.toml"), ("mps", "shakespeare_char_cpu.toml"),
                                          ("cpu", "shakespeare_char_cpu_fast.toml")])
def test_without_a_config_each_device_gets_its_recipe(monkeypatch, kind, recipe):
    monkeypatch.setattr(train, "resolve_device", lambda d: torch.device(kind))
    argv, why = train.with_recipe(["--max_iters=3"])
    assert argv == [str(ROOT / "configs" / recipe), "--max_iters=3"]
    assert why.startswith(f"no config given: training configs/{recipe}, ")
    assert train.with_recipe(["configs/debug.toml"]) == (["configs/debug.toml"], None)


def test_a_gpu_sized_config_on_a_cpu_shows_its_estimate_and_suggests_the_cpu_recipe(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "estimated_seconds", lambda *args: (5 * 3600.0, 2.5))  # the baby GPT on a CPU
    cfg = tiny_config(tmp_path, tensorboard=False, max_iters=1, exact_val=False)
    code, out, _ = run_train(capsys, argv_for(cfg, ROOT / "configs" / "shakespeare_char.toml"))
    assert code == 0 and not out.startswith("no config given")
    assert "estimated duration on this machine: 5 h (one forward of a 4x16 batch: 2.50 s)\n" in out
    suggestion = re.search(r"^this is a GPU-sized run .*: python train.py (\S+)$", out, re.M)
    assert suggestion and Path(suggestion[1]).resolve() == CPU_FAST  # a path that works from the cwd
    assert out.index(suggestion[0]) < out.index("step 0: ")


# --- what sample.py prints -----------------------------------------------------------------------------------------

def test_sample_without_options_continues_the_newest_checkpoint_under_out(runs, monkeypatch, capsys):
    tmp, ckpts = runs
    monkeypatch.chdir(tmp)
    texts = {name: run_sample(capsys, f"--ckpt={path}", "--max_new_tokens=30")[1] for name, path in ckpts.items()}
    assert texts["a_new"] != texts["b_old"]  # the two models tell apart which one was sampled
    code, out, err = run_sample(capsys, "--max_new_tokens=30")
    assert code == 0 and out == texts["a_new"] and f"sampling from {Path('out', 'a_new', CKPT_NAME)}" in err
    old_mtime = ckpts["b_old"].stat().st_mtime
    try:
        os.utime(ckpts["b_old"], (time.time() + 10,) * 2)  # now b_old is the newest
        assert run_sample(capsys, "--max_new_tokens=30")[1] == texts["b_old"]
    finally:
        os.utime(ckpts["b_old"], (old_mtime,) * 2)


def test_the_text_ends_with_its_newline_before_the_speed_line_on_stderr(runs):
    """Both streams into one pipe, as `python sample.py 2>&1 | less` reads them: stdout block-buffered."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # set here; a user's python buffers
    proc = subprocess.run([sys.executable, "sample.py", f"--ckpt={runs[1]['a_new']}", "--prompt=ROMEO:",
                           "--max_new_tokens=30", "--device=cpu"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120,
                          env={**env, "OMP_NUM_THREADS": "1"})  # 2 threads on a busy 2-core CPU: seconds
    assert proc.returncode == 0
    assert re.fullmatch(r"ROMEO:[^\[]{30}\n\[30 tokens in \S+ s, \S+ tokens/s on cpu\]\n", proc.stdout), proc.stdout


def test_greedy_ignores_the_seed_and_the_same_seed_gives_the_same_text(runs, capsys):
    def text(*flags: str) -> str:
        return run_sample(capsys, f"--ckpt={runs[1]['a_new']}", "--device=cpu", "--max_new_tokens=40", *flags)[1]

    assert text("--temperature=0", "--seed=1") == text("--temperature=0", "--seed=2")
    assert text("--seed=1") == text("--seed=1")
    assert text("--seed=1") != text("--seed=2")  # positive control: sampling does depend on the seed


def test_num_samples_are_separated_by_a_dashed_line(runs, capsys):
    code, out, _ = run_sample(capsys, f"--ckpt={runs[1]['a_new']}", "--device=cpu", "--prompt=ROMEO:",
                              "--max_new_tokens=10", "--num_samples=3")
    parts = out.removesuffix("\n").split(DASHES)
    assert code == 0 and out.endswith("\n") and len(parts) == 3
    assert all(p.startswith("ROMEO:") and len(p) == len("ROMEO:") + 10 for p in parts), parts


def test_num_samples_gives_different_texts_and_top_k_0_means_every_token(runs, capsys, monkeypatch):
    """Three samples from one generator are three texts; --top_k=0 hands sample_next no top-k (all tokens), as
    --help says, and --top_k=5 hands it 5."""
    code, out, _ = run_sample(capsys, f"--ckpt={runs[1]['a_new']}", "--max_new_tokens=40", "--num_samples=3")
    assert code == 0 and len(set(out.removesuffix("\n").split(DASHES))) == 3
    seen, real = [], model.gpt.sample_next
    monkeypatch.setattr(model.gpt, "sample_next", lambda logits, *args: seen.append(args[1]) or real(logits, *args))
    for top_k, want in (("0", None), ("5", 5)):
        seen.clear()
        assert run_sample(capsys, f"--ckpt={runs[1]['a_new']}", "--max_new_tokens=3", f"--top_k={top_k}")[0] == 0
        assert seen == [want] * 3, (top_k, seen)


def test_an_sdpa_trained_run_draws_its_attention_maps_in_tensorboard_and_in_sample_py(tmp_path, capsys):
    """The maps need the weights, which sdpa does not return: both the eval snapshots and --attention_png still
    draw them for an sdpa run (every layer, blue cells where a query reads)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    cfg = tiny_config(tmp_path, attn_backend="sdpa", max_iters=2, eval_interval=2, sample_tokens=0, exact_val=False)
    assert run_train(capsys, argv_for(cfg))[0] == 0
    acc = ea.EventAccumulator(cfg.out_dir, size_guidance={ea.IMAGES: 0}).Reload()
    assert set(acc.Tags()["images"]) == {f"maps/attention_layer_{layer}" for layer in range(cfg.n_layer)}
    assert run_sample(capsys, f"--out_dir={cfg.out_dir}", "--prompt=ROMEO:", "--attention_png")[0] == 0
    pixels = np.asarray(Image.open(Path(cfg.out_dir) / "attention.png").convert("RGB"))
    assert ((pixels == HIGH).all(-1) | (pixels[..., 2] > pixels[..., 0] + 60)).sum() > 100  # blue: weights drawn


def test_attention_png_goes_to_out_dir_without_a_value_and_to_the_path_given(runs, tmp_path, capsys):
    run_dir = runs[1]["a_new"].parent
    (run_dir / "attention.png").unlink(missing_ok=True)
    assert run_sample(capsys, f"--out_dir={run_dir}", "--device=cpu", "--prompt=ROMEO:", "--attention_png")[0] == 0
    given = tmp_path / "pics" / "maps.png"
    code, out, err = run_sample(capsys, f"--out_dir={run_dir}", "--prompt=ROMEO:", f"--attention_png={given}")
    assert code == 0 and out == "" and f"wrote {given}" in err
    for path in (run_dir / "attention.png", given):
        assert Image.open(path).format == "PNG"


def test_a_prompt_longer_than_block_size_is_continued_and_its_last_block_size_characters_drawn(runs, tmp_path, capsys):
    prompt, ckpt = TEXT[:40], f"--ckpt={runs[1]['a_new']}"  # block_size is 16
    code, out, _ = run_sample(capsys, ckpt, "--device=cpu", f"--prompt={prompt}", "--max_new_tokens=10")
    assert code == 0 and out.startswith(prompt) and len(out) == len(prompt) + 10 + 1
    for name, text in (("long.png", prompt), ("last.png", prompt[-16:])):
        assert run_sample(capsys, ckpt, f"--prompt={text}", f"--attention_png={tmp_path / name}")[0] == 0
    assert (tmp_path / "long.png").read_bytes() == (tmp_path / "last.png").read_bytes()


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's modes: x86 builds of PyTorch")
def test_train_py_puts_mkl_in_its_strict_reproducible_mode_before_its_first_matmul(tmp_path):
    """Outside MKL's strict CNR mode a gemm's result can depend on how many threads MKL takes at run time, so on
    the machine's load; train.py asks for the strict mode (unless MKL_CBWR is set), and every gemm runs in it."""
    cfg = tiny_config(tmp_path, max_iters=1, eval_interval=1, eval_iters=1, exact_val=False, tensorboard=False)
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | {"MKL_VERBOSE": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv_for(cfg)], env=env, capture_output=True,
                         text=True, timeout=120).stdout
    modes = set(re.findall(r"CNR:(\S+)", out))
    assert modes == {"AUTO,STRICT"}, modes


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.toml")
                                          if 'device = "cpu"' in p.read_text()))
def test_every_cpu_config_trains_with_a_window_and_samples_past_block_size_from_it(config, tmp_path, capsys):
    corpus = Path(tiny_config(tmp_path).dataset)
    out = tmp_path / "windowed"
    argv = [str(ROOT / "configs" / config), f"--dataset={corpus}", "--attn_window=8", "--batch_size=2",
            "--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--exact_val=false", "--tensorboard=false",
            f"--out_dir={out}"]
    assert run_train(capsys, argv)[0] == 0
    assert torch.load(out / CKPT_NAME, weights_only=True)["model_config"]["attn_window"] == 8
    code, text, _ = run_sample(capsys, f"--out_dir={out}", "--prompt=ROMEO:", "--max_new_tokens=150")
    documents = parse_args([str(ROOT / "configs" / config)]).documents  # a document may end sooner
    assert code == 0 and (len(text) == len("ROMEO:") + 150 + 1 or documents and text.startswith("ROMEO:"))


def test_a_model_of_lines_samples_whole_documents_each_ending_at_the_separator(tmp_path, capsys):
    """Trained on names, one per line, with the document mask: sample.py starts each sample with a new document
    and stops it at the next separator: three names, a line each, none running into the next."""
    names = tmp_path / "names.txt"
    names.write_text("\n".join(["anna", "bob", "carla", "dan", "emma", "fred"] * 60) + "\n")
    cfg = tiny_config(tmp_path, dataset=str(names), documents="lines", doc_mask=True, max_iters=80, lr_decay_iters=80,
                      eval_interval=80, tensorboard=False, exact_val=False)
    train.train(cfg, verbose=False)
    code, out, _ = run_sample(capsys, f"--out_dir={cfg.out_dir}", "--num_samples=3", "--max_new_tokens=200")
    lines = out.split("\n")
    assert code == 0 and len(lines) == 4 and lines[-1] == "" and "\x1e" not in out, out
    assert all(0 < len(name) < 20 and name.isalpha() for name in lines[:3]), out
