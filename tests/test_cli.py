"""train.py and sample.py as a user meets them: --help, the errors (one line that says the way out, exit 1,
nothing written), the recipe picked without a config, the duration estimate, and what sample.py prints."""

import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator as ea

import model.gpt
import sample
import train
from data import load_corpus
from tiny import CPU_CONFIGS, ROOT, TEXT, tiny_config
from training import CKPT_NAME, TrainConfig, parse_args
from training.config import field_type
from training.visualize import HIGH

CPU_FAST = ROOT / "configs" / "shakespeare_char_cpu_fast.toml"
DASHES = "\n" + "-" * 40 + "\n"
run = lambda capsys, program, *argv: (program.main([str(a) for a in argv]), *capsys.readouterr())  # code, out, err


def argv_for(cfg: TrainConfig, config: Path | None = None, skip: tuple[str, ...] = (), **changes) -> list[str]:
    """cfg (with changes, minus skip) as train.py arguments, after the config file if one is given."""
    fields = {k: v for k, v in {**cfg.to_dict(), **changes}.items() if k not in skip}
    return ([str(config)] if config else []) + [f"--{k}={v}" for k, v in fields.items()]


def assert_one_error_line(code: int, err: str, *fragments: str) -> None:
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), (code, err)
    assert all(fragment in err for fragment in fragments), (fragments, err)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two trained runs under out/: a_new (the newest) and b_old (an hour older, but last by name)."""
    tmp, ckpts = tmp_path_factory.mktemp("runs"), {}
    for name, seed, age in (("b_old", 2, 3600), ("a_new", 1, 0)):
        train.train(tiny_config(tmp, out_dir=str(tmp / "out" / name), seed=seed, max_iters=4, eval_interval=2,
                                always_save_checkpoint=True, tensorboard=False, exact_val=False), verbose=False)
        ckpts[name] = tmp / "out" / name / CKPT_NAME
        os.utime(ckpts[name], (time.time() - age,) * 2)
    return tmp, ckpts


@pytest.fixture
def sample_a(runs, capsys):  # sample.py on a_new's checkpoint: (exit code, stdout, stderr)
    return lambda *argv: run(capsys, sample, f"--ckpt={runs[1]['a_new']}", *argv)


# --- --help ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("program, kind", [(train, TrainConfig), (sample, sample.SampleConfig)])  # dataclass fields
@pytest.mark.parametrize("ask", ["--help", "-h"])
def test_help_lists_every_option_with_its_type_and_default(capsys, program, kind, ask):
    assert program.main([ask]) == 0
    out = capsys.readouterr().out
    assert program.main(["--top_k=5", ask] if program is sample else [str(CPU_FAST), ask]) == 0  # anywhere: no run
    assert capsys.readouterr().out == out
    lines = [line for line in out.splitlines() if line.startswith("  --")]
    fields = dataclasses.fields(kind)
    assert len(lines) == len(fields) >= 14  # one line per field, none stale
    for f in fields:
        line = next(line for line in lines if line.startswith(f"  --{f.name}="))
        for name in f.metadata["choices"] or (field_type(f).__name__,):
            assert name in line, (f.name, line)
        assert f"(default: {f.default!r})" in line and f"{line}\n      {f.metadata['help']}\n" in out, (f.name, line)


# --- errors: one line that says the way out, exit 1, nothing written ------------------------------------------------

def bad_train_args(case: str, tmp: Path) -> tuple[list[str], list[str]]:
    """The arguments of one bad command line and what its error must say."""
    cfg, toml = tiny_config(tmp, tensorboard=False, max_iters=1, exact_val=False), tmp / "bad.toml"
    if case == "unknown key":
        return argv_for(cfg, learnign_rate=0.1), ["unknown config key 'learnign_rate'", "did you mean learning_rate?"]
    if case == "unknown key in toml":
        toml.write_text("learnign_rate = 0.1\n")
        return argv_for(cfg, toml), [f"'learnign_rate' in {toml}", "did you mean learning_rate?"]
    if case == "ill-typed value in toml":
        toml.write_text('n_layer = "two"\n')
        return argv_for(cfg, toml, skip=("n_layer",)), ["n_layer must be int, got 'two'"]
    if case == "non-UTF-8 toml":
        toml.write_bytes("# café\n".encode("latin1"))
        return argv_for(cfg, toml), [f"{toml} is not UTF-8 text: invalid byte 0xe9 at byte offset 5", "iconv"]
    if case == "invalid toml":
        toml.write_text("n_layer = \n")
        return argv_for(cfg, toml), [f"config file {toml} is not valid TOML: ", "line 1"]  # tomllib's words after
    if case == "text as config":
        (text := tmp / "speech.txt").write_text(TEXT)
        return argv_for(cfg, text), [f"config file {text} is not valid TOML: ", f"text file: --dataset={text})"]
    if case == "nanoGPT's config":
        (py := tmp / "train_shakespeare_char.py").write_text("always_save_checkpoint = False\n")
        return argv_for(cfg, py), [f"{py} is not valid TOML: ", "configs are TOML here: nanoGPT's"]
    if case == "missing device":  # plain cuda where there is none (the usual slip), else cuda:N, N = the count
        name = f"cuda:{n}" if (n := torch.cuda.device_count()) else "cuda"
        return argv_for(cfg, device=name), [f"device={name!r}", f"has {n} cuda", "--device=cpu"]
    if case == "config is a folder":
        return argv_for(cfg, tmp), [f"config file {tmp}: cannot read it", "give a .toml file"]
    if case == "out_dir is a file":
        (tmp / "notes.txt").write_text("keep me")
        return argv_for(cfg, out_dir=tmp / "notes.txt"), ["cannot create it as a directory", "give another --out_dir"]
    if case == "doc_mask without documents":
        return argv_for(cfg, doc_mask=True), ["doc_mask=true needs documents", "--documents=lines"]
    if case == "non-UTF-8 corpus":
        (latin := tmp / "latin1.txt").write_bytes(TEXT.encode() * 5 + "café".encode("latin1"))
        return argv_for(cfg, dataset=latin), [f"invalid byte 0xe9 at byte offset {len(TEXT.encode()) * 5 + 3}",
                                              f"iconv -f latin1 -t utf-8 {latin} > {latin}.utf8"]
    if case == "too big for memory":  # petabytes, more than any address space: refused at once
        return argv_for(cfg, n_embd=10**14, n_head=1, dtype="float32"), ["out of memory (tried to allocate",
                                                                         "bytes): make the run smaller"]
    (tmp / "short.txt").write_text("abcdefghij" * 10)  # val: the last 10 tokens, one 9-token window
    return argv_for(cfg, dataset=tmp / "short.txt", block_size=10), ["val split", "block_size=10 needs at least 11",
                                                                     "--block_size=9 or less"]


@pytest.mark.parametrize("case", ["unknown key", "unknown key in toml", "ill-typed value in toml", "non-UTF-8 toml",
                                  "invalid toml", "text as config", "nanoGPT's config", "config is a folder",
                                  "out_dir is a file", "missing device", "non-UTF-8 corpus", "split too short",
                                  "doc_mask without documents", "too big for memory"])
def test_a_bad_train_command_line_is_one_error_line_that_says_the_way_out(case, tmp_path, capsys):
    argv, fragments = bad_train_args(case, tmp_path)
    assert_one_error_line(*run(capsys, train, *argv)[::2], *fragments)
    assert ((tmp_path / "notes.txt").read_text() == "keep me" if case == "out_dir is a file"
            else not (tmp_path / "out").exists())
    if case == "split too short":  # the block_size it suggests is the largest that fits: 10 is refused, 9 trains
        assert run(capsys, train, *argv, "--block_size=9")[0] == 0


def test_sample_options_take_a_value_after_a_space_and_a_bare_flag_takes_none():
    got = parse_args(["--attention_png", "m.png", "--no_cache", "--prompt", "RO", "--top_k", "5"], sample.SampleConfig)
    assert got == sample.SampleConfig(attention_png="m.png", no_cache=True, prompt="RO", top_k=5)
    with pytest.raises(ValueError, match="unexpected argument 'm.png'"):
        parse_args(["--no_cache", "m.png"], sample.SampleConfig)


@pytest.mark.parametrize("argv, fragment", [  # {ckpt}: --ckpt=a_new's --device=cpu; {path}: a_new's checkpoint
    ("{ckpt} --temperature=-1", "--temperature must be >= 0, got -1.0"),
    ("{ckpt} --top_p=0", "--top_p must be in (0, 1], got 0.0"),
    ("{ckpt} --num_samples=0", "--num_samples must be >= 1"),
    ("{ckpt} --prompt= --prompt_file=prompt.txt", "--prompt or --prompt_file, not both"),
    ("{ckpt} --out_dir=out", "--out_dir or --ckpt, not both"),  # either, silently, would sample another run
    ("--attention_png --prompt=R --top_p=7", "--top_p must be in (0, 1], got 7.0"),  # checked before any model
    ("{ckpt} --prompt_file=no/such.txt", "--prompt_file: cannot read no/such.txt: No such file or directory"),
    ("{ckpt} --prompt=RZ", "characters not in the vocabulary: 'Z'"),  # R is in it, so only Z is named
    ("{ckpt} --prompt=", "the prompt is empty"), ("--out_dir={path}", "is a file: give it as --ckpt={path}"),
    ("--ckpt={path.parent}", "{path.parent} is a directory, not a checkpoint: give {path}"),
    ("--ckpt={path.parent.parent}", "{path.parent.parent} is a directory, not a checkpoint: it holds no ckpt.pt"),
    ("--top-k=5", "unknown option 'top-k'; did you mean top_k"), ("--temprature=0", "did you mean temperature?"),
    ("--start=ROMEO", "unknown option 'start'; did you mean prompt?"),  # nanoGPT's name
    ("--seed=-1", "--seed must be in [0, 2**62], got -1"), ("--top_k=x", "option top_k: 'x' is not a valid int"),
    ("--prompt", "option prompt needs a value: --prompt=VALUE"), ("--top_k=-1", "--top_k must be >= 0, got -1"),
    ("--prompt --seed=1", "option prompt needs a value"),  # an option next is no value
    ("--max_new_tokens=-1", "--max_new_tokens must be >= 0, got -1"), ("--ckpt=", "--ckpt must be non-empty, got ''"),
    ("--out_dir=", "--out_dir must be non-empty"), ("--prompt_file=", "--prompt_file must be non-empty"),
    ("{ckpt} --slide=17", "slide must be an integer in [1, block_size=16], got 17"),
    ("--slide=0", "--slide must be >= 1, got 0"),  # before any model
    ("--device=foo", "--device must be one of auto, cpu"), ("{ckpt} --device=cuda:64", "device='cuda:64' but this"),
    ("{ckpt} --prompt=R --attention_png=m.x", "write m.x: unknown file"),
    ("{ckpt} --prompt=R --attention_png={path}/m.png", "write {path}/m.png: a file stands where its folder should be"),
    ("{ckpt} --attention_png", "--attention_png draws a prompt's attention: give --prompt=TEXT or --prompt_file=FILE"),
    ("out", "unexpected argument 'out': options start with --"),
    ("", "no checkpoint under out/: run python train.py, or give --out_dir or --ckpt"),  # sampling before training
    ("--out_dir=nowhere", "no checkpoint at nowhere/ckpt.pt: train one (python train.py) or give another --out_dir")])
def test_a_bad_sample_command_line_is_one_error_line_before_any_text(runs, capsys, argv, fragment, tmp_path,
                                                                     monkeypatch):
    path = runs[1]["a_new"]
    monkeypatch.chdir(tmp_path)  # no out/ here
    code, out, err = run(capsys, sample, *argv.format(ckpt=f"--ckpt={path} --device=cpu", path=path).split())
    assert_one_error_line(code, err, fragment.format(path=path))
    assert out == "" and "'R'" not in err


@pytest.mark.parametrize("program", ["train", "sample"])
def test_a_reader_gone_before_the_first_line_ends_the_program_quietly(runs, program):
    """`python train.py --help | head -0`, `python sample.py | head -0`: exit 0 and 1, no BrokenPipeError on stderr."""
    args = ["--help"] if program == "train" else [f"--ckpt={runs[1]['a_new']}", "--device=cpu"]
    proc = subprocess.Popen([sys.executable, str(ROOT / f"{program}.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before it writes a byte: its first write fails (EPIPE)
    err = proc.stderr.read().decode()
    assert (proc.wait(timeout=60), err) == (0 if program == "train" else 1, "")


def test_the_mask_command_and_its_complement_collect_what_they_say():
    """-m mask skips the files that hold no mask test; -m "not mask" (the rest of the suite) must not."""
    collect = lambda expr: subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", expr,
                                           "--collect-only", "-q", "tests"], cwd=ROOT, capture_output=True,
                                          text=True, timeout=120).stdout
    mask = collect("mask")  # and the meta-tests, the proof that the checks bite, are in it
    assert re.search(r"tests/test_cli.py: \d+", collect("not mask")) and "test_cli" not in mask
    assert all(re.search(rf"tests/test_{name}.py: \d+", mask) for name in ("mutants", "causality", "attention")), mask


def test_the_readmes_window_written_into_the_rule_passes_the_mask_command_once_declared(tmp_path):
    """The README's worked example, in a copy of the project: `visible` edited by hand to a window of 4 fails the mask
    command with the report the README shows, and is green once declared."""
    edit, shipped = "allowed = (k_pos <= q_pos) & (k_pos > q_pos - 4)", "allowed = k_pos <= q_pos\n"
    assert f"`{edit}`" in (ROOT / "README.md").read_text(encoding="utf-8")  # the example the README gives
    if shipped not in (ROOT / "model" / "attention.py").read_text(encoding="utf-8"):  # a rule changed on purpose
        pytest.skip("model/attention.py:visible is not the shipped rule, which the README's example edits")
    copy = tmp_path / "project"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".*", "out", "__pycache__", "benchmarks"))
    rewrite = lambda path, old, new: path.write_text(path.read_text().replace(old, new, 1) if old in path.read_text()
                                                     else pytest.fail(f"{path.name} no longer holds {old!r}"))
    rewrite(copy / "model" / "attention.py", shipped, edit + "\n")
    mask = lambda *args: subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "mask", *args],
                                        cwd=copy, capture_output=True, text=True, timeout=300)
    undeclared, squeeze = mask(), lambda text: re.sub("=+", "=", text)  # the separators' width is the terminal's
    shown = (ROOT / "README.md").read_text(encoding="utf-8").split(f"`{edit}`")[1].split("```")[1].strip()
    assert undeclared.returncode == 1 and squeeze(shown) in squeeze(undeclared.stdout), \
        "the README's window edit no longer gets the README's report (does the unedited code pass python -m pytest " \
        f"-m mask?); the mask command said:\n{undeclared.stdout[-3000:]}"
    rewrite(copy / "tests" / "reference.py", "return k <= q and (window", "return k <= q and q - k < 4 and (window")
    rewrite(copy / "tests" / "reference.py", 'else "the causal rule")', 'else "a window of 4")')
    declared = mask()
    assert declared.returncode == 0 and " passed" in declared.stdout, \
        f"the README's window, edited and declared, fails the mask command:\n{declared.stdout[-3000:]}"


# --- train.py without a config; the duration estimate ---------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="picks the GPU recipe")
def test_without_a_config_the_cpu_recipe_trains_into_its_out_dir_and_says_so_first(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(TEXT * 100)
    small = dict(dataset="corpus.txt", max_iters=2, eval_interval=1, eval_iters=1, n_layer=1, n_head=2, n_embd=16,
                 block_size=8, batch_size=2, tensorboard=False, exact_val=False)
    code, out, _ = run(capsys, train, *(args := [f"--{k}={v}" for k, v in small.items()]))
    assert code == 0 and out.startswith("no config given: training configs/shakespeare_char_cpu_fast.toml, "), out
    recipe = tomllib.loads(CPU_FAST.read_text())
    run_dir = tmp_path / recipe["out_dir"]  # the recipe's out_dir, under the cwd
    command = out.splitlines()[-1].split("sample it: ")[1].split()  # from this folder, outside the project's
    assert (tmp_path / command[1]).resolve() == ROOT / "sample.py" and command[2] == f"--out_dir={recipe['out_dir']}"
    facts = json.loads((run_dir / "config.json").read_text())
    assert facts["run"]["argv"] == [sys.argv[0], str(CPU_FAST), *args]  # the command that ran, its recipe named
    head = shutil.which("git") and subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                                  text=True).stdout.strip()
    assert facts["run"]["git_commit"] == (head or "unknown")  # the project's commit, whatever the working folder
    assert [facts["run"][k] for k in ("python", "torch", "numpy")] == [platform.python_version(), torch.__version__,
                                                                      np.__version__]
    written = facts["config"]
    kept = {k: v for k, v in recipe.items() if k not in small}
    assert {k: written[k] for k in kept} == kept
    assert sum(TrainConfig().to_dict()[k] != v for k, v in kept.items()) >= 5  # the recipe is not the defaults
    assert (run_dir / "summary.json").is_file()
    assert out.index("\nestimated duration on this machine: ") < out.index("\nstep 0: ")  # before the loop
    assert "GPU-sized" not in out  # a run of seconds is not told to switch recipes


@pytest.mark.parametrize("kind, recipe", [("cuda", "shakespeare_char_fast.toml"), ("mps", "shakespeare_char_cpu.toml"),
                                          ("cpu", "shakespeare_char_cpu_fast.toml")])
def test_without_a_config_each_device_gets_its_recipe_and_device_cpu_the_cpu_one(monkeypatch, kind, recipe):
    monkeypatch.setattr(train, "resolve_device", lambda d: torch.device(kind if d == "auto" else d))
    argv, why = train.with_recipe(["--max_iters=3"])
    assert argv == [str(ROOT / "configs" / recipe), *["--device=mps"][:kind == "mps"], "--max_iters=3"]
    assert parse_args(argv).device in ("auto", kind)  # not the laptop recipe's cpu on MPS
    assert why.startswith(f"no config given: training configs/{recipe}, ")
    assert train.with_recipe(["configs/debug.toml"]) == (["configs/debug.toml"], None)
    for device in (["--device=cpu"], ["--device", "cpu"]):  # parse_args takes both forms
        argv, why = train.with_recipe(["--max_iters=3", *device])
        assert argv[0] == str(CPU_FAST) and why.startswith("no config given: training configs/" + CPU_FAST.name), device
    # overrides are checked on top of the recipe, not of the defaults (learning_rate 1e-3, warmup_iters 100)
    overrides = ["--device=cpu", "--min_lr=0.005", "--lr_decay_iters=50"]
    assert parse_args(train.with_recipe(overrides)[0]).min_lr == 0.005
    with pytest.raises(ValueError, match="device must be one of .*, got 'gpu'"):
        train.with_recipe(["--device=gpu"])


def test_a_gpu_sized_config_on_a_cpu_shows_its_estimate_and_suggests_the_cpu_recipe(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "estimated_seconds", lambda *args: (16 * 60.0, 2.5))  # past LONG_RUN_SECONDS
    monkeypatch.setattr(train, "EVAL_TOKENS_PER_FORWARD", 32)  # a batch past a CPU forward's best: one per forward
    cfg = tiny_config(tmp_path, tensorboard=False, max_iters=1, exact_val=False)
    code, out, _ = run(capsys, train, *argv_for(cfg, ROOT / "configs" / "shakespeare_char.toml"))
    assert code == 0 and out.startswith(f"{cfg.dataset}: ")  # the corpus line first: no line about the recipe
    assert "estimated duration on this machine: 16 min (one forward of a 4x16 batch: 2.5 s)\n" in out
    suggestion = re.search(r"^this is a GPU-sized run .*: python train.py (\S+)$", out, re.M)
    assert suggestion and Path(suggestion[1]).resolve() == CPU_FAST  # a path that works from the cwd
    assert out.index(suggestion[0]) < out.index("step 0: ")
    code, out, _ = run(capsys, train, *argv_for(cfg.replace(out_dir=str(tmp_path / "fast")), CPU_FAST))
    assert code == 0 and "duration on this machine: 16 min" in out and "GPU-sized" not in out  # it is the CPU recipe
    monkeypatch.setattr(train, "estimated_seconds", lambda *args: (14 * 60.0, 2.5))  # under LONG_RUN_SECONDS
    code, out, _ = run(capsys, train, *argv_for(cfg.replace(out_dir=str(tmp_path / "short")), ROOT / "configs" /
                                                "shakespeare_char.toml"))
    assert code == 0 and "duration on this machine: 14 min" in out and "GPU-sized" not in out  # a run of minutes


# --- what sample.py prints -----------------------------------------------------------------------------------------

def test_sample_without_options_continues_the_newest_checkpoint_under_out(runs, monkeypatch, capsys):
    tmp, ckpts = runs
    monkeypatch.chdir(tmp)
    texts = {name: run(capsys, sample, f"--ckpt={path}", "--max_new_tokens=30")[1] for name, path in ckpts.items()}
    assert texts["a_new"] != texts["b_old"]  # the two models tell apart which one was sampled
    code, out, err = run(capsys, sample, "--max_new_tokens=30")
    assert code == 0 and out == texts["a_new"] and f"sampling from {Path('out', 'a_new', CKPT_NAME)}" in err
    old_mtime = ckpts["b_old"].stat().st_mtime
    try:
        os.utime(ckpts["b_old"], (time.time() + 10,) * 2)  # now b_old is the newest
        assert run(capsys, sample, "--max_new_tokens=30")[1] == texts["b_old"]
    finally:
        os.utime(ckpts["b_old"], (old_mtime,) * 2)


def test_the_text_ends_with_its_newline_before_the_speed_line_on_stderr(runs):
    """Both streams into one pipe, as `python sample.py 2>&1 | less` reads them: stdout block-buffered."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # set here; a user's python buffers
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "sample.py", f"--ckpt={runs[1]['a_new']}", "--prompt=ROMEO:",
                           "--max_new_tokens=30", "--device=cpu"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120,
                          env={**env, "OMP_NUM_THREADS": "1"})  # 2 threads on a busy 2-core CPU: seconds
    assert proc.returncode == 0 and (seconds := re.fullmatch(
        r"ROMEO:[^\[]{30}\n\[30 tokens in (\S+) s, \S+ tokens/s on cpu\]\n", proc.stdout)), proc.stdout
    assert float(seconds[1]) < time.perf_counter() - t0  # seconds, within the program's


def test_greedy_ignores_the_seed_and_the_same_seed_gives_the_same_text(sample_a):
    text = lambda *flags: sample_a("--device=cpu", "--max_new_tokens=40", *flags)[1]
    assert text("--temperature=0", "--seed=1") == text("--temperature=0", "--seed=2")
    assert text("--seed=1") == text("--seed=1") != text("--seed=2")  # the control: sampling does depend on the seed


def test_a_prompt_file_is_the_same_prompt_as_its_text_given_inline(sample_a, tmp_path):
    (path := tmp_path / "prompt.txt").write_text("ROMEO:\nO, ", encoding="utf-8")  # a newline, as files hold
    text = lambda *flags: sample_a("--device=cpu", "--max_new_tokens=20", *flags)
    code, out, _ = text(f"--prompt_file={path}")
    assert code == 0 and out.startswith("ROMEO:\nO, ") and (code, out) == text("--prompt=ROMEO:\nO, ")[:2]


def test_num_samples_are_three_texts_between_dashed_lines_and_top_k_0_means_every_token(sample_a, monkeypatch):
    """Samples from one generator, a dashed line between two; --top_k=0 hands sample_next no top-k (all tokens), and
    --temperature, --top_p, --no_cache and --slide reach generation."""
    code, out, _ = sample_a("--device=cpu", "--prompt=ROMEO:", "--max_new_tokens=10", "--num_samples=3")
    parts = out.removesuffix("\n").split(DASHES)
    assert code == 0 and out.endswith("\n") and len(set(parts)) == 3, parts
    assert all(p.startswith("ROMEO:") and len(p) == len("ROMEO:") + 10 for p in parts), parts
    seen, real = [], model.gpt.sample_next
    monkeypatch.setattr(model.gpt, "sample_next", lambda logits, *args: seen.append(args[:3]) or real(logits, *args))
    for top_k, want in (("0", None), ("5", 5)):
        seen.clear()
        assert sample_a("--max_new_tokens=3", f"--top_k={top_k}", "--temperature=0.5", "--top_p=0.9")[0] == 0
        assert seen == [(0.5, want, 0.9)] * 3, (top_k, seen)
    stream, cached = model.gpt.GPT.stream, []
    monkeypatch.setattr(model.gpt.GPT, "stream", lambda self, *a, **kw:
                        cached.append((kw.get("use_cache"), kw.get("slide"))) or stream(self, *a, **kw))
    assert sample_a("--max_new_tokens=3")[0] == sample_a("--max_new_tokens=3", "--no_cache", "--slide=3")[0] == 0
    assert cached == [(True, 1), (False, 3)]


def test_ctrl_c_while_sampling_keeps_the_text_so_far_and_exits_130_without_a_traceback(sample_a, monkeypatch):
    real, drawn = model.gpt.sample_next, []
    def interrupted(*args):  # the 4th token's draw is where Ctrl-C lands
        if len(drawn) == 3:
            raise KeyboardInterrupt
        return drawn.append(1) or real(*args)
    monkeypatch.setattr(model.gpt, "sample_next", interrupted)
    try:
        code, out, err = sample_a("--prompt=ROMEO:", "--max_new_tokens=10")
    except KeyboardInterrupt:  # not out of the test session
        pytest.fail("Ctrl-C escaped sample.main: the user gets a traceback")
    assert (code, len(out), out[:6]) == (130, len("ROMEO:") + 3, "ROMEO:") and err == "\n[interrupted]\n", err


def test_an_sdpa_run_draws_its_attention_maps_in_tensorboard_and_by_a_bare_attention_png_in_out_dir(tmp_path, capsys):
    """sdpa returns no weights, yet the eval snapshots and --attention_png draw them (every layer, blue cells)."""
    cfg = tiny_config(tmp_path, attn_backend="sdpa", max_iters=2, eval_interval=2, sample_tokens=0, exact_val=False)
    assert run(capsys, train, *argv_for(cfg))[0] == 0
    acc = ea.EventAccumulator(cfg.out_dir, size_guidance={ea.IMAGES: 0}).Reload()
    assert set(acc.Tags()["images"]) == {f"maps/attention_layer_{layer}" for layer in range(cfg.n_layer)}
    assert "sample/text_summary" not in acc.Tags()["tensors"]  # sample_tokens=0: no text sample
    assert run(capsys, sample, f"--out_dir={cfg.out_dir}", "--prompt=ROMEO:", "--attention_png")[0] == 0
    image = Image.open(Path(cfg.out_dir) / "attention.png")
    pixels = np.asarray(image.convert("RGB"))
    assert image.format == "PNG" and ((pixels == HIGH).all(-1) | (pixels[..., 2] > pixels[..., 0] + 60)).sum() > 100


def test_a_prompt_longer_than_block_size_is_continued_and_its_last_block_size_characters_drawn(sample_a, tmp_path):
    """The drawing goes to the path given (its folder made), and is of the prompt's last block_size (16) characters."""
    prompt, pics = TEXT[:40], tmp_path / "pics"
    code, out, _ = sample_a("--device=cpu", f"--prompt={prompt}", "--max_new_tokens=10")
    assert code == 0 and out.startswith(prompt) and len(out) == len(prompt) + 10 + 1
    for name, text in (("long.png", prompt), ("last", prompt[-16:])):  # no suffix: a PNG
        code, out, err = sample_a(f"--prompt={text}", f"--attention_png={pics / name}")
        cropped = " (the last 16 of the prompt's 40 characters)" if text == prompt else ""
        assert code == 0 and out == "" and Image.open(pics / name).format == "PNG"
        assert f"[wrote {pics / name}: 2 layers x 2 heads, 16 x 16{cropped}]" in err  # tiny_config's model
    assert (pics / "long.png").read_bytes() == (pics / "last").read_bytes()


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's modes: x86 builds of PyTorch")
@pytest.mark.parametrize("own", [None, "COMPATIBLE"])
def test_both_programs_put_mkl_in_its_strict_reproducible_mode_before_their_first_matmul(tmp_path, own):
    """Outside it a gemm can depend on the threads MKL takes (the load); train.py and sample.py ask for it unless
    MKL_CBWR is set."""
    cfg = tiny_config(tmp_path, max_iters=1, eval_interval=1, eval_iters=1, exact_val=False, tensorboard=False)
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | {"MKL_VERBOSE": "1"}
    env |= {"MKL_CBWR": own} if own else {}  # a user's own mode is kept
    for program, args in (("train.py", argv_for(cfg)), ("sample.py", [f"--out_dir={cfg.out_dir}", "--device=cpu",
                                                                      "--max_new_tokens=2"])):
        out = subprocess.run([sys.executable, str(ROOT / program), *args], env=env, capture_output=True, text=True,
                             timeout=120).stdout
        assert (modes := set(re.findall(r"CNR:(\S+)", out))) == {own or "AUTO,STRICT"}, (program, modes)


@pytest.mark.parametrize("config", CPU_CONFIGS, ids=lambda p: p.name)
def test_every_cpu_config_trains_with_a_window_and_samples_past_block_size_from_it(config, tmp_path, capsys):
    corpus, out = Path(tiny_config(tmp_path).dataset), tmp_path / "windowed"
    argv = [config, f"--dataset={corpus}", "--attn_window=8", "--batch_size=2", "--max_iters=2", "--eval_interval=2",
            "--eval_iters=1", "--exact_val=false", "--tensorboard=false", f"--out_dir={out}"]
    assert run(capsys, train, *argv)[0] == 0
    assert torch.load(out / CKPT_NAME, weights_only=True)["model_config"]["attn_window"] == 8
    code, text, _ = run(capsys, sample, f"--out_dir={out}", "--prompt=ROMEO:", "--max_new_tokens=150")
    documents = parse_args([str(config)]).documents  # a document may end sooner
    assert code == 0 and (len(text) == len("ROMEO:") + 150 + 1 or documents and text.startswith("ROMEO:"))
    assert sample.SampleConfig().slide == 1  # past block_size: the README's default, nanoGPT's crop every token


def test_a_model_of_lines_samples_whole_documents_each_ending_at_the_separator(tmp_path, capsys):
    """Trained on names, one a line, with the document mask: each sample is a whole name, ending its line (a model of
    paragraphs, whose documents hold line ends, parts its samples by dashed lines)."""
    (names := tmp_path / "names.txt").write_text("\n".join(["anna", "bob", "carla", "dan", "emma", "fred"] * 60) + "\n")
    cfg = tiny_config(tmp_path, dataset=str(names), documents="lines", doc_mask=True, max_iters=80, lr_decay_iters=80,
                      eval_interval=80, tensorboard=False, exact_val=False)
    train.train(cfg, verbose=False)
    code, out, err = run(capsys, sample, f"--out_dir={cfg.out_dir}", "--num_samples=3", "--max_new_tokens=200")
    lines = out.split("\n")
    assert code == 0 and len(lines) == 4 and lines[-1] == "" and "\x1e" not in out, out
    assert f"[{sum(map(len, lines)) + 3} tokens in " in err  # each name's separator was drawn too
    assert all(0 < len(name) < 20 and name.isalpha() for name in lines[:3]), out
    doc_sep = lambda cfg: torch.load(Path(cfg.out_dir) / CKPT_NAME, weights_only=True)["model_config"]["doc_sep"]
    assert doc_sep(cfg) == load_corpus(str(names), documents="lines").tokenizer.stoi["\x1e"]  # doc_mask: masked apart
    code, out, _ = run(capsys, sample, f"--out_dir={cfg.out_dir}", "--prompt=\x1ebob\x1ean", "--num_samples=2")
    lines = out.split("\n")  # a prompt that opens a document is left so; one it holds ends a line
    assert code == 0 and lines[0::2] == ["bob", "bob", ""] and all(s.startswith("an") for s in lines[1::2]), out
    assert sample.load(sample.parse_args([f"--out_dir={cfg.out_dir}", "--prompt=an"], sample.SampleConfig))[2] == \
        "\x1ean"  # a prompt opens a document
    (verses := tmp_path / "verses.txt").write_text("roses are red,\nviolets are blue\n\n" * 100)
    cfg = tiny_config(tmp_path, dataset=str(verses), documents="paragraphs", out_dir=str(tmp_path / "verses"),
                      max_iters=1, eval_interval=1, eval_iters=1, tensorboard=False, exact_val=False)
    train.train(cfg, verbose=False)
    code, out, _ = run(capsys, sample, f"--out_dir={cfg.out_dir}", "--num_samples=3", "--max_new_tokens=20")
    assert code == 0 and out.count(DASHES) == 2 and "\x1e" not in out, out
    assert doc_sep(cfg) is None  # documents without doc_mask: the causal rule alone
    args = sample.parse_args([f"--out_dir={cfg.out_dir}"], sample.SampleConfig)
    assert sample.load(args)[2] == "\x1e"  # its default prompt opens a document, though "\n" is a symbol of it too
