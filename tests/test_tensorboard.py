"""TensorBoard: a short run's event files, read back with TensorBoard's own reader, hold scalars,
a text sample per eval, attention images per eval and layer, and the config as an HParams session."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from tiny_runs import tiny_config

import train
from data import CharTokenizer, Corpus, load_corpus
from model import GPT
from training import TrainConfig, load_checkpoint, model_from_checkpoint
from training.config import ATTENTION_PROMPT_CHARS
from training.monitor import RunLog, resolve_prompts
from training.visualize import EMPTY, layout_for

EVAL_STEPS = [0, 3, 6]


def read_events(out_dir):
    """The run directory as TensorBoard's server reads it (purging included)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out_dir), size_guidance={"tensors": 0})  # 0 = keep every event
    acc.Reload()
    return acc


def values(acc, tag):
    from tensorboard.util import tensor_util

    return [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]


def sample_texts(acc):
    """The text samples as written, the markdown indentation removed."""
    out = []
    for step, value in values(acc, "sample/text_summary"):
        shown = value.item().decode("utf-8")
        out.append((step, "\n".join(line.removeprefix("    ") for line in shown.split("\n"))))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cfg = tiny_config(tmp_path_factory.mktemp("tb"), always_save_checkpoint=True, sample_prompt="ROMEO:")
    summary = train.train(cfg)  # verbose: a silent run writes no events (pytest captures the lines)
    return cfg, summary, read_events(cfg.out_dir)


def test_event_files_hold_scalars_text_images_and_hparams(run):
    cfg, _, acc = run
    assert {"scalars", "text", "images", "hparams"} <= acc.ActivePlugins()
    scalars = acc.PluginTagToContent("scalars")
    for tag in ("train/loss", "train/loss_estimate", "val/loss", "val/loss_exact", "lr", "grad_norm",
                "tokens_per_second"):
        assert tag in scalars, tag
    assert [s for s, _ in values(acc, "train/loss")] == list(range(cfg.max_iters))
    assert [s for s, _ in values(acc, "val/loss")] == EVAL_STEPS
    assert [s for s, _ in values(acc, "val/loss_exact")] == [cfg.max_iters]
    assert [s for s, _ in sample_texts(acc)] == EVAL_STEPS
    assert sorted(acc.PluginTagToContent("images")) == ["attention/layer_0", "attention/layer_1"]
    assert [s for s, _ in values(acc, "attention/layer_1")] == EVAL_STEPS


def test_hparams_session_holds_the_resolved_config(run):
    from tensorboard.plugins.hparams import metadata

    cfg, _, acc = run
    content = acc.PluginTagToContent("hparams")
    # a session and no experiment summary: TensorBoard builds the table from all runs' sessions
    assert metadata.SESSION_START_INFO_TAG in content and metadata.EXPERIMENT_TAG not in content
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    assert set(start.hparams) == set(cfg.to_dict())
    assert start.hparams["n_layer"].number_value == cfg.n_layer
    assert start.hparams["dataset"].string_value == cfg.dataset
    assert start.hparams["always_save_checkpoint"].bool_value is True
    assert [s for s, _ in values(acc, metadata.SESSION_START_INFO_TAG)] == [cfg.max_iters]


def test_text_sample_is_the_prompt_continued_from_a_generator_seeded_with_cfg_seed(run):
    cfg, _, acc = run
    texts = sample_texts(acc)
    assert all(t.startswith("ROMEO:") and len(t) == len("ROMEO:") + cfg.sample_tokens for _, t in texts)
    # the last sample comes from the final weights (the checkpoint at max_iters) and a fresh
    # Generator seeded with cfg.seed: redrawing it by hand gives the same text
    ckpt = load_checkpoint(f"{cfg.out_dir}/ckpt.pt")
    assert ckpt["step"] == cfg.max_iters
    model, tok = model_from_checkpoint(ckpt)
    model.eval()
    prompt = torch.tensor([tok.encode("ROMEO:")])
    gen = torch.Generator().manual_seed(cfg.seed)
    new = [int(t) for t in model.stream(prompt, cfg.sample_tokens, temperature=1.0, generator=gen)]
    assert texts[-1][1] == "ROMEO:" + tok.decode(new)
    other = torch.Generator().manual_seed(cfg.seed + 1)  # positive control: the seed matters
    new = [int(t) for t in model.stream(prompt, cfg.sample_tokens, temperature=1.0, generator=other)]
    assert texts[-1][1] != "ROMEO:" + tok.decode(new)


def test_attention_images_have_an_empty_upper_triangle(run):
    from PIL import Image

    cfg, _, acc = run
    (_, encoded), *_ = values(acc, "attention/layer_0")
    width, height, png = encoded
    image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    T = min(ATTENTION_PROMPT_CHARS, cfg.block_size)  # the default prompt: the val split's first characters
    layout = layout_for(1, cfg.n_head, T)
    assert image.shape == (int(height), int(width), 3) == (layout.size[1], layout.size[0], 3)
    for head in range(cfg.n_head):
        for q in range(T):
            for k in range(T):
                x0, y0, x1, y1 = layout.cell_box(0, head, q, k)
                cell = image[y0:y1, x0:x1].reshape(-1, 3)
                is_empty = bool((cell == EMPTY).all())
                assert is_empty == (k > q), (head, q, k)


def test_snapshot_leaves_the_global_rng_and_the_model_mode_alone(tmp_path):
    cfg = tiny_config(tmp_path, dropout=0.5)  # dropout would draw from the global RNG in train mode
    corpus = load_corpus(cfg.dataset, cfg.cache_dir)
    model = GPT(cfg.model_config(corpus.tokenizer.vocab_size)).train()
    log = RunLog(tmp_path / "tb", cfg.max_iters, 0, tensorboard=True)
    before = torch.get_rng_state()
    log.snapshot(0, model, corpus, cfg)
    log.close()
    assert torch.equal(torch.get_rng_state(), before) and model.training
    model(torch.zeros(1, 4, dtype=torch.long))  # positive control: a train-mode forward does draw
    assert not torch.equal(torch.get_rng_state(), before)


def test_prompts_fall_back_to_the_vocabulary_and_name_bad_characters(tmp_path):
    cfg = tiny_config(tmp_path)
    corpus = load_corpus(cfg.dataset, cfg.cache_dir)
    sample, attention = resolve_prompts(cfg, corpus)
    assert corpus.tokenizer.decode(sample) == "\n"
    assert corpus.tokenizer.decode(attention) == corpus.tokenizer.decode(corpus.val[:16])  # block 16
    no_newline = Corpus(np.zeros(40, dtype=np.uint16), np.ones(40, dtype=np.uint16), CharTokenizer("ab"), "ab")
    assert resolve_prompts(cfg, no_newline)[0] == [0]  # the first vocabulary character
    with pytest.raises(ValueError, match=r"sample_prompt='JULIET': .*'L', 'T', 'U'"):
        resolve_prompts(cfg.replace(sample_prompt="JULIET"), corpus)


@pytest.mark.parametrize("tensorboard, verbose", [(False, True), (True, False)])
def test_tensorboard_false_or_a_silent_run_writes_no_events(tmp_path, tensorboard, verbose):
    cfg = tiny_config(tmp_path, tensorboard=tensorboard, max_iters=2, exact_val=False)
    train.train(cfg, verbose=verbose)
    assert not any(p.name.startswith("events.out") for p in (tmp_path / "out").iterdir())


def test_config_rejects_negative_sample_tokens():
    with pytest.raises(ValueError, match="sample_tokens must be >= 0"):
        TrainConfig(sample_tokens=-1)
