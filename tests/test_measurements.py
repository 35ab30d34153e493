"""The figures and facts a user reads off a run, pinned to exact values: the device and dtype a run
resolves to, the autocast it computes under, the peak FLOP/s behind MFU, peak memory, the facts in
config.json, bench.py's JSON, the KV-cache benchmark's figures, the attention pictures' colours and
labels, and GPT.generate's argument checks.

Every figure is computed from inputs the test controls (a monkeypatched GPU name, rusage, clock or
training summary), so a wrong unit, a swapped argument, a lookup in the wrong order or a dropped
field fails here on any machine, CPU-only CI included, in a few seconds. The tests were written
against hand-made mutants of the code they guard (mutation testing): each such mutant passed the
rest of the suite and fails here.
"""

from __future__ import annotations

import contextlib
import json
import platform
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import bench
import kv_cache
from model import GPT, GPTConfig
from training import autocast_context, peak_flops, peak_memory_mb, resolve_device, resolve_dtype, run_facts
from training.visualize import EMPTY, HIGH, INVALID, LOW, colour, layout_for, prompt_attention, render_attention

ROOT = Path(__file__).resolve().parent.parent

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


# --- where and in what precision a run computes ----------------------------------------------------

@pytest.mark.parametrize("has_cuda, has_mps, expected", [(True, True, "cuda"), (False, True, "mps"),
                                                         (False, False, "cpu")])
def test_auto_device_is_cuda_then_mps_then_cpu(monkeypatch, has_cuda, has_mps, expected):
    """device=auto on a GPU machine must train on the GPU: CI has none, so availability is faked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: has_mps)
    assert resolve_device("auto") == torch.device(expected)


def test_an_explicit_device_must_exist_on_this_machine(monkeypatch):
    """On a one-GPU machine cuda:0 is fine and cuda:1 is refused up front (not a CUDA error mid-run);
    mps is refused where MPS is missing and accepted where it is there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve_device("cuda") == CUDA
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match=r"device='cuda:1' but this machine has 1 CUDA devices"):
        resolve_device("cuda:1")  # the index equal to the count is the first one that is not there
    with pytest.raises(ValueError, match=r"device='mps' but MPS is not available"):
        resolve_device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("mps") == torch.device("mps")


@pytest.mark.parametrize("bf16_supported, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_cuda_is_bfloat16_only_where_the_gpu_supports_it(monkeypatch, bf16_supported, expected):
    """A GPU without bf16 (V100, T4) gets float32, not an emulated bf16 or float16 (which would need a
    loss scaler the auto path does not choose); explicit names map to their own dtype everywhere."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16_supported)
    assert resolve_dtype("auto", CUDA) == expected
    for device in (CPU, CUDA):
        assert resolve_dtype("float32", device) == torch.float32
        assert resolve_dtype("bfloat16", device) == torch.bfloat16
        assert resolve_dtype("float16", device) == torch.float16  # float16 turns the GradScaler on


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_context_computes_matmuls_in_the_chosen_dtype_on_the_devices_type(dtype):
    """dtype=bfloat16 or float16 must change what the forward computes in: a no-op context (or one for
    another device type, or always bf16) would train in float32 while the summary says otherwise."""
    a, b = torch.ones(4, 4), torch.ones(4, 4)
    with autocast_context(CPU, dtype):
        assert torch.is_autocast_enabled("cpu")
        assert (a @ b).dtype == dtype
    assert (a @ b).dtype == torch.float32  # and only inside the context


def test_autocast_context_is_a_no_op_for_float32():
    context = autocast_context(CPU, torch.float32)
    assert isinstance(context, contextlib.nullcontext)
    with context:
        assert not torch.is_autocast_enabled("cpu")


# --- MFU's denominator and peak memory -------------------------------------------------------------

@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 989.4e12), ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA L40S", 362e12),  # contains "L4": the L40S entry must be found first
    ("NVIDIA L4", 121e12), ("NVIDIA A10G", 70e12), ("NVIDIA GeForce RTX 4090", 165.2e12),
    ("NVIDIA GeForce RTX 3090", 71e12),
    ("NVIDIA H200 141GB HBM3e", 989.4e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("Tesla T4", None), ("Tesla V100-SXM2-16GB", None),  # not listed: no MFU rather than a guessed one
    # a listed name inside another part's name, or a variant with a lower peak: not the listed part
    ("NVIDIA L40", None), ("NVIDIA RTX A1000 Laptop GPU", None), ("NVIDIA GH200 480GB", None),
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA H200 NVL", None),
    ("NVIDIA GeForce RTX 3090 Ti", None), ("NVIDIA GeForce RTX 4090 D", None),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", None),
])
def test_peak_flops_is_the_listed_bf16_peak_of_the_runs_gpu(monkeypatch, name, peak):
    """MFU = achieved / peak: a wrong peak (a typo, a name matched the wrong way round, L40S read as
    L4) makes every MFU figure wrong by that factor. The name is asked of the run's own device."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: asked.append(device) or name)
    assert peak_flops(torch.device("cuda:1")) == peak
    assert asked == [torch.device("cuda:1")]
    assert peak_flops(CUDA, override_tflops=100.0) == 100e12  # an explicit peak wins over the table


def test_peak_flops_override_is_in_tflops_and_a_cpu_has_no_peak():
    assert peak_flops(CPU) is None  # no MFU on a CPU: its peak is not known
    assert peak_flops(CPU, override_tflops=0.0) is None  # 0 means "not given", not a peak of 0
    assert peak_flops(CPU, override_tflops=312.0) == 312e12
    assert peak_flops(CPU, override_tflops=0.5) == 0.5e12


def test_peak_memory_is_this_processs_rss_and_the_cuda_peak_in_mib(monkeypatch):
    """ru_maxrss is in KiB on Linux: 1536 * 1024 KiB is 1536 MiB (not 1572.9 "MB", not 1.5). The CUDA
    figure is the peak PyTorch allocated on the run's device, not what is allocated now, and only a
    CUDA run reports it."""
    import resource

    monkeypatch.setattr(sys, "platform", "linux")  # Linux's units first; macOS's at the end
    usage = {resource.RUSAGE_SELF: 1536 * 1024, resource.RUSAGE_CHILDREN: 7 * 1024}  # KiB, as Linux reports
    monkeypatch.setattr(resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=usage[who]))
    asked = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: asked.append(device) or 3.5 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2**20)  # current, not the peak
    assert peak_memory_mb(CPU) == {"cpu_rss_mb": 1536.0}
    assert asked == []
    assert peak_memory_mb(CUDA) == {"cpu_rss_mb": 1536.0, "cuda_max_allocated_mb": 3.5}
    assert asked == [CUDA]
    monkeypatch.setattr(sys, "platform", "darwin")  # macOS reports ru_maxrss in bytes
    usage[resource.RUSAGE_SELF] = 1536 * 2**20
    assert peak_memory_mb(CPU) == {"cpu_rss_mb": 1536.0}


# --- what produced a run (config.json's "run") -------------------------------------------------------

def _checkout_commit() -> str:
    """This checkout's full commit, asked independently of run_facts; "unknown" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() if head.returncode == 0 and head.stdout.strip() else "unknown"


def test_run_facts_record_the_command_the_versions_and_this_checkouts_full_commit(monkeypatch, tmp_path):
    """Run from another directory (as `python ~/gpt/train.py ...` is), the commit is still the trainer's
    own, in full (a short hash can become ambiguous); argv starts with the program that ran."""
    import numpy

    monkeypatch.chdir(tmp_path)  # not a git repository
    facts = run_facts(["--max_iters=5"])
    assert facts == {"argv": [sys.argv[0], "--max_iters=5"], "python": platform.python_version(),
                     "torch": torch.__version__, "numpy": numpy.__version__, "git_commit": _checkout_commit(),
                     "platform": platform.platform()}
    assert facts["git_commit"] == "unknown" or re.fullmatch("[0-9a-f]{40}", facts["git_commit"])


@pytest.mark.parametrize("git", [
    FileNotFoundError(2, "No such file or directory: 'git'"),  # no git installed
    subprocess.TimeoutExpired(["git", "rev-parse", "HEAD"], 5),  # git hangs (a lock, a slow filesystem)
    subprocess.CompletedProcess(["git"], 128, stdout="", stderr="fatal: not a git repository"),  # a tarball
])
def test_run_facts_commit_is_unknown_where_git_cannot_say(monkeypatch, git):
    """A run must start (and record "unknown") whatever git does, never crash or record an empty string."""
    def fake_run(*args, **kwargs):
        if isinstance(git, BaseException):
            raise git
        return git

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert run_facts([])["git_commit"] == "unknown"


# --- benchmarks/bench.py's JSON ---------------------------------------------------------------------

HISTORY = [  # one entry per eval, as train.train records them
    {"step": 0, "train_loss": 4.0, "val_loss": 4.1, "train_seconds": 0.0, "wall_seconds": 1.0},
    {"step": 100, "train_loss": 1.4, "val_loss": 1.6, "train_seconds": 10.0, "wall_seconds": 12.0},
    {"step": 200, "train_loss": 1.3, "val_loss": 1.5, "train_seconds": 20.0, "wall_seconds": 23.0},
    {"step": 300, "train_loss": 1.2, "val_loss": 1.4, "train_seconds": 30.0, "wall_seconds": 34.0},
]


def test_time_to_target_is_the_first_eval_whose_val_loss_reaches_it():
    """Step 100's *train* loss is under 1.5 first; step 200's val loss equals 1.5 (reached, "<=");
    step 300 is under it too, but later. Train and wall seconds are each the eval's own."""
    assert bench.time_to_target(HISTORY, 1.5) == {"step": 200, "train_seconds": 20.0, "wall_seconds": 23.0}
    assert bench.time_to_target(HISTORY, 4.1) == {"step": 0, "train_seconds": 0.0, "wall_seconds": 1.0}
    assert bench.time_to_target(HISTORY, 1.0) is None  # never reached


def test_bench_json_holds_every_figure_computed_from_the_runs_summary(monkeypatch, tmp_path, capsys):
    """bench.main with train.train replaced by a canned summary of a resumed run (300 steps in all, 200
    of them in this run, 3 s): every field of the JSON is checked. ms/step mean = 1000 * 3 / 200 = 15,
    unlike the median (12.5) and unlike 1000 * 3 / 300; wall time counts from process start-up
    (T_PROCESS, moved 1000 s back), not the loop's own wall clock; --json gets what was printed."""
    summary = {"device": "cpu", "dtype": "float32", "steps": 300, "steps_this_run": 200, "ms_per_step_median": 12.5,
               "train_seconds": 3.0, "tokens_per_second": 4096.0, "wall_seconds": 5.0,
               "peak_memory_mb": {"cpu_rss_mb": 512.0}, "mfu": 0.25, "final_val_loss": 1.45, "best_val_loss": 1.44,
               "params": 1234, "history": HISTORY}
    trained = []

    def fake_train(cfg, argv, verbose=True):
        trained.append(cfg)
        return summary

    monkeypatch.setattr(bench.train, "train", fake_train)
    monkeypatch.setattr(bench, "T_PROCESS", time.perf_counter() - 1000.0)
    out = tmp_path / "bench.json"
    assert bench.main(["--dataset=corpus.txt", "--max_iters=300", "--target_val=1.5", f"--json={out}"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed)
    (cfg,) = trained
    assert cfg.tensorboard is False and not Path(cfg.out_dir).exists()  # a temporary out_dir, deleted after
    wall = result.pop("wall_seconds")
    assert 1000.0 <= wall < 1060.0
    assert result == {
        "config": {k: v for k, v in cfg.to_dict().items() if k not in ("dataset", "cache_dir", "out_dir")},
        "device": "cpu", "dtype": "float32", "steps": 200, "ms_per_step_median": 12.5, "ms_per_step_mean": 15.0,
        "tokens_per_second": 4096.0, "train_seconds": 3.0, "peak_memory_mb": {"cpu_rss_mb": 512.0}, "mfu": 0.25,
        "final_val_loss": 1.45, "best_val_loss": 1.44, "params": 1234,
        "target_val": 1.5, "time_to_target": {"step": 200, "train_seconds": 20.0, "wall_seconds": 23.0},
    }
    assert out.read_text() == printed  # the same text, ending in one newline


# --- benchmarks/kv_cache.py ---------------------------------------------------------------------------

SMALL = dict(n_layer=1, n_head=2, n_embd=16, block_size=16)  # a forward takes well under a millisecond


def fake_clock(monkeypatch, seconds: dict[bool, list[float]], tamper: bool = False) -> list[dict]:
    """Time kv_cache.run's generations with a fake clock: each timed call of GPT.generate (the ones
    given a generator; not the warm-up) advances it by the next of `seconds[use_cache]`. Returns the
    keyword arguments of those calls. With tamper, the uncached path's last token is changed."""
    clock, calls, real = [0.0], [], GPT.generate

    def generate(self, idx, max_new_tokens, **kwargs):
        out = real(self, idx, max_new_tokens, **kwargs)
        if "generator" in kwargs:
            calls.append(kwargs)
            clock[0] += seconds[kwargs["use_cache"]].pop(0)
            if tamper and not kwargs["use_cache"]:
                out = out.clone()
                out[:, -1] = (out[:, -1] + 1) % self.config.vocab_size
        return out

    monkeypatch.setattr(GPT, "generate", generate)
    monkeypatch.setattr(kv_cache, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return calls


def test_kv_cache_benchmark_reports_the_fastest_run_of_each_path(monkeypatch):
    """Three alternating runs per path at known durations (powers of two: the sums are exact). The
    fastest counts (cached 0.25 s, the 2nd; uncached 1 s, the 3rd), tokens/s is new_tokens over it,
    speedup is uncached time over cached time, and both paths are asked for the same tokens: one
    sampled with temperature 1 from same-seeded generators, the same slide, cache on then off."""
    calls = fake_clock(monkeypatch, {True: [0.5, 0.25, 0.375], False: [2.0, 4.0, 1.0]})
    result = kv_cache.run("cpu", new_tokens=20, repeats=3, slide=3, **SMALL)  # 20 > block 16: it slides
    assert [c["use_cache"] for c in calls] == [True, False] * 3
    assert all(c["slide"] == 3 and c["temperature"] == 1.0 for c in calls)
    assert result == {"device": "cpu", "model": GPTConfig(vocab_size=65, attn_backend="sdpa", **SMALL).to_dict(),
                      "new_tokens": 20, "slide": 3, "cached_tokens_per_second": 20 / 0.25,
                      "uncached_tokens_per_second": 20 / 1.0, "speedup": 4.0, "identical_tokens": True,
                      "threads": torch.get_num_threads()}


def test_kv_cache_benchmark_notices_paths_that_disagree_and_exits_1(monkeypatch, capsys):
    """The benchmark is also the cache's correctness check: tokens that differ between the paths must
    show as identical_tokens false and exit status 1 (a comparison of a path with itself would not)."""
    fake_clock(monkeypatch, {True: [1.0], False: [1.0]}, tamper=True)
    assert kv_cache.main(["--small", "--repeats=1", "--new_tokens=5"]) == 1
    assert json.loads(capsys.readouterr().out)["identical_tokens"] is False


def test_kv_cache_small_runs_end_to_end_and_writes_the_json(tmp_path, capsys):
    """The smoke test the help offers (--small: block 64), through main: exit 0 for identical tokens,
    and --json holds exactly what was printed."""
    out = tmp_path / "kv.json"
    assert kv_cache.main(["--small", "--repeats=1", f"--json={out}"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed)
    assert result["model"]["block_size"] == 64 and result["identical_tokens"] is True
    assert out.read_text() == printed


def test_kv_cache_refuses_a_slide_past_the_block_with_status_2(capsys):
    assert kv_cache.main(["--small", "--repeats=1", "--new_tokens=1", "--slide=65"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "error: slide must be an integer in [1, block_size=64], got 65\n"
    assert captured.out == ""


# --- attention pictures -------------------------------------------------------------------------------

def test_colour_maps_each_weight_to_its_documented_colour():
    """0 -> EMPTY; any positive weight, however small, -> at least LOW (never white); 1 -> HIGH;
    the ramp is sqrt (0.25 sits half way, rounded to the nearest value); above 1 is clipped to
    HIGH (no uint8 wrap-around); NaN and +-inf -> INVALID, never a plausible blue."""
    w = np.array([0.0, 1e-30, 0.25, 1.0, 1.5, np.nan, np.inf, -np.inf])
    half = (103, 134, 173)  # LOW + (HIGH - LOW) * sqrt(0.25) = (103, 133.5, 173), 133.5 rounded to even
    expected = np.array([EMPTY, LOW, half, HIGH, HIGH, INVALID, INVALID, INVALID], dtype=np.uint8)
    got = colour(w)
    assert got.dtype == np.uint8
    assert np.array_equal(got, expected)


def test_every_cell_of_the_picture_is_its_own_weights_colour():
    """2 layers x 3 heads of random weights (with an exact 0 and a NaN): each cell of every tile, all
    of its pixels, is colour(weight) of its own (layer, head, query, key): no title, label or border
    drawn over a cell, no axis swapped, no tile drawn from another head's or layer's weights (the
    causal-triangle checks cannot see that: every head's triangle is the same)."""
    gen = torch.Generator().manual_seed(0)
    maps = [torch.rand(3, 5, 5, generator=gen) for _ in range(2)]
    maps[0][1, 2, 4], maps[1][2, 0, 3] = 0.0, float("nan")
    image = render_attention(maps, list("ab c\n"))
    layout = layout_for(2, 3, 5)
    assert image.shape == (layout.size[1], layout.size[0], 3)
    for layer, w in enumerate(maps):
        colours = colour(w.numpy())
        for head in range(3):
            for q in range(5):
                for k in range(5):
                    x0, y0, x1, y1 = layout.cell_box(layer, head, q, k)
                    assert (image[y0:y1, x0:x1] == colours[head, q, k]).all(), (layer, head, q, k)


def test_titles_name_each_layer_and_head_and_the_axes_show_invisible_characters(monkeypatch):
    """The text drawn, recorded: "layer l head h" per tile, with the layer numbers given (TensorBoard
    draws one layer per picture) or 0..L-1; every character once per axis, a newline as "\\n" and a
    space as "·" (drawn raw they would be blank)."""
    from PIL import ImageDraw

    drawn = []
    monkeypatch.setattr(ImageDraw.ImageDraw, "text", lambda self, xy, text, **kwargs: drawn.append(text))
    maps = [torch.full((2, 3, 3), 1 / 3)] * 2
    render_attention(maps, ["a", "\n", " "])
    labels = ["a", "a", "\\n", "\\n", "·", "·"]  # key (above its column), then query (left of its row)
    tiles = [f"layer {layer} head {head}" for layer in range(2) for head in range(2)]
    assert drawn == [text for title in tiles for text in [title, *labels]]
    drawn.clear()
    render_attention(maps[:1], ["a", "\n", " "], layer_ids=[5])
    assert [t for t in drawn if t.startswith("layer")] == ["layer 5 head 0", "layer 5 head 1"]


def test_attention_inputs_that_do_not_fit_are_refused():
    """The wrong number of characters would label the axes wrongly (or only partly); an empty prompt
    has no attention to draw."""
    maps = [torch.full((2, 3, 3), 1 / 3)]
    for chars in (["a", "b"], ["a", "b", "c", "d"]):
        with pytest.raises(ValueError, match=r"render_attention needs L maps of one shape \(H, T, T\) and T "):
            render_attention(maps, chars)
    model = GPT(GPTConfig(vocab_size=5, **SMALL))
    with pytest.raises(ValueError, match=r"an attention prompt needs 1..block_size=16 tokens, got 0"):
        prompt_attention(model, [])


# --- GPT.generate's arguments -------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, max_new_tokens, message", [
    (torch.zeros(2, 0, dtype=torch.long), 3, r"generate needs a \(B, T>=1\) prompt, got shape \(2, 0\)"),
    (torch.zeros(5, dtype=torch.long), 3, r"generate needs a \(B, T>=1\) prompt, got shape \(5,\)"),
    (torch.zeros(1, 2, dtype=torch.long), -1, r"max_new_tokens must be >= 0, got -1"),
])
def test_generate_refuses_a_prompt_that_is_not_b_by_t_and_a_negative_token_count(prompt, max_new_tokens, message):
    """Named errors, not an IndexError deep in the forward or, for -1 tokens, the prompt silently
    returned as if that had been asked for."""
    model = GPT(GPTConfig(vocab_size=5, **SMALL))
    for use_cache in (True, False):
        with pytest.raises(ValueError, match=message):
            model.generate(prompt, max_new_tokens, use_cache=use_cache)


@pytest.mark.parametrize("option, message", [
    ("--repeats=0", "error: --repeats must be >= 1, got 0\n"),  # once a KeyError: no run to report
    ("--new_tokens=0", "error: --new_tokens must be >= 1, got 0\n"),
])
def test_kv_cache_refuses_nothing_to_time_with_status_2(capsys, option, message):
    assert kv_cache.main(["--small", option]) == 2
    assert capsys.readouterr().err == message


def test_bench_refuses_a_target_val_that_is_not_a_number_before_training(monkeypatch, capsys):
    """--target_val is only used after the run: a typo must not cost the whole run and then a
    traceback instead of the JSON."""
    monkeypatch.setattr(bench.train, "train", lambda *args, **kwargs: pytest.fail("trained before checking"))
    assert bench.main([str(ROOT / "configs" / "debug.toml"), "--target_val=1,45"]) == 2
    assert capsys.readouterr().err == "error: --target_val must be a number, got '1,45'\n"


def test_bench_reports_a_bad_option_or_dataset_in_one_line(capsys, tmp_path):
    assert bench.main([str(ROOT / "configs" / "debug.toml"), "--max_iters=abc"]) == 1
    assert capsys.readouterr().err == "error: config key max_iters: 'abc' is not a valid int\n"
    missing = tmp_path / "missing.txt"
    assert bench.main([str(ROOT / "configs" / "debug.toml"), f"--dataset={missing}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: dataset='{missing}'") and err.count("\n") == 1
