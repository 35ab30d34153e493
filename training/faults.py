"""Stopping safely on SIGINT/SIGTERM; never saving after a non-finite loss (checked on device)."""

import os
import signal
import threading
from pathlib import Path

import torch
from torch import Tensor, nn

NO_STEP = 2**62  # "no bad step yet": above any step, so a MIN over ranks keeps real ones


class RunGuard:
    """Watches a run for stop signals and non-finite losses; poll() agrees across ranks."""

    def __init__(self, device: torch.device, ckpt_path: str | Path, distributed: bool, announce: bool) -> None:
        self.ckpt_path, self.distributed, self.announce = Path(ckpt_path), distributed, announce
        self.signum: int | None = None  # first stop signal
        self._first_bad = torch.full((), NO_STEP, dtype=torch.int64, device=device)
        self._bad_loss = torch.zeros((), dtype=torch.float32, device=device)
        self._previous: dict[int, object] = {}

    def arm(self) -> None:
        """Install SIGINT/SIGTERM handlers (main thread only)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def disarm(self) -> None:
        """Restore the handlers arm() replaced; idempotent."""
        while self._previous:
            signal.signal(*self._previous.popitem())

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            self.disarm()
            signal.raise_signal(signum)  # previous handler: KeyboardInterrupt for SIGINT
            return
        self.signum = signum
        if self.announce:  # os.write: print in a handler can raise "reentrant call"
            again = "Ctrl-C" if signum == signal.SIGINT else signal_name(signum)
            os.write(2, f"\nreceived {signal_name(signum)}: stopping at the end of this step and saving a "
                        f"checkpoint ({again} again to exit at once)\n".encode())

    def stopping(self) -> bool:
        """A signal arrived (polled in evals; distributed runs finish them: the ranks wait)."""
        return self.signum is not None and not self.distributed

    def observe(self, loss: Tensor, step: int) -> None:
        """Record step if loss is the first non-finite one (no host sync)."""
        loss = loss.detach().float()
        new_bad = ~torch.isfinite(loss) & (self._first_bad == NO_STEP)
        self._first_bad = torch.where(new_bad, step, self._first_bad)
        self._bad_loss = torch.where(new_bad, loss, self._bad_loss)

    def poll(self, sync: bool) -> int | None:
        """At a step's end: the signal to stop for, or None (distributed: agreed at `sync` steps)."""
        if not self.distributed:
            if sync or self.signum is not None:
                self._raise_if_bad(self._first_bad.item(), local=True)
            return self.signum
        if not sync:
            return None
        flags = torch.stack([self._first_bad, torch.tensor(-(self.signum or 0), device=self._first_bad.device)])
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)  # the first bad step, any signal
        first_bad, signum = flags.tolist()
        self._raise_if_bad(first_bad, local=first_bad == self._first_bad.item())
        return -signum or None

    def check_before_save(self, model: nn.Module) -> None:
        """Refuse to save after a non-finite loss or with non-finite weights."""
        self._raise_if_bad(self._first_bad.item(), local=True)
        if not torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all():
            raise self._error("the model's weights are no longer finite; stopped without saving")

    def _raise_if_bad(self, first_bad: int, local: bool) -> None:
        if first_bad != NO_STEP:
            what = f"loss is {self._bad_loss.item()}" if local else "loss is not finite (on another rank)"
            raise self._error(f"{what} at step {first_bad}; stopped without saving anything from that step on")

    def _error(self, what: str) -> FloatingPointError:
        return FloatingPointError(f"{what}: {self.kept()}. Try a lower learning_rate or grad_clip > 0 (in float16: "
                                  "dtype=bfloat16).")

    def kept(self) -> str:
        """What a stopped run leaves on disk."""
        p = self.ckpt_path
        return f"{p} is untouched" if p.exists() else f"no checkpoint was written ({p} does not exist)"


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def exit_code(name: str) -> int:
    """Shell exit status for a process stopped by signal `name` (SIGINT: 130)."""
    return 128 + signal.Signals[name].value
