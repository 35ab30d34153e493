"""One logging path for a run: the progress bar (or plain lines), and TensorBoard events."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm


class RunLog:
    """Progress line `step | loss | lr | ms/step | tok/s` plus TensorBoard scalars.

    On a terminal the line is a tqdm bar; when stderr is not a terminal (CI, a log file) it is
    printed as plain text every log step instead, so logs stay readable. The TensorBoard writer is
    created on first use, so importing tensorboard never delays the first training step.
    """

    def __init__(self, out_dir: str | Path, total: int, initial: int, tensorboard: bool,
                 enabled: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self.tensorboard = tensorboard and enabled
        self._writer = None
        self.interactive = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                        disable=not self.interactive, file=sys.stderr)

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # lazy: ~0.3 s of imports

            self._writer = SummaryWriter(log_dir=str(self.out_dir))
        return self._writer

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Write each name -> value to TensorBoard at this step."""
        if self.tensorboard:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

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
        self.bar.update(n)

    def line(self, text: str) -> None:
        """A message that must not be overwritten by the bar."""
        if self.enabled:
            if self.interactive:
                self.bar.write(text, file=sys.stderr)
            else:
                print(text, flush=True)

    def text(self, step: int, tag: str, value: str) -> None:
        if self.tensorboard:
            self.writer.add_text(tag, value, step)

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
        if self.tensorboard:
            self.writer.add_hparams(hparams, metrics, run_name=".")

    def close(self) -> None:
        self.bar.close()
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
