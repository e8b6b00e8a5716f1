"""Fetching and hashing for the trace registry (:mod:`kvlab.workload.registry`): a verifying streamer, the
download cache folder and the verified-hash cache.

:func:`fetch` streams a URL into ``<dest>.part`` with a progress bar, checks the known size and sha256 (or
sha256 prefix), then renames it onto ``dest`` atomically; any failure removes the ``.part`` file, leaves
``dest`` untouched and raises :class:`~kvlab.errors.DownloadError` naming the URL and where to put the file by
hand. :func:`file_sha256` remembers hashes in ``<cache>/.kvlab-verified.json``, keyed by absolute path,
size, mtime and inode, so verifying an unchanged file again costs a ``stat``; that file is written
atomically, and a missing, corrupt or unwritable one only costs a re-hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from kvlab.errors import ConfigError, DownloadError, TraceFormatError
from kvlab.workload._common import atomic_open, parse_json_text, sha256_file

VERIFY_CACHE = ".kvlab-verified.json"
_VERIFY_CACHE_MAX = 256  # entries kept (newest first)


def trace_cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """The download cache: ``cache`` if given, else ``$KVLAB_CACHE``, else ``~/.cache/kvlab/traces``."""
    if cache is not None:
        return Path(cache)
    env = os.environ.get("KVLAB_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvlab" / "traces"


def check_folder(path: Path, source: str, *, create: bool = False) -> Path:
    """``path`` if it is a folder or can be created as one (``create=True``: and is created and writable);
    ConfigError, one line naming it and ``source`` (where it came from), when it or a folder on its way is a
    file, or (``create``) it cannot be created or written."""
    step = path
    while not step.is_dir():
        if step.exists() or step.is_symlink():
            kind = "a file" if step.is_file() else "a broken link" if step.is_symlink() else "not a folder"
            what = f"is {kind}, not a folder" if step == path else f"cannot be created: {step} is {kind}"
            raise ConfigError(f"{source} {path}: {what}; give a folder for downloaded traces")
        if step == step.parent:
            break
        step = step.parent
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{source} {path}: cannot be created ({e.strerror or e}); give a writable folder "
                              "(kvlab download NAME --cache-dir DIR)") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{source} {path}: not writable; give a writable folder "
                              "(kvlab download NAME --cache-dir DIR)")
    return path


def check_cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """The download cache (:func:`trace_cache_dir`) if it is a folder or can be created as one; ConfigError, one
    line naming it and where it came from (``--cache-dir`` / ``cache_dir=``, or ``$KVLAB_CACHE``), when it or a
    folder on its way is a file. Creates nothing."""
    source = ("--cache-dir (cache_dir=)" if cache is not None else
              "$KVLAB_CACHE" if os.environ.get("KVLAB_CACHE") else "the default trace cache")
    return check_folder(trace_cache_dir(cache), source)


# ------------------------------------------------------------------------------------------ verified hashes
def _verify_cache_path(cache: str | os.PathLike | None) -> Path:
    return trace_cache_dir(cache) / VERIFY_CACHE


def _read_verify_cache(path: Path) -> dict[str, dict]:
    """The verification cache, or {} if it is missing, unreadable or corrupt (it is only a cache)."""
    try:
        obj = parse_json_text(str(path), None, path.read_bytes())
    except (OSError, TraceFormatError):
        return {}
    return {k: v for k, v in obj.items() if type(v) is dict} if type(obj) is dict else {}


def _stat_key(path: Path) -> tuple[str, dict[str, int]]:
    st = path.stat()
    return str(path.resolve()), {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def remember_sha256(path: Path, digest: str, *, cache: str | os.PathLike | None = None) -> None:
    """Record ``digest`` as the sha256 of ``path`` as it is now (atomic write; failures are ignored)."""
    cpath = _verify_cache_path(cache)
    key, stamp = _stat_key(path)
    entries = _read_verify_cache(cpath)
    entries.pop(key, None)
    entries = {key: {**stamp, "sha256": digest}, **dict(list(entries.items())[: _VERIFY_CACHE_MAX - 1])}
    with contextlib.suppress(OSError):
        cpath.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(cpath, "w", encoding="utf-8") as f:
            json.dump(entries, f, indent=0)


def file_sha256(path: str | os.PathLike, *, cache: str | os.PathLike | None = None) -> str:
    """Full sha256 of ``path``, remembered in the cache directory by (absolute path, size, mtime, inode)."""
    path = Path(path)
    key, stamp = _stat_key(path)
    hit = _read_verify_cache(_verify_cache_path(cache)).get(key)
    digest = hit.get("sha256") if hit is not None and all(hit.get(k) == v for k, v in stamp.items()) else None
    if type(digest) is str and len(digest) == 64:
        return digest
    digest = sha256_file(path)
    remember_sha256(path, digest, cache=cache)
    return digest


# ------------------------------------------------------------------------------------------ fetching
def manual_hint(url: str, target: Path) -> str:
    """Where to put the file of ``url`` by hand (the end of every :class:`DownloadError` of a fetch)."""
    return (
        f"Download {url} on a machine with internet access and place it at {target} "
        f"(or in a directory listed in KVLAB_TRACE_DIRS)."
    )


def fetch(
    url: str,
    dest: str | os.PathLike,
    *,
    size: int | None = None,
    sha256: str | None = None,
    sha256_prefix: str | None = None,
    progress: bool | None = None,
    timeout: float = 60.0,
) -> Path:
    """Stream ``url`` to ``dest`` via ``dest.part`` and an atomic rename; verify size and checksum.

    ``progress=None`` shows a tqdm bar only when stderr is a terminal. Any failure removes the ``.part``
    file and raises :class:`DownloadError`; ``dest`` is then untouched.
    """
    return fetch_verified(
        url, dest, size=size, sha256=sha256, sha256_prefix=sha256_prefix, progress=progress, timeout=timeout
    )[0]


def fetch_verified(
    url: str,
    dest: str | os.PathLike,
    *,
    size: int | None,
    sha256: str | None,
    sha256_prefix: str | None,
    progress: bool | None,
    timeout: float,
) -> tuple[Path, str]:
    """:func:`fetch`, also returning the sha256 of what was written (verified before the rename)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    hint = manual_hint(url, dest)
    show = sys.stderr.isatty() if progress is None else progress
    h = hashlib.sha256()
    got = 0
    try:
        from tqdm.auto import tqdm

        with urllib.request.urlopen(url, timeout=timeout) as resp, open(part, "wb") as out:
            total = size if size is not None else int(resp.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=dest.name, disable=not show) as bar:
                while chunk := resp.read(1 << 20):
                    out.write(chunk)
                    h.update(chunk)
                    got += len(chunk)
                    bar.update(len(chunk))
    except urllib.error.HTTPError as e:
        e.close()  # the error carries the open response
        _unlink(part)
        raise DownloadError(f"HTTP {e.code} ({e.reason}) fetching {url}. {hint}") from None
    except urllib.error.URLError as e:
        _unlink(part)
        raise DownloadError(f"cannot fetch {url} (offline or unreachable: {e.reason}). {hint}") from None
    except TimeoutError:
        _unlink(part)
        raise DownloadError(f"timed out after {timeout} s fetching {url}. {hint}") from None
    except (OSError, http.client.HTTPException) as e:
        _unlink(part)
        raise DownloadError(f"transfer of {url} failed ({type(e).__name__}: {e}). {hint}") from None
    except BaseException:
        _unlink(part)
        raise
    digest = h.hexdigest()
    problem = None
    if size is not None and got != size:
        problem = f"got {got} bytes, expected {size}"
    elif sha256 is not None and digest != sha256.lower():
        problem = f"sha256 {digest} != expected {sha256}"
    elif sha256_prefix is not None and not digest.startswith(sha256_prefix.lower()):
        problem = f"sha256 {digest} does not start with the expected {sha256_prefix}"
    if problem:
        _unlink(part)
        raise DownloadError(f"checksum mismatch for {url}: {problem}. {hint}")
    os.replace(part, dest)
    return dest, digest


def _unlink(p: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        p.unlink()
