"""What may stop a run early, and how it stops safely: SIGINT/SIGTERM, and a loss that is not finite.

A signal is only noted when it arrives; the loop stops at the end of the step it interrupts, so the
checkpoint saved then is a consistent state that --resume continues from. A second stop signal
does what it would have done without train(): a second Ctrl-C exits at once. train.py disarms the
handlers when the loop ends, so during the final save the same holds for the first one after it.

A non-finite loss is noticed without a host sync per step (on a GPU `.item()` every step would stall
the launch queue): each step folds "is this loss finite?" into a device-side tensor holding the first
bad step, which is read only at log steps and before any save. So the run stops naming the exact first
bad step, and no model from that step on is ever saved: the last good checkpoint stays as it was.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType

import torch
from torch import Tensor, nn

NO_STEP = 2**62  # "no bad step yet": larger than any step, so a MIN over steps and ranks keeps real ones
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunGuard:
    """Watches one training run for stop signals and non-finite losses.

    Args:
        device: where the losses live (the first-bad-step flag stays there).
        ckpt_path: the run's checkpoint, named in error messages.
        distributed: True when this process is one rank of several; then poll() agrees with the
            other ranks (one all-reduce at log steps) so every rank stops at the same step.
        announce: print a line to stderr when a signal arrives (rank 0 of a verbose run).

    `float16` (set by the trainer once the dtype is known) adds the bfloat16 hint to the advice.
    """

    def __init__(self, device: torch.device, ckpt_path: str | Path, distributed: bool = False,
                 announce: bool = True) -> None:
        self.ckpt_path = Path(ckpt_path)
        self.distributed = distributed
        self.announce = announce
        self.float16 = False
        self.signum: int | None = None  # the first stop signal received, if any
        self._first_bad = torch.full((), NO_STEP, dtype=torch.int64, device=device)
        self._bad_loss = torch.zeros((), dtype=torch.float32, device=device)
        self._previous: dict[int, object] = {}

    # --- signals -------------------------------------------------------------------------------

    def arm(self) -> None:
        """Install the SIGINT/SIGTERM handlers (remembering the ones they replace).

        Python only lets the main thread set handlers; train() called from another thread runs
        without them, as it would have before.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def disarm(self) -> None:
        """Put back the handlers arm() replaced. Safe to call twice or without arm()."""
        while self._previous:
            sig, handler = self._previous.popitem()
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            if self.announce:
                again = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
                # os.write, not print: a handler that prints while the loop is printing can raise
                # "reentrant call" on the shared buffered stream
                os.write(2, f"\nreceived {signal.Signals(signum).name}: stopping at the end of this step "
                            f"and saving a checkpoint ({again} again to exit at once)\n".encode())
            return
        previous = self._previous.get(signum, signal.SIG_DFL)
        self.disarm()
        if callable(previous):
            previous(signum, frame)  # Python's SIGINT default raises KeyboardInterrupt here
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # the default action, now that our handler is gone: exit

    # --- non-finite losses ---------------------------------------------------------------------

    def observe(self, loss: Tensor, step: int) -> None:
        """Fold one loss into the first-bad-step flag; device ops only, no host sync."""
        loss = loss.detach().float()
        new_bad = ~torch.isfinite(loss) & (self._first_bad == NO_STEP)
        self._first_bad = torch.where(new_bad, step, self._first_bad)
        self._bad_loss = torch.where(new_bad, loss, self._bad_loss)

    def poll(self, step: int, sync: bool) -> int | None:
        """At the end of a step: the signal to stop for, or None.

        Raises FloatingPointError if a loss so far was not finite. A single process checks the signal
        every step (no cost) and reads the loss flag when `sync` (log steps) or before stopping. Ranks
        of a distributed run only look when `sync`, all at the same steps, with one all-reduce, so
        they agree on whether to stop and none is left waiting in a collective.
        """
        if not self.distributed:
            if sync or self.signum is not None:
                self._raise_if_bad(self._first_bad.item(), self._bad_loss.item(), local=True)
            return self.signum
        if not sync:
            return None
        import torch.distributed as dist

        # MIN of (first bad step, -signal) over ranks: the earliest bad step, and any rank's signal
        flags = torch.stack([self._first_bad, torch.tensor(-(self.signum or 0), device=self._first_bad.device)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        first_bad, signum = flags.tolist()
        self._raise_if_bad(first_bad, self._bad_loss.item(), local=first_bad == self._first_bad.item())
        return -signum or None

    def check_before_save(self, model: nn.Module) -> None:
        """Refuse to save a model after a non-finite loss or with non-finite weights (one host sync).

        Raises:
            FloatingPointError: naming the first bad step; the checkpoint on disk is left as it is.
        """
        self._raise_if_bad(self._first_bad.item(), self._bad_loss.item(), local=True)
        finite = torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all()
        if not finite.item():
            raise FloatingPointError(f"the model's weights are no longer finite; stopped without saving: "
                                     f"{self.kept()}. {self._advice()}")

    def _raise_if_bad(self, first_bad: int, bad_loss: float, local: bool) -> None:
        if first_bad == NO_STEP:
            return
        what = f"loss is {bad_loss}" if local else "loss is not finite (on another rank)"
        raise FloatingPointError(f"{what} at step {first_bad}; stopped without saving anything from that "
                                 f"step on: {self.kept()}. {self._advice()}")

    def kept(self) -> str:
        """What a run stopped for a non-finite loss leaves on disk, for its error message."""
        if self.ckpt_path.exists():
            return f"{self.ckpt_path} is untouched"
        return f"no checkpoint was written ({self.ckpt_path} does not exist)"

    def _advice(self) -> str:
        return "Try a lower learning_rate or grad_clip > 0" + (
            ", or dtype=bfloat16 instead of float16." if self.float16 else ".")


def signal_name(signum: int) -> str:
    """2 -> 'SIGINT'."""
    return signal.Signals(signum).name


def exit_code(name: str) -> int:
    """The shell's exit status for a process stopped by signal `name`: 128 + its number (SIGINT: 130)."""
    return 128 + signal.Signals[name].value
