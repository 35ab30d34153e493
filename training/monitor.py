"""One logging path for a run: the progress bar (or plain lines), and TensorBoard events.

TensorBoard (`tensorboard --logdir out`) gets, in the run's out_dir:
    scalars   train/loss, train/loss_estimate, val/loss, val/loss_exact, lr, grad_norm, tokens_per_second,
              mfu (where the device's peak is known)
    text      "sample": a continuation of a fixed prompt at every eval, so quality can be read over time
    images    "attention/layer_L": the attention weights of a fixed prompt, one tile per head, every eval
    hparams   the resolved config as one session, at the end; the HParams tab shows it next to the last
              value of every scalar, so runs compare
The writer starts with purge_step = the first step of this process, so a resumed run (or a fresh run
in an old out_dir) replaces the points from that step on instead of drawing a second curve over them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from data import CharTokenizer, Corpus
from model import GPT

from .config import ATTENTION_PROMPT_CHARS, TrainConfig
from .evaluate import evaluating
from .visualize import prompt_attention, render_attention

if TYPE_CHECKING:  # imported lazily at run time (see RunLog.writer)
    from torch.utils.tensorboard import SummaryWriter


class RunLog:
    """Progress line `step | loss | lr | ms/step | tok/s` plus TensorBoard events.

    On a terminal the line is a tqdm bar; when stderr is not a terminal (CI, a log file) it is
    printed as plain text every log step instead, so logs stay readable. enabled=False is a silent
    log (no console output and no event files: train(verbose=False), and every process but rank 0).
    The writer is created on first use, so importing tensorboard never delays the first step.
    """

    def __init__(self, out_dir: str | Path, total: int, initial: int, tensorboard: bool,
                 enabled: bool = True) -> None:
        """Args:
            out_dir: where the TensorBoard event files go.
            total: the run's last step (max_iters), the bar's end.
            initial: the first step of this process (> 0 when resumed): the bar starts there, and
                TensorBoard drops earlier files' points from it on.
            tensorboard: write event files at all.
            enabled: False for a silent log (see above).
        """
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self.tensorboard = tensorboard and enabled
        self.initial = initial
        self._writer = None
        self._prompts: tuple[list[int], list[int]] | None = None
        self.interactive = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                        disable=not self.interactive, file=sys.stderr)

    @property
    def writer(self) -> SummaryWriter:
        """The TensorBoard writer, created (and tensorboard imported) on first use."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # lazy: ~0.1 s of imports after torch's

            # purge_step: TensorBoard drops points at steps >= initial from earlier event files here
            self._writer = SummaryWriter(log_dir=str(self.out_dir), purge_step=self.initial)
        return self._writer

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Write each name -> value to TensorBoard at this step, as one event (add_scalar would write
        one event per value: ~3x the cost for four values; benchmarks/micro.py)."""
        if self.tensorboard:
            from tensorboard.compat.proto.summary_pb2 import Summary

            summary = Summary(value=[Summary.Value(tag=name, simple_value=float(value))
                                     for name, value in values.items()])
            self._add_summary(summary, step)

    def _add_summary(self, summary: Any, step: int) -> None:
        """Write a prebuilt Summary protobuf at `step`. SummaryWriter has no public call for that, so its
        private file writer is reached here, and only here (one place to mend if torch renames it)."""
        self.writer._get_file_writer().add_summary(summary, step)

    def progress(self, step: int, loss: float, lr: float, ms_per_step: float, tok_per_s: float) -> None:
        """The fixed progress line."""
        if not self.enabled:
            return
        if self.interactive:
            self.bar.set_postfix_str(f"loss {loss:.4f} | lr {lr:.2e} | {ms_per_step:.1f} ms/step | "
                                     f"{tok_per_s:,.0f} tok/s", refresh=False)
        else:
            print(f"step {step:6d} | loss {loss:.4f} | lr {lr:.2e} | {ms_per_step:7.1f} ms/step | "
                  f"{tok_per_s:10,.0f} tok/s", flush=True)

    def advance(self, n: int = 1) -> None:
        """Move the progress bar n steps on."""
        self.bar.update(n)

    def line(self, text: str) -> None:
        """A message that must not be overwritten by the bar."""
        if self.enabled:
            if self.interactive:
                self.bar.write(text, file=sys.stderr)
            else:
                print(text, flush=True)

    def text(self, step: int, tag: str, value: str) -> None:
        """Text shown verbatim (as a preformatted block, so newlines survive TensorBoard's markdown)."""
        if self.tensorboard:
            self.writer.add_text(tag, "\n".join("    " + line for line in value.split("\n")), step)

    def image(self, step: int, tag: str, image: np.ndarray) -> None:
        """An (height, width, 3) uint8 RGB image.

        Encoded to PNG here and written as the same image summary add_image writes: add_image first
        converts the whole image to float32, a transient of ~11 MB for a laptop-recipe image
        (benchmarks/micro.py) that set the run's peak memory.
        """
        if self.tensorboard:
            import io

            from PIL import Image
            from tensorboard.compat.proto.summary_pb2 import Summary

            png = io.BytesIO()
            Image.fromarray(image).save(png, format="PNG", compress_level=1)  # 1.3x faster than level 6 (micro.py)
            h, w, c = image.shape
            value = Summary.Value(tag=tag, image=Summary.Image(height=h, width=w, colorspace=c,
                                                               encoded_image_string=png.getvalue()))
            self._add_summary(Summary(value=[value]), step)

    def snapshot(self, step: int, model: GPT, corpus: Corpus, cfg: TrainConfig) -> None:
        """At an eval: a sample continuation of cfg.sample_prompt (text "sample") and the attention
        heatmaps of cfg.attention_prompt (images "attention/layer_L").

        `model` must be the uncompiled module. It runs in eval mode (no dropout) and is put back in its
        mode; sampling draws from its own generator seeded with cfg.seed on every call, so the global
        RNG and the batch generator are untouched (a resumed run stays bit-identical) and successive
        samples differ only because the model does.
        """
        if not self.tensorboard:
            return
        if self._prompts is None:
            self._prompts = resolve_prompts(cfg, corpus)
        sample_ids, attention_ids = self._prompts
        tok = corpus.tokenizer
        if cfg.sample_tokens > 0:
            device = next(model.parameters()).device
            gen = torch.Generator(device=device).manual_seed(cfg.seed)
            idx = torch.tensor([sample_ids], dtype=torch.long, device=device)
            threads = torch.get_num_threads()
            if device.type == "cpu":
                # one token at a time is latency-bound: extra threads only wait for each other, and on
                # a machine whose cores are busy that made the sample slower and erratic (benchmarks/micro.py:
                # 0.11-0.12 s median, up to 1.1-1.4 s, on two threads vs 0.07-0.09 s on one; idle, within 15%)
                torch.set_num_threads(1)
            try:
                with evaluating(model):
                    new = [int(t) for t in model.stream(idx, cfg.sample_tokens, temperature=1.0, generator=gen)]
            finally:
                torch.set_num_threads(threads)
            self.text(step, "sample", tok.decode(sample_ids) + tok.decode(new))
        maps = prompt_attention(model, attention_ids)
        chars = [tok.chars[i] for i in attention_ids]
        for layer, weights in enumerate(maps):
            self.image(step, f"attention/layer_{layer}", render_attention([weights], chars, [layer]))

    def hparams(self, step: int, hparams: dict[str, Any]) -> None:
        """The resolved config as one HParams session at `step` (the last step of the run).

        Only the session is written, no experiment summary: TensorBoard then builds the HParams table
        from every run's session and takes each scalar's last value (val/loss_exact, val/loss, ...)
        as a metric column, so runs with different configs compare side by side.
        """
        if not self.tensorboard:
            return
        from tensorboard.plugins.hparams.summary_v2 import hparams_pb
        from torch.utils.tensorboard.summary import hparams as torch_hparams

        self._add_summary(hparams_pb(hparams), step)  # TensorBoard's own: keeps bools as bools
        self._add_summary(torch_hparams(hparams, {})[2], step)  # session end: status success

    def close(self) -> None:
        """Close the progress bar and flush and close the TensorBoard writer."""
        self.bar.close()
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()


def resolve_prompts(cfg: TrainConfig, corpus: Corpus) -> tuple[list[int], list[int]]:
    """Token ids of the TensorBoard sample prompt and attention prompt a config asks for.

    sample_prompt '' means a newline, or the first vocabulary character if the corpus has none;
    attention_prompt '' means the first ATTENTION_PROMPT_CHARS characters of the val split (at most
    block_size); a longer attention prompt keeps its last block_size characters.

    Raises:
        ValueError: a prompt has characters outside the corpus vocabulary; names the field and them.
    """
    tok: CharTokenizer = corpus.tokenizer
    sample = cfg.sample_prompt or ("\n" if "\n" in tok.stoi else tok.chars[0])
    attention = cfg.attention_prompt or tok.decode(corpus.val[:min(ATTENTION_PROMPT_CHARS, cfg.block_size)])
    ids = []
    for name, text in (("sample_prompt", sample), ("attention_prompt", attention)):
        try:
            ids.append(tok.encode(text))
        except ValueError as e:
            raise ValueError(f"config field {name}={text!r}: {e} (of {corpus.name})") from None
    return ids[0], ids[1][-cfg.block_size:]
