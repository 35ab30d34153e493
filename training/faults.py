"""What may stop a run early, and how it stops safely: SIGINT/SIGTERM, and a loss that is not finite.

A signal is only noted when it arrives; the run stops at the end of the step it interrupts (or at
the next batch of an evaluation, which is then dropped), so the checkpoint saved is the state of the
last completed step. A second signal does what it would have done without us: Ctrl-C exits at once.

A non-finite loss is noticed without a host read per step (on a GPU that would stall the launch
queue): each step folds "is this loss finite?" into a device-side first-bad-step flag, read at log
steps and before any save, so the run names the first bad step and never saves a model from it on.
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


class RunGuard:
    """Watches one run for stop signals and non-finite losses.

    Args:
        device: where the losses live (the flag stays there).
        ckpt_path: the run's checkpoint, named in error messages.
        distributed: one rank of several: poll() then agrees with the others (one all-reduce at log steps).
        announce: print a line when a signal arrives.
    """

    def __init__(self, device: torch.device, ckpt_path: str | Path, distributed: bool = False,
                 announce: bool = True) -> None:
        self.ckpt_path, self.distributed, self.announce = Path(ckpt_path), distributed, announce
        self.float16 = False  # set by the trainer: adds the bfloat16 hint to the advice
        self.signum: int | None = None  # the first stop signal received
        self._first_bad = torch.full((), NO_STEP, dtype=torch.int64, device=device)
        self._bad_loss = torch.zeros((), dtype=torch.float32, device=device)
        self._previous: dict[int, object] = {}

    def arm(self) -> None:
        """Install the SIGINT/SIGTERM handlers (only the main thread may)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def disarm(self) -> None:
        """Put back the handlers arm() replaced; safe to call twice."""
        while self._previous:
            signal.signal(*self._previous.popitem())

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            if self.announce:  # os.write: print from a handler can raise "reentrant call"
                name = signal.Signals(signum).name
                again = "Ctrl-C" if signum == signal.SIGINT else name
                os.write(2, f"\nreceived {name}: stopping at the end of this step and saving a checkpoint "
                            f"({again} again to exit at once)\n".encode())
            return
        previous = self._previous.get(signum, signal.SIG_DFL)
        self.disarm()
        if callable(previous):
            previous(signum, frame)  # Python's SIGINT default raises KeyboardInterrupt here
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)

    def stopping(self) -> bool:
        """A stop signal has arrived (polled inside evaluations; a distributed run finishes them instead,
        since the other ranks wait for rank 0 in the next step's all-reduce)."""
        return self.signum is not None and not self.distributed

    def observe(self, loss: Tensor, step: int) -> None:
        """Fold one loss into the first-bad-step flag: device ops only, no host read."""
        loss = loss.detach().float()
        new_bad = ~torch.isfinite(loss) & (self._first_bad == NO_STEP)
        self._first_bad = torch.where(new_bad, step, self._first_bad)
        self._bad_loss = torch.where(new_bad, loss, self._bad_loss)

    def poll(self, sync: bool) -> int | None:
        """At the end of a step: the signal to stop for, or None; raises FloatingPointError if a loss so
        far was not finite. A single process reads the flag at `sync` (log) steps or before stopping;
        ranks of a distributed run look only at `sync` steps, all together, so they agree to stop."""
        if not self.distributed:
            if sync or self.signum is not None:
                self._raise_if_bad(self._first_bad.item(), local=True)
            return self.signum
        if not sync:
            return None
        import torch.distributed as dist

        flags = torch.stack([self._first_bad, torch.tensor(-(self.signum or 0), device=self._first_bad.device)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # the earliest bad step, and any rank's signal
        first_bad, signum = flags.tolist()
        self._raise_if_bad(first_bad, local=first_bad == self._first_bad.item())
        return -signum or None

    def check_before_save(self, model: nn.Module) -> None:
        """Refuse to save after a non-finite loss, or with non-finite weights (one host read)."""
        self._raise_if_bad(self._first_bad.item(), local=True)
        if not torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all().item():
            raise FloatingPointError(f"the model's weights are no longer finite; stopped without saving: "
                                     f"{self.kept()}. {self._advice()}")

    def _raise_if_bad(self, first_bad: int, local: bool) -> None:
        if first_bad != NO_STEP:
            what = f"loss is {self._bad_loss.item()}" if local else "loss is not finite (on another rank)"
            raise FloatingPointError(f"{what} at step {first_bad}; stopped without saving anything from that "
                                     f"step on: {self.kept()}. {self._advice()}")

    def kept(self) -> str:
        """What a run stopped for a non-finite loss leaves on disk."""
        if self.ckpt_path.exists():
            return f"{self.ckpt_path} is untouched"
        return f"no checkpoint was written ({self.ckpt_path} does not exist)"

    def _advice(self) -> str:
        return "Try a lower learning_rate or grad_clip > 0" + (", or dtype=bfloat16." if self.float16 else ".")


def signal_name(signum: int) -> str:
    """2 -> 'SIGINT'."""
    return signal.Signals(signum).name


def exit_code(name: str) -> int:
    """The shell's exit status for a process stopped by signal `name` (SIGINT: 130, SIGTERM: 143)."""
    return 128 + signal.Signals[name].value
