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

A local file whose size differs from the known size is skipped. Network or HTTP failures and checksum
mismatches raise :class:`~kvlab.errors.DownloadError` naming the URL and where to put the file by hand.
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
import warnings
from pathlib import Path
from typing import Any

from kvlab.errors import ConfigError, DownloadError, TraceFormatError

_MOONCAKE = "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release"
_ALIBABA = "https://media.githubusercontent.com/media/alibaba-edu/qwen-bailian-usagetraces-anon/main"

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
        "size": None,
        "sha256": None,
        "sha256_prefix": None,
        "requests": 23_608,
        "group": "mooncake",
        "description": "Mooncake FAST'25 tool&agent trace (>= 4 MiB), 512-token chained block ids",
    },
    "mooncake_arxiv": {
        "url": f"{_MOONCAKE}/arxiv-trace/mooncake_trace.jsonl",
        "filename": "mooncake_trace.jsonl",
        "format": "mooncake",
        "size": None,
        "sha256": None,
        "sha256_prefix": None,
        "requests": 23_608,
        "group": "mooncake",
        "description": "Historical Mooncake trace of arXiv 2407.00079 v3 (Table 1 LRU/LFU hit rates)",
    },
    "alibaba_traceA": {
        "url": f"{_ALIBABA}/qwen_traceA_blksz_16.jsonl",
        "filename": "qwen_traceA_blksz_16.jsonl",
        "format": "alibaba",
        "size": None,
        "sha256": None,
        "sha256_prefix": None,
        "requests": 43_058,
        "group": "alibaba",
        "description": "Qwen-Bailian trace A (to-C chat: text/search/image/file), 2 h, ~56 MB, 16-token ids",
    },
    "alibaba_traceB": {
        "url": f"{_ALIBABA}/qwen_traceB_blksz_16.jsonl",
        "filename": "qwen_traceB_blksz_16.jsonl",
        "format": "alibaba",
        "size": None,
        "sha256": None,
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
        "sha256": None,
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
        "sha256": None,
        "sha256_prefix": "41ac36d9",
        "requests": 10_812,
        "group": "alibaba",
        "description": "Qwen-Bailian thinking trace (reasoning chat, long outputs), 2 h, 16-token ids",
    },
}

KNOWN_TRACES = TRACES  # alias
FORMATS = ("mooncake", "alibaba", "jsonl", "parquet")


def trace_cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """The download cache: ``cache`` if given, else ``$KVLAB_CACHE``, else ``~/.cache/kvlab/traces``."""
    if cache is not None:
        return Path(cache)
    env = os.environ.get("KVLAB_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvlab" / "traces"


def search_dirs() -> list[Path]:
    """Local trace directories searched before downloading: ``$KVLAB_TRACE_DIRS``, then ../shared/traces."""
    dirs = [Path(d) for d in os.environ.get("KVLAB_TRACE_DIRS", "").split(os.pathsep) if d]
    dirs.append(Path(__file__).resolve().parents[2].parent / "shared" / "traces")
    return dirs


def _entry(name: str) -> dict[str, Any]:
    try:
        return TRACES[name]
    except KeyError:
        raise DownloadError(f"unknown trace {name!r}; known: {', '.join(sorted(TRACES))}") from None


def _size_ok(path: Path, entry: dict[str, Any]) -> bool:
    return entry.get("size") is None or path.stat().st_size == entry["size"]


def find_local(name: str, *, cache: str | os.PathLike | None = None) -> Path | None:
    """The local copy of trace ``name`` (search dirs, then the cache), or None. Checks size only."""
    entry = _entry(name)
    fn, group = entry["filename"], entry.get("group") or ""
    candidates = [p for d in search_dirs() for p in (d / fn, d / group / fn)]
    candidates.append(trace_cache_dir(cache) / fn)
    for p in candidates:
        if p.is_file():
            if _size_ok(p, entry):
                return p
            warnings.warn(
                f"{p}: {p.stat().st_size} B, but {name!r} has {entry['size']} B; ignoring this copy",
                stacklevel=2,
            )
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
    return dest


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

    ``force=True`` skips the local search and re-downloads into the cache.
    """
    entry = _entry(name)
    if not force:
        local = find_local(name, cache=cache_dir)
        if local is not None:
            return local
    dest = trace_cache_dir(cache_dir) / entry["filename"]
    return fetch(
        entry["url"],
        dest,
        size=entry.get("size"),
        sha256=entry.get("sha256"),
        sha256_prefix=entry.get("sha256_prefix"),
        progress=progress,
        timeout=timeout,
    )


def detect_format(path: str | os.PathLike) -> str:
    """Format name of a trace file: by known filename, Parquet magic/extension, or the first line's keys.

    Returns one of ``FORMATS``; raises :class:`TraceFormatError` if nothing matches.
    """
    path = Path(path)
    for entry in TRACES.values():
        if path.name == entry["filename"]:
            return entry["format"]
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic == b"PAR1" or path.suffix.lower() in (".parquet", ".pq"):
            return "parquet"
        f.seek(0)
        first = next(((i, raw) for i, raw in enumerate(f, 1) if raw.strip()), None)
    if first is None:
        raise TraceFormatError(str(path), None, None, "empty file: cannot detect its format")
    ln, raw = first
    try:
        obj = json.loads(raw)
    except ValueError:
        raise TraceFormatError(str(path), ln, None, "first line is not JSON: cannot detect the format") from None
    if type(obj) is not dict:
        raise TraceFormatError(str(path), ln, None, "first line is not a JSON object: cannot detect the format")
    keys = set(obj)
    if "kvlab_trace" in keys or "arrival" in keys:
        return "jsonl"
    if {"chat_id", "parent_chat_id", "hash_ids"} <= keys:
        return "alibaba"
    if {"timestamp", "input_length", "hash_ids"} <= keys:
        return "mooncake"
    raise TraceFormatError(
        str(path), ln, None, f"cannot detect the format from keys {sorted(keys)}; pass format= explicitly"
    )


def resolve_trace(name_or_path: str | os.PathLike, *, format: str | None = None) -> tuple[Path, str]:
    """``(path, format)`` for a registry name (fetched by :func:`download` if needed) or a file path.

    ``format`` overrides detection. Unknown names that are not files raise :class:`ConfigError`.
    """
    if format is not None and format not in FORMATS:
        raise ConfigError(f"unknown trace format {format!r}; known: {', '.join(FORMATS)}")
    key = os.fspath(name_or_path)
    if key in TRACES and not Path(key).is_file():
        return download(key), format or TRACES[key]["format"]
    path = Path(key)
    if not path.is_file():
        raise ConfigError(
            f"trace {key!r} is neither a file nor a known trace name (known: {', '.join(sorted(TRACES))})"
        )
    return path, format or detect_format(path)
