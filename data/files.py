"""Files that are never seen half-written: a temporary file beside the target, then an atomic rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def temp_file_beside(path: str | Path, prefix: str | None = None) -> tuple[int, str]:
    """mkstemp in path's directory, named `.NAME.*.tmp` (or prefix*), with the permissions a plain
    open() would give (0666 minus the umask) rather than mkstemp's owner-only 0600: the file is
    renamed over `path` and should be as readable as any other file the user writes there.
    Returns (fd, temporary path)."""
    path = Path(path)
    if prefix is None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    else:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix)
    umask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, tmp


def write_atomic(path: str | Path, data: bytes | memoryview) -> None:
    """Write data to path through a temporary file in the same directory and an atomic rename: a
    reader, or a crash at any moment, sees the old file or the new one, never a torn one. A failed
    write removes its temporary file and leaves the old file as it was."""
    path = Path(path)
    fd, tmp = temp_file_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
