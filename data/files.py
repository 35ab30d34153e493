"""Files that are never seen half-written: a temporary file beside the target, then an atomic rename.

One writer for all of them: the checkpoint (streamed by torch.save, fsync'ed), config.json,
summary.json, the encoded corpus cache and the Tiny Shakespeare download.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_file(path: str | Path, fsync: bool = False, prefix: str | None = None) -> Iterator[BinaryIO]:
    """Open a temporary file beside `path` for binary writing; when the block ends without an
    exception, rename it over `path` (atomic within a filesystem). A reader, or a crash at any
    moment, sees the old file or the new one, never a torn one; a failed write removes the
    temporary file and leaves the old file as it was.

    Args:
        path: the file to (re)place.
        fsync: flush the bytes to the disk before the rename (for files a power loss must not cost).
        prefix: name the temporary file prefix* instead of `.NAME.*.tmp` (the pattern that
            training.checkpoint.remove_partial_saves tidies).
    Yields:
        the temporary file, open for writing.
    """
    path = Path(path)
    if prefix is None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    else:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix)
    try:
        with os.fdopen(fd, "wb") as f:
            _set_mode_as_open_would(f.fileno(), path)
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _set_mode_as_open_would(fd: int, path: Path) -> None:
    """mkstemp creates 0600; give what writing with open() would: the mode of the file replaced, or
    0666 minus the umask for a new one, so a checkpoint or a shared cache_dir is as readable as any
    other file the user writes there, and a file they restricted stays restricted. A filesystem that
    refuses chmod keeps 0600: more private, never wider."""
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    try:
        os.fchmod(fd, mode)
    except OSError:
        pass


def _umask() -> int:
    """The process's umask. Linux reports it in /proc; elsewhere reading it means setting it, which
    for a moment changes it for every thread, so that is only the fallback."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask


def write_atomic(path: str | Path, data: bytes | memoryview) -> None:
    """Write data to path through atomic_file: the old file or the new one, never a torn one."""
    with atomic_file(path) as f:
        f.write(data)
