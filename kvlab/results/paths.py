"""File-system primitives of the results store: safe names, permissions, kvlab's own temporary names,
atomic file replacement and the atomic folder exchange.

Invariants:

* every temporary name kvlab creates is hidden and matches :data:`TEMP_RE`
  (``.<name>.kvlab-<tag>.<host>.<pid>.<random>``), so kvlab can tell its own leftovers from anything else;
  a leftover is removed only when its writer is gone (same host, process no longer alive);
* folders kvlab creates get ``0o777 & ~umask`` and files ``0o666 & ~umask`` (``mkdtemp``/``mkstemp``
  alone would give 0700/0600);
* a file is replaced by ``os.replace`` of a fully written temporary in the same folder, so readers see
  the old or the new file, never a part;
* nothing read from a trace or a config becomes a path without :func:`safe_name`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import re
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from kvlab.results.faults import checkpoint

SAFE_RE = re.compile(r"[^A-Za-z0-9._-]")
MAX_NAME = 96
TEMP_RE = re.compile(
    r"^\.(?P<name>.+)\.kvlab-(?P<tag>tmp|old)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.(?P<rand>[A-Za-z0-9_]*)$"
)

# temporaries this process is writing right now (absolute paths); never treated as stale
_ACTIVE: set[str] = set()


def safe_name(text: object, *, max_len: int = MAX_NAME) -> str:
    """A name that is safe as one path component, derived from ``text``.

    Only ``[A-Za-z0-9._-]``, never empty, never starting with ``.`` or ``-``, no ``..``, at most
    ``max_len`` characters. ``text`` that already satisfies this is returned unchanged; otherwise a
    ``-<8 hex>`` hash of the original is appended, so two different inputs never share a result.
    """
    if max_len < 16:
        raise ValueError("max_len must be at least 16")
    original = str(text)
    name = SAFE_RE.sub("_", original)
    name = re.sub(r"\.{2,}", "_", name).lstrip(".-")
    changed = name != original
    if not name:
        name, changed = "x", True
    if changed or len(name) > max_len:
        digest = hashlib.sha256(original.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        name = f"{name[: max_len - 9].rstrip('.')}-{digest}"
    return name


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (``/proc/self/status``)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # fallback: set and restore (not thread safe, only where /proc is missing)
    os.umask(mask)
    return mask


def dir_mode() -> int:
    """Permissions of a folder kvlab creates: ``0o777 & ~umask``."""
    return 0o777 & ~current_umask()


def file_mode() -> int:
    """Permissions of a file kvlab creates: ``0o666 & ~umask``."""
    return 0o666 & ~current_umask()


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


def temp_prefix(name: str, tag: str = "tmp") -> str:
    """The hidden prefix of a kvlab temporary beside ``name`` (``tempfile`` appends the random part)."""
    return f".{name}.kvlab-{tag}.{_host()}.{os.getpid()}."


def make_temp_dir(parent: Path, name: str) -> Path:
    """A new empty hidden folder in ``parent`` for writing ``name``; registered as active."""
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(name), dir=parent))
    _ACTIVE.add(str(tmp))
    os.chmod(tmp, dir_mode())
    return tmp


def release_temp(path: Path) -> None:
    """Forget ``path`` as an active temporary of this process."""
    _ACTIVE.discard(str(path))


def is_stale_temp(path: Path) -> bool:
    """True if ``path`` is a kvlab temporary whose writer is gone (same host, process not alive).

    A temporary of another host is never stale here (its process cannot be checked)."""
    m = TEMP_RE.match(path.name)
    if m is None or m["host"] != _host():
        return False
    pid = int(m["pid"])
    if pid == os.getpid():
        return str(path) not in _ACTIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def is_run_file_name(name: str) -> bool:
    """A file name kvlab writes in a run folder: ``manifest.json``, ``summary.json``, ``<table>.parquet``."""
    return name in ("manifest.json", "summary.json") or (
        name.endswith(".parquet") and safe_name(name[: -len(".parquet")]) == name[: -len(".parquet")]
    )


def remove_kvlab_folder(path: Path, allowed: Callable[[str], bool] = is_run_file_name) -> bool:
    """Delete a folder kvlab wrote: its files named as ``allowed`` says, then the folder itself.

    Anything else (a foreign file, a subfolder) is left in place, with the folder, and False returned."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return True
    keep = [e.name for e in entries if not (allowed(e.name) and e.is_file(follow_symlinks=False))]
    for e in entries:
        if e.name not in keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)
    if keep:
        return False
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def clean_stale(folder: Path, names: Iterable[str] | None = None) -> list[Path]:
    """Remove kvlab temporaries in ``folder`` (optionally only those for ``names``) whose writer is gone.

    Folders are removed only when they hold nothing but kvlab file names; returns what was removed."""
    wanted = set(names) if names is not None else None
    removed = []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for e in entries:
        m = TEMP_RE.match(e.name)
        if m is None or (wanted is not None and m["name"] not in wanted) or not is_stale_temp(Path(e.path)):
            continue
        if e.is_dir(follow_symlinks=False):
            if remove_kvlab_folder(Path(e.path)):
                removed.append(Path(e.path))
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)
                removed.append(Path(e.path))
    return removed


def file_entry(path: Path) -> dict:
    """``{"sha256", "bytes"}`` of a file (the manifest's record of it)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return {"sha256": h.hexdigest(), "bytes": size}


def atomic_write_file(path: Path, write: Callable[[Path], object], *, phase: str | None = None) -> dict:
    """Write ``path`` atomically: ``write(tmp)`` fills a unique temporary in the same folder, which then
    replaces ``path``. Returns the file's :func:`file_entry`. Concurrent writers never share a
    temporary; on any error the temporary is removed and ``path`` is untouched."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=temp_prefix(path.name), dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    _ACTIVE.add(str(tmp))
    try:
        os.chmod(tmp, file_mode())
        write(tmp)
        entry = file_entry(tmp)
        if phase is not None:
            checkpoint(phase)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        _ACTIVE.discard(str(tmp))
    return entry


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """libc's ``renameat2``, or None where the C library lacks it."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> None:
    """Swap two existing paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``): at every instant each
    name refers to one complete folder. Raises OSError (ENOSYS where the C library lacks renameat2,
    EINVAL where the file system refuses the exchange)."""
    fn = _renameat2()
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(a))
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


EXCHANGE_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def replace_folder(new: Path, out: Path) -> str:
    """Put the complete folder ``new`` at ``out``, replacing the kvlab folder there; returns the method.

    ``"created"`` (``out`` absent or empty), ``"exchanged"`` (atomic swap, then the old copy deleted: no
    instant without a complete ``out``), or ``"renamed-aside"`` where the file system refuses exchange
    (the old copy is renamed to a hidden kvlab name, the new one renamed in, the old one deleted; a
    crash between the two renames leaves the old copy under that hidden name)."""
    if not out.exists() or (out.is_dir() and not any(os.scandir(out))):
        try:
            os.rename(new, out)  # onto nothing, or onto an empty folder: atomic
            return "created"
        except OSError as exc:  # another writer put a run there meanwhile: replace it like any run
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    try:
        exchange(new, out)
        method, old = "exchanged", new
    except OSError as exc:
        if exc.errno not in EXCHANGE_UNSUPPORTED:
            raise
        old = Path(tempfile.mktemp(prefix=temp_prefix(out.name, "old"), dir=out.parent))
        _ACTIVE.add(str(old))
        os.rename(out, old)
        try:
            os.rename(new, out)
        except BaseException:
            os.rename(old, out)
            raise
        method = "renamed-aside"
    checkpoint("run-swapped")
    _ACTIVE.add(str(old))
    try:
        if not remove_kvlab_folder(old):
            warnings.warn(f"{old}: the previous {out.name} held files kvlab did not write; left in place",
                          stacklevel=3)
    finally:
        _ACTIVE.discard(str(old))
    return method
