"""Known public traces, a verifying downloader, and name/path resolution.

``TRACES`` maps a short name to a dict with ``url``, ``filename``, ``format`` (a :func:`load_trace`
format name), ``size`` (bytes, or None if unknown), ``sha256`` (full hex, or None), ``sha256_prefix``
(hex prefix known from upstream, or None), ``requests`` (count, or None), ``group`` (sub-folder in a
trace directory) and ``description``.

:func:`download` looks for the file locally first and only then fetches it:

1. every directory in ``$KVLAB_TRACE_DIRS`` (``os.pathsep``-separated), then the repository's sibling
   ``../shared/traces``, each searched as ``<dir>/<filename>`` and ``<dir>/<group>/<filename>``;
2. the cache directory (``cache_dir``, else ``$KVLAB_CACHE``, else ``~/.cache/kvlab/traces``);
3. the URL, streamed into ``<cache>/<filename>.part`` with a progress bar, verified against the known
   size and sha256 (or sha256 prefix), then atomically renamed to ``<cache>/<filename>``.

The first local copy found is verified against the known size and full sha256 before it is used; a
mismatch raises :class:`~kvlab.errors.ChecksumError` naming the file and both checksums (never a silent
use or skip). Hashes are remembered in ``<cache>/.kvlab-verified.json``, keyed by absolute path, size,
mtime and inode, so a second load hashes nothing; the file is written atomically, and a missing,
corrupt or unwritable one only costs a re-hash. Network or HTTP failures and checksum mismatches of a
download raise :class:`~kvlab.errors.DownloadError` naming the URL and where to put the file by hand.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import http.client
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvlab.errors import ChecksumError, ConfigError, DownloadError, TraceFileError, TraceFormatError
from kvlab.schema import TRACE_FORMATS
from kvlab.workload._common import (
    atomic_open,
    check_regular_file,
    field_label,
    parse_json_text,
    sha256_file,
    trace_file_error,
)

_MOONCAKE = "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release"
_ALIBABA = "https://media.githubusercontent.com/media/alibaba-edu/qwen-bailian-usagetraces-anon/main"

# Checksums. mooncake_conversation/_synthetic: computed from the copies in ../shared/traces, which match
# the upstream git blobs (kvcache-ai/Mooncake 3cca71da). alibaba_coder/_thinking: size and the sha256
# prefix from the upstream Git LFS pointers (an LFS oid is the content's full sha256); the full sha256
# and the traceA/traceB sizes and sha256s agree across several independent third-party download
# scripts and manifests pinned to upstream commit 5f7439c5. mooncake_toolagent/_arxiv: full sha256s
# quoted identically by several independent third-party verification scripts; their byte sizes were
# found nowhere, so only the sha256 is checked for them.
TRACES: dict[str, dict[str, Any]] = {
    "mooncake_conversation": {
        "url": f"{_MOONCAKE}/traces/conversation_trace.jsonl",
        "filename": "conversation_trace.jsonl",
        "format": "mooncake",
        "size": 3_029_533,
        "sha256": "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
        "sha256_prefix": "b8cbb061a85206d7",
        "requests": 12_031,
        "group": "mooncake",
        "description": "Mooncake/Kimi FAST'25 conversation trace: 1 h, 512-token chained block ids",
    },
    "mooncake_synthetic": {
        "url": f"{_MOONCAKE}/traces/synthetic_trace.jsonl",
        "filename": "synthetic_trace.jsonl",
        "format": "mooncake",
        "size": 1_136_313,
        "sha256": "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
        "sha256_prefix": "bd070915a98fc0ed",
        "requests": 3_993,
        "group": "mooncake",
        "description": "Mooncake FAST'25 synthetic trace (Poisson arrivals), 512-token chained block ids",
    },
    "mooncake_toolagent": {
        "url": f"{_MOONCAKE}/traces/toolagent_trace.jsonl",
        "filename": "toolagent_trace.jsonl",
        "format": "mooncake",
        "size": None,  # not published anywhere we could read (the blob is >= 4 MiB, absent from snapshots)
        "sha256": "48a2db1a13d3bc05e6330140c64f604ba366df20d3c9e128b5c35a01c1fa5f71",
        "sha256_prefix": None,
        "requests": 23_608,
        "group": "mooncake",
        "description": "Mooncake FAST'25 tool&agent trace (>= 4 MiB), 512-token chained block ids",
    },
    "mooncake_arxiv": {
        "url": f"{_MOONCAKE}/arxiv-trace/mooncake_trace.jsonl",
        "filename": "mooncake_trace.jsonl",
        "format": "mooncake",
        "size": None,  # as for toolagent: not published where we could read it
        "sha256": "b434f1816a707f4bac697235588184ebc374c9907cb981bb65fb0643471fe711",
        "sha256_prefix": None,
        "requests": 23_608,
        "group": "mooncake",
        "description": "Historical Mooncake trace of arXiv 2407.00079 v3 (Table 1 LRU/LFU hit rates)",
    },
    "alibaba_traceA": {
        "url": f"{_ALIBABA}/qwen_traceA_blksz_16.jsonl",
        "filename": "qwen_traceA_blksz_16.jsonl",
        "format": "alibaba",
        "size": 56_354_493,
        "sha256": "07cedc9ed8aff301994ac68ed4aede8123b7603673575eeba9dd677de663db17",
        "sha256_prefix": None,
        "requests": 43_058,
        "group": "alibaba",
        "description": "Qwen-Bailian trace A (to-C chat: text/search/image/file), 2 h, ~56 MB, 16-token ids",
    },
    "alibaba_traceB": {
        "url": f"{_ALIBABA}/qwen_traceB_blksz_16.jsonl",
        "filename": "qwen_traceB_blksz_16.jsonl",
        "format": "alibaba",
        "size": 96_209_982,
        "sha256": "68e3f98e2d601d60d0abf4b89bc8a3654372abab7b1cde6373a13d0054379d59",
        "sha256_prefix": None,
        "requests": 172_800,
        "group": "alibaba",
        "description": "Qwen-Bailian trace B (to-B API task automation), 2 h, ~96 MB, 16-token ids",
    },
    "alibaba_coder": {
        "url": f"{_ALIBABA}/qwen_coder_blksz_16.jsonl",
        "filename": "qwen_coder_blksz_16.jsonl",
        "format": "alibaba",
        "size": 132_054_902,
        "sha256": "3d74974cebb7bccb69b1ca6ea210a44d9a3033443c0271ed015327284dea1aff",
        "sha256_prefix": "3d74974c",
        "requests": 43_011,
        "group": "alibaba",
        "description": "Qwen-Bailian coder trace (code generation), 2 h, 16-token ids",
    },
    "alibaba_thinking": {
        "url": f"{_ALIBABA}/qwen_thinking_blksz_16.jsonl",
        "filename": "qwen_thinking_blksz_16.jsonl",
        "format": "alibaba",
        "size": 27_901_454,
        "sha256": "41ac36d9d1b54d084eeb6b05e9d142ba9d02f8bf79cfc9fff418d8ab7cdee906",
        "sha256_prefix": "41ac36d9",
        "requests": 10_812,
        "group": "alibaba",
        "description": "Qwen-Bailian thinking trace (reasoning chat, long outputs), 2 h, 16-token ids",
    },
}

KNOWN_TRACES = TRACES  # alias
FORMATS = TRACE_FORMATS  # (kvlab.schema: one list of formats for the loaders and the CLI)


def trace_cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """The download cache: ``cache`` if given, else ``$KVLAB_CACHE``, else ``~/.cache/kvlab/traces``."""
    if cache is not None:
        return Path(cache)
    env = os.environ.get("KVLAB_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvlab" / "traces"


def check_cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """The download cache (:func:`trace_cache_dir`) if it is a folder or can be created as one; ConfigError, one
    line naming it and where it came from (``--cache-dir`` / ``cache_dir=``, or ``$KVLAB_CACHE``), when it or a
    folder on its way is a file. Creates nothing; :func:`download` calls it before any work."""
    path = trace_cache_dir(cache)
    source = ("--cache-dir (cache_dir=)" if cache is not None else
              "$KVLAB_CACHE" if os.environ.get("KVLAB_CACHE") else "the default trace cache")
    step = path
    while not step.is_dir():
        if step.exists() or step.is_symlink():
            kind = "a file" if step.is_file() else "a broken link" if step.is_symlink() else "not a folder"
            what = f"is {kind}, not a folder" if step == path else f"cannot be created: {step} is {kind}"
            raise ConfigError(f"{source} {path}: {what}; give a folder for downloaded traces")
        if step == step.parent:
            break
        step = step.parent
    return path


def search_dirs() -> list[Path]:
    """Local trace directories searched before downloading: ``$KVLAB_TRACE_DIRS``, then ../shared/traces."""
    dirs = [Path(d) for d in os.environ.get("KVLAB_TRACE_DIRS", "").split(os.pathsep) if d]
    dirs.append(Path(__file__).resolve().parents[2].parent / "shared" / "traces")
    return dirs


def _suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'x'?)`` for a close match of ``word``, else an empty string."""
    lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(lower), n=1, cutoff=0.6)
    return f" (did you mean {lower[close[0]]!r}?)" if close else ""


def _entry(name: str) -> dict[str, Any]:
    try:
        return TRACES[name]
    except KeyError:
        raise DownloadError(
            f"unknown trace {name!r}{_suggest(name, sorted(TRACES))}; known: {', '.join(sorted(TRACES))}"
        ) from None


VERIFY_CACHE = ".kvlab-verified.json"
_VERIFY_CACHE_MAX = 256  # entries kept (newest first)


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


def verify_local(name: str, path: str | os.PathLike, *, cache: str | os.PathLike | None = None) -> Path:
    """Check a local copy of trace ``name`` against the registry's size and sha256; return its path.

    Raises :class:`ChecksumError` naming the file, the expected and the actual sha256 on a mismatch.
    The hash is cached (see :func:`file_sha256`), so verifying an unchanged file again costs a stat.
    """
    entry = _entry(name)
    path = Path(path)
    size, want, prefix = entry.get("size"), entry.get("sha256"), entry.get("sha256_prefix")
    if size is None and want is None and prefix is None:
        return path
    try:
        got = file_sha256(path, cache=cache)
        actual_size = path.stat().st_size
    except OSError as e:  # unreadable copy: say so, naming it
        raise trace_file_error(path, e) from None
    problem = None
    if size is not None and actual_size != size:
        problem = f"{actual_size:,} bytes, expected {size:,}"
    elif want is not None and got != want.lower():
        problem = "content differs"
    elif want is None and prefix is not None and not got.startswith(prefix.lower()):
        problem = f"sha256 does not start with the expected {prefix}"
    if problem is None:
        return path
    expected = want or (f"{prefix}..." if prefix else "unknown")
    raise ChecksumError(
        str(path),
        want,
        got,
        f"{path}: this local copy of trace {name!r} is not the published file ({problem}; sha256 {got}, "
        f"expected {expected}). It is truncated, corrupt or another version: delete or replace it "
        f"(download(name, force=True) fetches a fresh copy into the cache).",
    )


def find_local(name: str, *, cache: str | os.PathLike | None = None) -> Path | None:
    """The verified local copy of trace ``name`` (search dirs, then the cache), or None if there is none.

    The first copy found is checked by :func:`verify_local`; a wrong one raises :class:`ChecksumError`.
    """
    entry = _entry(name)
    fn, group = entry["filename"], entry.get("group") or ""
    candidates = [p for d in search_dirs() for p in (d / fn, d / group / fn)]
    candidates.append(trace_cache_dir(cache) / fn)
    for p in candidates:
        if p.is_file():
            return verify_local(name, p, cache=cache)
    return None


def _manual_hint(url: str, target: Path) -> str:
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
    return _fetch(
        url, dest, size=size, sha256=sha256, sha256_prefix=sha256_prefix, progress=progress, timeout=timeout
    )[0]


def _fetch(
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
    hint = _manual_hint(url, dest)
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


def download(
    name: str,
    cache_dir: str | os.PathLike | None = None,
    *,
    force: bool = False,
    progress: bool | None = None,
    timeout: float = 60.0,
) -> Path:
    """Path of public trace ``name``: a local copy if one exists (module docstring), else downloaded.

    ``force=True`` skips the local search and re-downloads into the cache. A cache folder that is a file is
    refused (:func:`check_cache_dir`): a given ``cache_dir`` (``--cache-dir``) first of all, ``$KVLAB_CACHE`` or
    the default before a download (a local copy found elsewhere does not need it).
    """
    entry = _entry(name)
    if cache_dir is not None:
        check_cache_dir(cache_dir)
    if not force:
        local = find_local(name, cache=cache_dir)
        if local is not None:
            return local
    dest = check_cache_dir(cache_dir) / entry["filename"]
    path, digest = _fetch(
        entry["url"],
        dest,
        size=entry.get("size"),
        sha256=entry.get("sha256"),
        sha256_prefix=entry.get("sha256_prefix"),
        progress=progress,
        timeout=timeout,
    )
    remember_sha256(path, digest, cache=cache_dir)  # the next load verifies it without hashing
    return path


def detect_format(path: str | os.PathLike) -> str:
    """Format name of a trace file: by known filename, Parquet magic/extension, or the first line's keys.

    Returns one of ``FORMATS``; raises :class:`TraceFormatError` if nothing matches and
    :class:`TraceFileError` if the file cannot be read.
    """
    path = Path(path)
    for entry in TRACES.values():
        if path.name == entry["filename"]:
            return entry["format"]
    check_regular_file(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic == b"PAR1" or path.suffix.lower() in (".parquet", ".pq"):
                return "parquet"
            f.seek(0)
            lines = ((i, raw[3:] if i == 1 and raw.startswith(b"\xef\xbb\xbf") else raw) for i, raw in enumerate(f, 1))
            first = next(((i, raw) for i, raw in lines if raw.strip()), None)
    except (OSError, ValueError) as e:
        raise trace_file_error(path, e) from None
    if first is None:
        raise TraceFormatError(str(path), None, None, "empty file: cannot detect its format")
    ln, raw = first
    try:
        obj = parse_json_text(str(path), ln, raw)
    except TraceFormatError as e:
        raise TraceFormatError(
            str(path), ln, e.field, f"first line is not JSON ({e.message}): cannot detect the format"
        ) from None
    if type(obj) is not dict:
        raise TraceFormatError(str(path), ln, None, "first line is not a JSON object: cannot detect the format")
    keys = set(obj)
    if "kvlab_trace" in keys or "arrival" in keys:
        return "jsonl"
    if {"chat_id", "parent_chat_id", "hash_ids"} <= keys:
        return "alibaba"
    if {"timestamp", "input_length", "hash_ids"} <= keys:
        return "mooncake"
    if {"arrival_time", "prompt_token_ids"} <= keys:
        return "request-log"
    shown = ", ".join(repr(field_label(k)) for k in sorted(keys)[:8]) + (", ..." if len(keys) > 8 else "")
    raise TraceFormatError(
        str(path), ln, None, f"cannot detect the format from keys [{shown}]; pass format= explicitly"
    )


def resolve_trace(name_or_path: str | os.PathLike, *, format: str | None = None) -> tuple[Path, str]:
    """``(path, format)`` for a registry name (fetched by :func:`download` if needed) or a file path.

    ``format`` overrides detection; an unknown format is a :class:`ConfigError`. A name that is neither
    a file nor a registry name raises :class:`ConfigError` (with the closest known name, if any); a
    directory or another non-file raises :class:`TraceFileError`.
    """
    if format is not None and (type(format) is not str or format not in FORMATS):
        hint = _suggest(format, FORMATS) if type(format) is str else ""
        raise ConfigError(f"unknown trace format {format!r}{hint}; known: {', '.join(FORMATS)}")
    try:
        key = os.fsdecode(name_or_path)
    except TypeError:
        raise ConfigError(f"a trace is a registry name or a file path, got {type(name_or_path).__name__}") from None
    path = Path(key)
    if key in TRACES and not path.is_file():
        return download(key), format or TRACES[key]["format"]
    if path.is_dir():
        raise TraceFileError(key, None, None, "is a directory, not a trace file")
    if not path.is_file():
        if path.exists():
            raise TraceFileError(key, None, None, "is not a regular file (a pipe or device?)")
        what = "no such file, and not" if os.sep in key or path.suffix else "neither a file nor"
        raise ConfigError(
            f"trace {key!r}: {what} a known trace name{_suggest(key, sorted(TRACES))} "
            f"(known: {', '.join(sorted(TRACES))})"
        )
    return path, format or detect_format(path)


def registry_table() -> str:
    """One line per registered trace: name and description (``kvlab download --list``)."""
    return "\n".join(f"{name:<24} {info.get('description', '')}" for name, info in TRACES.items())
