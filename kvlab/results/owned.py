"""Output folders kvlab owns: figures, executed notebooks, indexes, layout-study and experiment figure folders.

The rule (docs/results.md, "Owned outputs"): kvlab replaces a file only if it wrote that file and nobody
changed it since. Each folder kvlab writes loose files into holds a listing, ``.kvlab-outputs.json``
(``{"kind": "kvlab-outputs", "files": {name: sha256}}``), updated atomically under a lock after every write.

Invariants:

* :func:`prepare_folder` runs before any work: it refuses a symbolic link, a file, and a non-empty folder
  without a listing (a folder kvlab did not create), and it refuses a listed file whose sha256 no longer
  matches (a kvlab file the user edited is the user's now); it creates the folder and its listing otherwise;
* :func:`write_owned` writes ``folder/name`` atomically (a temporary in the same folder, then ``os.replace``)
  and refuses to replace an existing file that the listing does not hold with its current sha256;
* a folder's subfolders are checked the same way by :func:`prepare_folder` with ``depth`` > 0, so a tree
  kvlab writes into (``OUT/<notebook>/...``) is checked whole before anything runs;
* kvlab's own temporaries (:data:`kvlab.results.paths.TEMP_RE`) and probes never make a folder foreign.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from kvlab.errors import ResultsLocationError
from kvlab.results.locking import locked
from kvlab.results.paths import TEMP_RE, atomic_write_file, dir_mode, file_entry

LISTING = ".kvlab-outputs.json"
LOCK = ".kvlab-outputs.lock"
KIND = "kvlab-outputs"
_OWN_NAMES = {LISTING, LOCK}


def _transient(name: str) -> bool:
    return bool(TEMP_RE.match(name)) or name.startswith(".kvlab-probe.") or name in _OWN_NAMES


def read_listing(folder: Path) -> dict[str, str] | None:
    """``{file name: sha256}`` of an owned folder, or None when ``folder`` holds no (valid) listing."""
    if not (Path(folder) / LISTING).is_file():  # stat only: a FIFO would block the reader
        return None
    try:
        data = json.loads((Path(folder) / LISTING).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("kind") != KIND or not isinstance(data.get("files"), dict):
        return None
    return {str(k): str(v) for k, v in data["files"].items()}


def _write_listing(folder: Path, files: dict[str, str]) -> None:
    text = json.dumps({"kind": KIND, "files": dict(sorted(files.items()))}, indent=1) + "\n"
    atomic_write_file(folder / LISTING, lambda p: Path(p).write_text(text))


def _refuse(path: Path, what: str, todo: str, flag: str | None) -> ResultsLocationError:
    named = f"{flag} {path}" if flag else str(path)
    return ResultsLocationError(f"{named}: {what}; {todo}")


def is_owned_file(path: Path, listing: dict[str, str] | None = None) -> bool:
    """Whether ``path`` is a file kvlab wrote and nobody changed since (listed with its current sha256)."""
    path = Path(path)
    if listing is None:
        listing = read_listing(path.parent)
    if not listing or path.name not in listing or path.is_symlink() or not path.is_file():
        return False
    try:
        return file_entry(path)["sha256"] == listing[path.name]
    except OSError:
        return False


def check_folder(folder: str | os.PathLike, *, flag: str | None = None, depth: int = 0,
                 names: Iterable[str] = ()) -> Path:
    """Refuse ``folder`` as a kvlab output folder without creating anything; returns it absolute.

    Accepted: absent (below a folder), empty, or holding a kvlab listing whose listed files are unchanged;
    with ``depth`` > 0 every subfolder is checked the same way, ``depth - 1`` deep. ``names``: files this
    command will write there; each that exists must be an owned, unchanged file. ResultsLocationError (one
    line naming the path and ``flag``) otherwise."""
    folder = Path(os.path.abspath(os.fspath(folder)))
    if folder.is_symlink():
        raise _refuse(folder, "is a symbolic link", "give the real folder path (kvlab writes only into folders "
                      "it created)", flag)
    if not folder.exists():
        ancestor = folder.parent
        while not ancestor.exists() and ancestor != ancestor.parent:
            if ancestor.is_symlink():  # a dangling link on the way
                break
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise _refuse(folder, f"{ancestor} is not a folder", "give a path below a folder", flag)
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise _refuse(folder, f"cannot be created in {ancestor} (not writable)", "choose a writable location",
                          flag)
        return folder
    if not folder.is_dir():
        raise _refuse(folder, "is a file, not a folder", "give a new or empty folder", flag)
    try:
        entries = sorted(e for e in os.listdir(folder) if not _transient(e))
    except OSError as exc:
        raise _refuse(folder, f"cannot be read ({exc.strerror})", "choose another folder", flag) from None
    listing = read_listing(folder)
    if listing is None and entries:
        raise _refuse(folder, f"is not empty and was not written by kvlab (holds {', '.join(entries[:3])})",
                      "give a new or empty folder (kvlab never overwrites or deletes files it did not write)", flag)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise _refuse(folder, "is not writable", "choose a writable location", flag)
    listing = listing or {}
    for name in entries:
        path = folder / name
        if name in listing and not is_owned_file(path, listing):
            raise _refuse(path, "was written by kvlab but changed since (it is yours now)",
                          "move it away or give another folder", flag)
        if depth > 0 and path.is_dir() and not path.is_symlink():
            check_folder(path, flag=flag, depth=depth - 1)
        elif depth > 0 and path.is_symlink() and path.is_dir():
            raise _refuse(path, "is a symbolic link", "give a folder without links (kvlab writes only into "
                          "folders it created)", flag)
    for name in names:
        path = folder / name
        if (path.exists() or path.is_symlink()) and not is_owned_file(path, listing):
            raise _refuse(path, "exists and was not written by kvlab", "move it away or give another folder "
                          "(kvlab never overwrites files it did not write)", flag)
    return folder


def prepare_folder(folder: str | os.PathLike, *, flag: str | None = None, depth: int = 0,
                   names: Iterable[str] = ()) -> Path:
    """:func:`check_folder`, then create ``folder`` (and missing parents) with an empty listing if it has none."""
    folder = check_folder(folder, flag=flag, depth=depth, names=names)
    folder.mkdir(mode=dir_mode(), parents=True, exist_ok=True)
    with locked(folder / LOCK):
        if read_listing(folder) is None:
            _write_listing(folder, {})
    return folder


def write_owned(path: str | os.PathLike, write: Callable[[Path], object], *, flag: str | None = None,
                prepared: bool = False) -> Path:
    """Write ``path`` atomically (``write(tmp)`` fills a temporary beside it) and record it in its folder's
    listing. The folder is prepared first (:func:`prepare_folder`, which hashes every listed file), unless the
    caller has just prepared it (``prepared``: e.g. one figure's four files after one check); either way an
    existing ``path`` that kvlab did not write (or that changed since) is refused under the folder's lock,
    untouched."""
    path = Path(os.path.abspath(os.fspath(path)))
    folder = path.parent if prepared else prepare_folder(path.parent, flag=flag, names=[path.name])
    with locked(folder / LOCK):
        listing = read_listing(folder) or {}
        if (path.exists() or path.is_symlink()) and not is_owned_file(path, listing):
            raise _refuse(path, "exists and was not written by kvlab", "move it away or give another folder "
                          "(kvlab never overwrites files it did not write)", flag)
        entry = atomic_write_file(path, write)
        listing[path.name] = entry["sha256"]
        _write_listing(folder, listing)
    return path


def write_owned_text(path: str | os.PathLike, text: str, *, flag: str | None = None) -> Path:
    """:func:`write_owned` of a UTF-8 text file."""
    return write_owned(path, lambda p: Path(p).write_text(text, encoding="utf-8"), flag=flag)


def write_owned_bytes(path: str | os.PathLike, data: bytes, *, flag: str | None = None) -> Path:
    """:func:`write_owned` of a bytes file."""
    return write_owned(path, lambda p: Path(p).write_bytes(data), flag=flag)


__all__ = ["LISTING", "check_folder", "is_owned_file", "prepare_folder", "read_listing", "write_owned",
           "write_owned_bytes", "write_owned_text"]
