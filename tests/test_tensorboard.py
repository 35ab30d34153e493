"""What TensorBoard shows, read back by its own reader: scalars at their steps, a text sample and attention images
at every eval, the HParams experiment and session, and a resumed run replacing the points it replays."""

import contextlib
import io
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.plugins.hparams import api_pb2, metadata

import train
from data import SEPARATOR, load_corpus
from reference import rule_grid
from tiny import ROOT, TEXT, ctrl_c_in_batch, tiny_config
from training import CKPT_NAME, parse_args
from training.visualize import BLACK, EMPTY, HIGH, INVALID, LOW, colour, layout_for, render_attention

RECIPE = parse_args([str(ROOT / "configs" / "shakespeare_char_cpu_fast.toml")])  # the fast CPU recipe
QUIET = contextlib.redirect_stdout(io.StringIO())  # a verbose run (the only kind that writes events), swallowed
events = lambda out_dir: ea.EventAccumulator(  # as TensorBoard reads it, every event kept (not 4 images)
    out_dir, size_guidance={ea.SCALARS: 0, ea.IMAGES: 0, ea.TENSORS: 0}).Reload()
steps = lambda acc, tag: [e.step for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    (folder := tmp_path_factory.mktemp("tb")).joinpath("corpus.txt").write_text(TEXT * 100 + TEXT[:50])  # val: not
    cfg = tiny_config(folder, max_iters=16, sample_tokens=8,  # train's first characters; finished; evaluated as often,
                      eval_interval=16 * RECIPE.eval_interval // RECIPE.max_iters,  # for its length, as the recipe
                      log_interval=3, peak_tflops=1.0, block_size=40)  # an MFU; maps cut to ATTENTION_CHARS
    with QUIET:
        train.train(cfg)
    return cfg, events(cfg.out_dir)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Ctrl-C in step 4, then --resume from the step-3 checkpoint (the stop's save lost): steps 3, 4 logged twice."""
    cfg = tiny_config(tmp_path_factory.mktemp("resume"), always_save_checkpoint=True, sample_tokens=0)
    ckpt = Path(cfg.out_dir) / CKPT_NAME
    with QUIET:  # the 5th batch is step 4's; ckpt.pt is then the step-3 eval's save
        stopped = ctrl_c_in_batch(5, cfg, before=lambda: ckpt.with_name("step3.pt").write_bytes(ckpt.read_bytes()))
    before = events(cfg.out_dir)
    ckpt.with_name("step3.pt").replace(ckpt)
    first = min(Path(cfg.out_dir).glob("events.out.tfevents.*")).name.split(".")[3]  # its file's creation second
    time.sleep(max(0.0, int(first) + 1 - time.time()))  # the next file must sort after it (uid 10 sorts before 9)
    t_resume = time.time()
    with QUIET:
        train.train(cfg.replace(resume=True))
    return cfg, stopped, before, t_resume, events(cfg.out_dir)


def test_scalars_are_written_at_every_step_and_every_eval_and_the_fast_cpu_recipe_evaluates_at_least_8_times(run):
    cfg, acc = run
    every, evals = range(cfg.max_iters), sorted({*range(0, cfg.max_iters, cfg.eval_interval), cfg.max_iters})
    logs = sorted({*range(0, cfg.max_iters, cfg.log_interval), cfg.max_iters - 1})  # the progress lines' steps
    expected = {"loss/train": logs, "optim/lr": every, "optim/grad_norm": logs, "speed/tokens_per_second": logs,
                "speed/mfu": logs, "loss/val": evals, "loss/train_estimate": evals, "loss/val_bpc": evals,
                "loss/val_exact": [cfg.max_iters], "loss/val_bpc_exact": [cfg.max_iters]}
    for tag, want in expected.items():
        assert steps(acc, tag) == list(want), tag
    assert all(math.isclose(e.value, train.lr_at(e.step, cfg), rel_tol=1e-6) for e in acc.Scalars("optim/lr"))
    # the tiny run evaluates at the recipe's eval_interval / max_iters
    assert RECIPE.max_iters // RECIPE.eval_interval + 1 >= 8 and len(evals) >= 8, "the recipe evaluates < 8 times"


def test_the_estimates_are_the_summarys_and_bits_per_character_the_loss_over_ln_2(run):
    cfg, acc = run
    written = json.loads((Path(cfg.out_dir) / "summary.json").read_text())
    for tag, key in (("loss/val", "val_loss"), ("loss/train_estimate", "train_loss")):
        assert [e.value for e in acc.Scalars(tag)] == pytest.approx([h[key] for h in written["history"]]), tag
    for loss, bpc in (("loss/val", "loss/val_bpc"), ("loss/val_exact", "loss/val_bpc_exact")):
        pairs = list(zip(acc.Scalars(loss), acc.Scalars(bpc), strict=True))
        assert pairs and all(math.isclose(b.value, a.value / math.log(2), rel_tol=1e-6) for a, b in pairs)
    assert math.isclose(written["final_val_bpc"], written["final_val_loss"] / math.log(2), rel_tol=1e-12)
    # an eval's training seconds: the training clock's (no set-up, no evals), not the wall clock's
    assert all(h["train_seconds"] < h["wall_seconds"] for h in written["history"])
    assert written["history"][-1]["train_seconds"] <= written["train_seconds"]
    assert math.isclose(acc.Scalars("loss/val_exact")[0].value, written["final_val_loss"], rel_tol=1e-6)


def test_a_text_sample_continuing_a_newline_and_attention_images_leaving_the_future_white_come_at_every_eval(run):
    cfg, acc = run
    samples = acc.Tensors("sample/text_summary")
    assert [e.step for e in samples] == steps(acc, "loss/val")
    for e in samples:
        lines = e.tensor_proto.string_val[0].decode().split("\n")  # each in a markdown code block: verbatim
        text = "\n".join(line.removeprefix("    ") for line in lines)
        assert all(line.startswith("    ") for line in lines) and text[0] == "\n" and len(text) == 1 + cfg.sample_tokens
    # attention images: one tag per layer
    assert set(acc.Tags()["images"]) == {f"maps/attention_layer_{layer}" for layer in range(cfg.n_layer)}
    T = min(train.ATTENTION_CHARS, cfg.block_size)  # the val split's first characters
    lay, hidden = layout_for(1, cfg.n_head, T), ~rule_grid(T, T, cfg.attn_window).numpy()  # the rule's hidden keys
    corpus, (x0, y0) = load_corpus(cfg.dataset), lay.origin(0, 0)
    keys = np.s_[y0 - lay.label:y0, x0:x0 + T * lay.cell]  # the key labels above a tile: the val text's characters
    labels = render_attention([torch.zeros(cfg.n_head, T, T)], [corpus.tokenizer.chars[i] for i in corpus.val[:T]])
    for layer in range(cfg.n_layer):
        images = acc.Images(f"maps/attention_layer_{layer}")
        assert [e.step for e in images] == steps(acc, "loss/val")
        for e in images:
            image = np.asarray(Image.open(io.BytesIO(e.encoded_image_string)).convert("RGB"))
            assert image.shape == (lay.size[1], lay.size[0], 3) and (image[keys] == labels[keys]).all()
            for head in range(cfg.n_head):
                x, y = lay.origin(0, head)
                cells = image[y:y + T * lay.cell, x:x + T * lay.cell].reshape(T, lay.cell, T, lay.cell, 3)
                white = (cells == EMPTY).all(axis=(1, 3, 4))  # (queries, keys)
                assert (white == hidden).all(), (layer, head, e.step)  # and no allowed key is white
    assert not (colour(np.array([1e-300, 1e-6])) == EMPTY).all(-1).any()  # however small, a weight > 0 is not white


def test_the_maps_geometry_ramp_and_titles():
    """Cells of 2..14 px, labelled from 8 (T <= 64); a quarter weight half-way up the sqrt ramp, NaN and inf red; tile
    titles name the layer given (TensorBoard draws layer l alone, as layer_ids=[l]); maps of other shapes refused."""
    assert [(lay.cell, lay.label > 0) for lay in map(lambda T: layout_for(1, 1, T), (36, 64, 65, 300))] == [
        (14, True), (8, True), (7, False), (2, False)]
    assert (colour(np.array([0.25])) == np.rint(np.add(LOW, HIGH) / 2)).all()
    maps, two = [torch.full((1, 2, 2), 0.5)], layout_for(2, 1, 2)
    (x0, y0), (x1, y1) = layout_for(1, 1, 2).origin(0, 0), two.origin(1, 0)
    title = lambda image, x, y: image[y - two.label - two.title:y - two.label, x - two.label:x + 2 * two.cell]
    assert (title(render_attention(maps, "ab", [1]), x0, y0) == title(render_attention(maps * 2, "ab"), x1, y1)).all()
    assert (colour(np.array([np.nan, np.inf])) == INVALID).all()  # a bug, made visible
    scale = render_attention(maps, "ab")[-two.scale:].astype(int)  # below the tiles: the ramp, its ticks, their labels
    ink = ~(scale == EMPTY).all(-1)
    ticks = next(r for r in range(len(scale)) if ink[r].any() and (scale[r][ink[r]] == BLACK).all())  # first black row
    columns = np.flatnonzero(ink[ticks])
    assert np.abs(scale[ticks - 5, columns] - colour(np.array([0.01, 0.1, 0.5, 1.0]))).max() <= 2  # each its colour
    for bad in ([], [torch.full((1, 1, 2), 0.5)], [maps[0], torch.full((2, 2, 2), 0.5)]):  # not L maps (H, T, T)
        with pytest.raises(ValueError, match=r"need L >= 1 maps \(H, T, T\) for T = 2 chars"):
            render_attention(bad, "ab")


def test_hparams_declare_metrics_and_hparams_name_the_session_by_out_dir_and_end_it_as_the_run_ends(run, resumed):
    cfg, acc = run
    content = acc.PluginTagToContent("hparams")
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    assert {h.name for h in experiment.hparam_infos} == {"n_layer", "n_embd", "learning_rate"}
    assert {m.name.tag for m in experiment.metric_infos} == {"loss/val_exact", "loss/val"}
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    assert start.group_name == Path(cfg.out_dir).name  # short: the table shows it whole
    assert start.hparams["n_layer"].number_value == cfg.n_layer and start.hparams["optimizer"].string_value == "adamw"
    assert sorted(acc.Tags()["scalars"] + acc.Tags()["images"])[0].startswith("loss/")  # TensorBoard's A-Z: loss first
    _, stopped, before, _, after = resumed  # a finished run ends its session with success, an interrupted one not
    assert stopped["interrupted"] == "SIGINT"
    for one, finished in ((acc, True), (before, False), (after, True)):
        content = one.PluginTagToContent("hparams")
        ends = [metadata.parse_session_end_info_plugin_data(v).status for t, v in content.items()
                if t == metadata.SESSION_END_INFO_TAG]
        assert metadata.SESSION_START_INFO_TAG in content and ends == ([api_pb2.STATUS_SUCCESS] if finished else [])


def test_a_resumed_run_leaves_one_point_per_step(resumed):
    cfg, _, before, t_resume, after = resumed
    assert steps(before, "loss/train") == [0, 1, 2, 3, 4]  # the stopped run logged past its checkpoint (3)
    assert steps(after, "loss/train") == list(range(cfg.max_iters)) and steps(after, "loss/val") == [0, 3, 6]
    assert all(e.wall_time >= t_resume for e in after.Scalars("loss/train") if e.step >= 3)  # the replayed ones


def test_the_text_sample_draws_from_its_own_generator_so_the_weights_do_not_depend_on_it(tmp_path):
    """With dropout, runs with a sample at every eval, with none, and without TensorBoard end bit-identical."""
    weights = []
    for name, extra in (("sample", dict(sample_tokens=24)), ("no_sample", dict(sample_tokens=0)),
                        ("no_tensorboard", dict(tensorboard=False))):
        cfg = tiny_config(tmp_path, out_dir=str(tmp_path / name), dropout=0.2, max_iters=4, eval_interval=2, **extra)
        with QUIET:
            train.train(cfg)
        weights.append(torch.load(Path(cfg.out_dir) / CKPT_NAME, weights_only=True)["model"])
    assert all(torch.equal(w[k], weights[0][k]) for w in weights[1:] for k in w)


def test_the_text_sample_of_a_model_of_documents_opens_a_document(tmp_path, monkeypatch):
    """It starts from the separator, not a newline (paragraphs hold both, and "\\n" sorts first)."""
    starts, real = [], train.GPT.stream
    monkeypatch.setattr(train.GPT, "stream", lambda model, idx, *a, **k: starts.append(idx.item()) or
                        real(model, idx, *a, **k))
    (tmp_path / "paragraphs.txt").write_text("A line,\nanother.\n\nA second one.\n\n" * 50)
    cfg = tiny_config(tmp_path, dataset=str(tmp_path / "paragraphs.txt"), documents="paragraphs", max_iters=2,
                      eval_interval=1, exact_val=False)
    with QUIET:
        train.train(cfg)
    assert starts == [load_corpus(cfg.dataset, documents="paragraphs").tokenizer.stoi[SEPARATOR]] * 3
