"""sample.py in-process on a briefly trained checkpoint: the attention PNG shows the causal triangle,
greedy decoding, top-k/top-p, --prompt_file, --num_samples, --slide, --no_cache, streaming and --help."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_runs import TEXT, tiny_config

import sample
import train
from training import load_checkpoint, model_from_checkpoint
from training.visualize import EMPTY, layout_for, prompt_attention, render_attention

PROMPT = "ROMEO:\nBut, soft"  # newline and spaces on the axes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = tiny_config(tmp_path_factory.mktemp("sample"), max_iters=10, eval_interval=5, tensorboard=False,
                      exact_val=False, always_save_checkpoint=True)
    train.train(cfg, verbose=False)
    path = f"{cfg.out_dir}/ckpt.pt"
    assert load_checkpoint(path)["step"] == 10  # trained, not freshly initialised
    return path


def run(ckpt, *flags: str) -> list[str]:
    """sample.sample with these flags; returns the texts and checks they were streamed to `out`."""
    out = io.StringIO()
    texts = sample.sample(sample.build_parser().parse_args(["--ckpt", ckpt, "--device=cpu", *flags]), out)
    assert out.getvalue() == ("\n" + "-" * 40 + "\n").join(texts) + "\n"
    return texts


def empty_cells(image: np.ndarray, n_layers: int, n_heads: int, T: int) -> np.ndarray:
    """(L, H, T, T) bool: which cells of a render_attention picture are drawn in the EMPTY colour."""
    layout = layout_for(n_layers, n_heads, T)
    assert image.shape[:2] == (layout.size[1], layout.size[0])
    empty = np.zeros((n_layers, n_heads, T, T), dtype=bool)
    for layer in range(n_layers):
        for head in range(n_heads):
            for q in range(T):
                for k in range(T):
                    x0, y0, x1, y1 = layout.cell_box(layer, head, q, k)
                    empty[layer, head, q, k] = (image[y0:y1, x0:x1] == EMPTY).all()
    return empty


def test_attention_png_of_a_trained_checkpoint_shows_the_causal_triangle(ckpt, tmp_path):
    from PIL import Image

    png = tmp_path / "pics" / "attention.png"
    assert sample.main(["--ckpt", ckpt, "--device=cpu", f"--prompt={PROMPT}", f"--attention_png={png}"]) == 0
    image = np.asarray(Image.open(png).convert("RGB"))
    model, tok = model_from_checkpoint(load_checkpoint(ckpt))
    weights = prompt_attention(model, tok.encode(PROMPT))  # what the PNG was drawn from
    T, L, H = len(PROMPT), model.config.n_layer, model.config.n_head
    above = torch.ones(T, T, dtype=torch.bool).triu(1)  # key after query
    for w in weights:
        assert w.shape == (H, T, T)
        assert (w[:, above] == 0).all()  # exactly 0, not merely small
        assert (w[:, ~above] > 0).all()  # the diagonal and the past are read
    expected = above.expand(L, H, T, T).numpy()
    assert (empty_cells(image, L, H, T) == expected).all()  # white exactly above the diagonal
    # positive control: uniform (non-causal) weights drawn the same way leave no cell empty
    uniform = render_attention([torch.full((H, T, T), 1 / T)] * L, list(PROMPT))
    assert not empty_cells(uniform, L, H, T).any()


def test_greedy_ignores_the_seed_and_is_the_argmax_continuation(ckpt):
    a = run(ckpt, "--prompt=ROMEO:", "--temperature=0", "--max_new_tokens=30", "--seed=1")
    b = run(ckpt, "--prompt=ROMEO:", "--temperature=0", "--max_new_tokens=30", "--seed=2")
    assert a == b
    model, tok = model_from_checkpoint(load_checkpoint(ckpt))
    model.eval()
    ids = model.generate(torch.tensor([tok.encode("ROMEO:")]), 30, temperature=0)[0].tolist()
    assert a[0] == tok.decode(ids)
    # positive control: with sampling on, the seed does matter
    c = run(ckpt, "--prompt=ROMEO:", "--temperature=1", "--top_k=0", "--max_new_tokens=30", "--seed=1")
    d = run(ckpt, "--prompt=ROMEO:", "--temperature=1", "--top_k=0", "--max_new_tokens=30", "--seed=2")
    assert c != d and c != a


def test_tiny_top_p_and_top_k_one_keep_only_the_likeliest_token(ckpt):
    greedy = run(ckpt, "--prompt=ROMEO:", "--temperature=0", "--max_new_tokens=30")
    assert run(ckpt, "--prompt=ROMEO:", "--temperature=1", "--top_k=0", "--top_p=1e-6", "--max_new_tokens=30") \
        == greedy
    assert run(ckpt, "--prompt=ROMEO:", "--temperature=1", "--top_k=1", "--max_new_tokens=30") == greedy
    assert run(ckpt, "--prompt=ROMEO:", "--temperature=1", "--top_k=0", "--top_p=1", "--max_new_tokens=30") \
        != greedy  # positive control: top_p = 1 samples from everything


def test_prompt_file_is_read_verbatim(ckpt, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT, encoding="utf-8")
    from_file = run(ckpt, f"--prompt_file={path}", "--max_new_tokens=20", "--seed=3")
    assert from_file[0].startswith(PROMPT)
    assert from_file == run(ckpt, f"--prompt={PROMPT}", "--max_new_tokens=20", "--seed=3")
    with pytest.raises(ValueError, match="--prompt_file: cannot read .*missing.txt: No such file"):
        run(ckpt, f"--prompt_file={tmp_path / 'missing.txt'}")


def test_num_samples_are_separated_and_continue_one_generator(ckpt):
    texts = run(ckpt, "--prompt=ROMEO:", "--num_samples=3", "--max_new_tokens=25", "--seed=5")
    assert len(texts) == 3 and all(t.startswith("ROMEO:") and len(t) == len("ROMEO:") + 25 for t in texts)
    assert len(set(texts)) == 3  # each sample draws on from the same seeded generator
    assert run(ckpt, "--prompt=ROMEO:", "--num_samples=1", "--max_new_tokens=25", "--seed=5") == texts[:1]


def test_characters_stream_out_one_by_one_and_speed_goes_to_stderr(ckpt, capsys):
    class Recorder(io.StringIO):
        flushes = 0

        def flush(self):
            self.flushes += 1

    out = Recorder()
    sample.sample(sample.build_parser().parse_args(["--ckpt", ckpt, "--device=cpu", "--max_new_tokens=12"]), out)
    assert out.flushes == 12  # one flush per generated character
    assert "tokens/s" in capsys.readouterr().err


@pytest.mark.parametrize("flag, message", [("--temperature=-1", "--temperature must be a finite number >= 0"),
                                           ("--top_k=-1", "--top_k must be >= 0"),
                                           ("--top_p=0", r"--top_p must be in \(0, 1\]"),
                                           ("--top_p=1.5", r"--top_p must be in \(0, 1\]"),
                                           ("--slide=0", "--slide must be >= 1"),
                                           ("--slide=1000", "--slide must be at most the model's block_size")])
def test_bad_sampling_flags_are_refused_before_anything_is_printed(ckpt, flag, message):
    out = io.StringIO()
    with pytest.raises(ValueError, match=message):
        sample.sample(sample.build_parser().parse_args(["--ckpt", ckpt, flag]), out)
    assert out.getvalue() == ""


def test_a_sliding_window_gives_the_same_text_with_and_without_the_cache(ckpt):
    """120 characters run far past the checkpoint's block_size: with --slide=5 the cached path
    re-prefills every fifth token and the uncached one recomputes the same windows."""
    flags = ("--prompt=ROMEO:", "--max_new_tokens=120", "--seed=7", "--temperature=1", "--top_k=0")
    slid = run(ckpt, *flags, "--slide=5")
    assert slid == run(ckpt, *flags, "--slide=5", "--no_cache")
    assert slid != run(ckpt, *flags)  # the windows past block_size differ from --slide=1's


def test_help_lists_every_option_with_its_default():
    parser = sample.build_parser()
    text = parser.format_help()
    options = [a for a in parser._actions if a.dest != "help"]
    for action in options:
        assert action.option_strings[0] in text
    assert text.count("(default:") == len(options)


def test_a_reader_that_stops_early_ends_sampling_quietly(ckpt):
    """`python sample.py | head -c 20`: once head exits, the next write hits a closed pipe. That must
    end the run without a traceback, however many tokens were still to come."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "sample.py", f"--ckpt={ckpt}", "--device=cpu", "--num_samples=50",
                             "--max_new_tokens=500"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = proc.stdout.read(20)
    proc.stdout.close()  # what head does when it has its 20 bytes
    _, err = proc.communicate(timeout=120)
    assert len(head) == 20
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert proc.returncode == 1


def test_slide_may_equal_block_size_and_zero_new_tokens_echo_the_prompt(ckpt):
    """Catches (--slide=block_size refused) and (--max_new_tokens=0 refused)."""
    assert len(run(ckpt, "--prompt=ROMEO:", "--max_new_tokens=30", "--slide=16")[0]) == 36
    assert run(ckpt, "--prompt=ROMEO:", "--max_new_tokens=0") == ["ROMEO:"]


def test_no_cache_reaches_the_model(ckpt, monkeypatch):
    """Catches (--no_cache ignored; the cache/no-cache equality test then compares a path with itself)."""
    seen = []
    real = sample.GPT.stream
    monkeypatch.setattr(sample.GPT, "stream", lambda self, *a, **k: seen.append(k["use_cache"]) or real(self, *a, **k))
    run(ckpt, "--max_new_tokens=3", "--no_cache")
    run(ckpt, "--max_new_tokens=3")
    assert seen == [False, True]


def test_the_empty_prompt_is_refused_by_name(ckpt):
    """Catches (`if not prompt` -> `if prompt is None`: a shape error from the model instead)."""
    with pytest.raises(ValueError, match="the prompt is empty"):
        run(ckpt, "--prompt=")


@pytest.mark.parametrize("length", [17, 40])
def test_attention_png_of_a_long_prompt_draws_its_last_block_size_characters(ckpt, tmp_path, length):
    """Catches (the first block_size characters drawn) and (a prompt of block_size + 1 not cut)."""
    prompt = TEXT[:length]
    assert sample.main(["--ckpt", ckpt, "--device=cpu", f"--prompt={prompt}", f"--attention_png={tmp_path}/a.png"]) == 0
    assert sample.main(["--ckpt", ckpt, "--device=cpu", f"--prompt={prompt[-16:]}",
                        f"--attention_png={tmp_path}/b.png"]) == 0
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
