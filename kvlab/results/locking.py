"""Advisory locks (``fcntl.flock``) for results folders shared by concurrent processes.

Invariants: a lock is released when its holder's file descriptor closes, including when the process
is killed, so a crash never leaves a folder locked. Lock files are never deleted (deleting a lock file
that another process holds open would split the lock in two). Locks are per open file description and
work between processes on one host; on network file systems they are as reliable as the server's
``flock`` support.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvlab.results.paths import file_mode


@contextmanager
def locked(path: str | os.PathLike, *, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (a folder, or a lock file created if absent) for the block.

    Yields True when held; with ``blocking=False`` yields False at once if another process holds it."""
    path = Path(path)
    if path.is_dir():
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, file_mode())
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


__all__ = ["locked"]
