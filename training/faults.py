"""Stopping safely on SIGINT/SIGTERM/SIGHUP/SIGPIPE: at the end of a step, saving; at a second signal, at once."""

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

SAME_STOP_S = 0.1  # a second signal sooner is the first sent twice (timeout: to the process, then its group)


class RunGuard:
    """Watches a run for stop signals: `signum` is the first one's (train.py polls it at each step's end)."""

    def __init__(self, ckpt_path: str | Path, distributed: bool, announce: bool) -> None:
        self.ckpt_path, self.distributed, self.announce = Path(ckpt_path), distributed, announce
        self.signum: int | None = None  # first stop signal
        self._first = 0.0  # when it came (time.monotonic): a second one sooner than SAME_STOP_S is the same stop
        self._previous: dict[int, object] = {}

    def arm(self) -> None:
        """Install SIGINT/SIGTERM/SIGHUP/SIGPIPE handlers (main thread only); again over a library's (Triton's LLVM
        puts in one-shot ones as it compiles, which a second quick signal gets past): disarm restores the first."""
        self._ttys = [fd for fd in (1, 2) if os.isatty(fd)]  # asked now: a hung-up terminal is no tty
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):  # SIGPIPE: stdout's reader gone
                self._previous.setdefault(sig, signal.signal(sig, self._on_signal))

    def disarm(self) -> None:
        """Restore the handlers arm() replaced; idempotent."""
        while self._previous:
            signal.signal(*self._previous.popitem())

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            if time.monotonic() - self._first < SAME_STOP_S:
                return
            self.disarm()
            signal.raise_signal(signum)  # previous handler: KeyboardInterrupt for SIGINT
            return
        self.signum, self._first = signum, time.monotonic()
        for fd in self._ttys if signum == signal.SIGHUP else ():  # a closed terminal: writes (EIO) would stop the save
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
        if self.announce:  # os.write: print in a handler can raise "reentrant call"; stderr may be the lost pipe
            name = signal_name(signum)
            again = {signal.SIGINT: "Ctrl-C again", signal.SIGPIPE: "Ctrl-C"}.get(signum, f"{name} again")
            with contextlib.suppress(OSError):
                os.write(2, f"\nreceived {name}: stopping at the end of this step and saving a "
                            f"checkpoint ({again} to exit at once)\n".encode())

    def stopping(self) -> bool:
        """A signal arrived (polled in evals; distributed runs finish them: the ranks wait)."""
        return self.signum is not None and not self.distributed

    def kept(self, step: int | None = None) -> str:
        """What a stopped run leaves on disk; step: the one its checkpoint holds, if known."""
        p = self.ckpt_path
        at = "" if step is None else f" (step {step})"
        return f"{p}{at} is untouched" if p.exists() else f"no checkpoint was written ({p} does not exist)"


def signal_name(signum: int) -> str:
    """2 -> 'SIGINT'."""
    return signal.Signals(signum).name


def exit_code(name: str) -> int:
    """Shell exit status for a process stopped by signal `name` (SIGINT: 130)."""
    return 128 + signal.Signals[name].value
