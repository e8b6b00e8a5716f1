"""The trace and text-corpus registry (``traces/registry.json``), local search and verifying downloads.

``traces/registry.json`` (beside the ``kvlab`` package, in the repository's ``traces/`` folder; found in an
editable install, ``pip install -e .``) maps a short name to an entry with ``kind`` (``trace`` or ``text``),
``url``, ``filename``, ``format`` (a :func:`load_trace` format for a trace; ``json`` or ``jsonl`` for a text
corpus), ``size`` (bytes, or None if unknown), ``sha256`` (full hex, or None), ``sha256_prefix`` (hex prefix
known from upstream, or None), ``requests`` (requests of a trace, records of a corpus; or None), ``group``
(sub-folder in a trace directory), ``description``, ``licence``, ``used_for``, ``committed`` (the file is in
the repository under ``traces/<group>/``), ``checksum_source`` and, for a folder of several files,
``files`` (``{member: {size, sha256}}``, each fetched from ``<url>/<member>``). :data:`TRACES` holds the
traces, :data:`CORPORA` the text corpora; both are plain dicts read from the file once, at import.

Search order (:func:`search_dirs`, :func:`find_local`) for any entry: ``<repo>/traces``, each directory of
``$KVLAB_TRACE_DIRS`` (``os.pathsep``-separated), the download cache (``$KVLAB_CACHE``, else
``~/.cache/kvlab/traces``), then ``<repo>/../shared/traces``; in each, ``<dir>/<group>/<filename>`` and then
``<dir>/<filename>``. :func:`download` returns the first copy found and only otherwise fetches the URL into
``<repo>/traces/<group>/<filename>`` (or ``<cache_dir>/<filename>`` when ``cache_dir`` is given), streamed
through ``<file>.part``, verified against the known size and sha256 (or prefix), then renamed atomically
(:mod:`kvlab.workload.fetching`).

The first local copy found is verified against the known size and full sha256 before it is used; a mismatch
raises :class:`~kvlab.errors.ChecksumError` naming the file and both checksums (never a silent use or skip).
Hashes are remembered in the download cache's ``.kvlab-verified.json`` (:func:`file_sha256`), so a second
load hashes nothing. Network or HTTP failures and checksum mismatches of a download raise
:class:`~kvlab.errors.DownloadError` naming the URL and where to put the file by hand.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
from pathlib import Path
from typing import Any

from kvlab.errors import ChecksumError, ConfigError, DownloadError, TraceFileError, TraceFormatError
from kvlab.schema import TRACE_FORMATS
from kvlab.workload._common import check_regular_file, field_label, parse_json_text, trace_file_error
from kvlab.workload.fetching import (
    VERIFY_CACHE,
    check_cache_dir,
    check_folder,
    fetch,
    file_sha256,
    remember_sha256,
    trace_cache_dir,
)
from kvlab.workload.fetching import fetch_verified as _fetch

__all__ = [
    "CORPORA", "FORMATS", "KNOWN_TRACES", "REGISTRY_FILE", "REPO_ROOT", "TRACES", "VERIFY_CACHE", "check_cache_dir",
    "detect_format", "download", "download_command", "fetch", "file_sha256", "find_local", "readme_table",
    "registry_table", "remember_sha256", "repo_traces_dir", "resolve_trace", "search_dirs", "shared_traces_dir",
    "trace_cache_dir", "verify_local",
]

#: the repository root (``Path(kvlab.__file__).resolve().parents[1]``); tests point it at a temporary folder
REPO_ROOT: Path = Path(__file__).resolve().parents[2]
#: the registry file, read once at import
REGISTRY_FILE: Path = REPO_ROOT / "traces" / "registry.json"
KINDS = ("trace", "text")
TEXT_FORMATS = ("json", "jsonl")
_KEYS: dict[str, tuple[type, ...]] = {
    "kind": (str,), "url": (str,), "filename": (str,), "format": (str,), "size": (int, type(None)),
    "sha256": (str, type(None)), "sha256_prefix": (str, type(None)), "requests": (int, type(None)),
    "group": (str,), "description": (str,), "licence": (str,), "used_for": (str,), "committed": (bool,),
    "checksum_source": (str,),
}
_HEX = re.compile(r"[0-9a-f]+")
_SAFE_PATH = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")


def _check_entry(source: str, name: str, e: Any) -> dict[str, Any]:
    """Entry ``name`` of the registry file ``source``, checked; ConfigError naming the entry and field."""
    where = f"{source}: entries.{name}"
    if type(e) is not dict:
        raise ConfigError(f"{where}: expected an object, got {type(e).__name__}")
    for key, types in _KEYS.items():
        if key not in e:
            raise ConfigError(f"{where}: missing {key!r}")
        if type(e[key]) not in types:
            raise ConfigError(f"{where}.{key}: expected {' or '.join(t.__name__ for t in types)}, got {e[key]!r}")
    extra = set(e) - set(_KEYS) - {"files"}
    if extra:
        raise ConfigError(f"{where}: unknown field {sorted(extra)[0]!r}")
    if e["kind"] not in KINDS:
        raise ConfigError(f"{where}.kind: one of {', '.join(KINDS)}, got {e['kind']!r}")
    formats = TRACE_FORMATS if e["kind"] == "trace" else TEXT_FORMATS
    if e["format"] not in formats:
        raise ConfigError(f"{where}.format: one of {', '.join(formats)}, got {e['format']!r}")
    for key in ("filename", "group"):
        if not _SAFE_PATH.fullmatch(e[key]) or ".." in e[key].split("/"):
            raise ConfigError(f"{where}.{key}: a relative path of plain names, got {e[key]!r}")
    for key in ("sha256", "sha256_prefix"):
        if e[key] is not None and not _HEX.fullmatch(e[key]):
            raise ConfigError(f"{where}.{key}: lower-case hex, got {e[key]!r}")
    files = e.get("files")
    if files is not None:
        if type(files) is not dict or not files:
            raise ConfigError(f"{where}.files: a non-empty object {{member: {{size, sha256}}}}")
        for member, f in files.items():
            ok = (_SAFE_PATH.fullmatch(member) and type(f) is dict and set(f) == {"size", "sha256"}
                  and type(f["size"]) is int and type(f["sha256"]) is str and len(f["sha256"]) == 64
                  and _HEX.fullmatch(f["sha256"]))
            if not ok:
                raise ConfigError(f"{where}.files.{member}: expected {{size: int, sha256: 64 hex digits}}")
    return e


def load_registry(path: str | os.PathLike = REGISTRY_FILE) -> dict[str, dict[str, Any]]:
    """Every entry of registry file ``path`` (name -> entry, file order), checked (:func:`_check_entry`)."""
    from kvlab.inputs import load_json_object

    doc = load_json_object(path, "trace registry")
    entries = doc.get("entries")
    if type(entries) is not dict:
        raise ConfigError(f"{path}: expected an 'entries' object (name -> entry)")
    return {name: _check_entry(str(path), name, e) for name, e in entries.items()}


if not REGISTRY_FILE.is_file():  # an installed copy without its repository
    raise ConfigError(f"{REGISTRY_FILE}: kvlab's trace registry is missing; kvlab runs from its repository "
                      "(git clone, then pip install -e .), whose traces/ folder holds registry.json")
_REGISTRY = load_registry()
#: the registered traces (kind ``trace``): name -> entry
TRACES: dict[str, dict[str, Any]] = {n: e for n, e in _REGISTRY.items() if e["kind"] == "trace"}
#: the registered text corpora (kind ``text``): name -> entry
CORPORA: dict[str, dict[str, Any]] = {n: e for n, e in _REGISTRY.items() if e["kind"] == "text"}
KNOWN_TRACES = TRACES  # alias
FORMATS = TRACE_FORMATS  # (kvlab.schema: one list of formats for the loaders and the CLI)


def entries() -> dict[str, dict[str, Any]]:
    """Every registered trace and corpus (:data:`TRACES`, then :data:`CORPORA`)."""
    return {**TRACES, **CORPORA}


# ------------------------------------------------------------------------------------------ where
def repo_traces_dir() -> Path:
    """``<repo>/traces``: searched first, and where :func:`download` puts files (``traces/<group>/``)."""
    return REPO_ROOT / "traces"


def shared_traces_dir() -> Path:
    """``<repo>/../shared/traces``: the development tree's shared data, searched last."""
    return REPO_ROOT.parent / "shared" / "traces"


def search_dirs(cache: str | os.PathLike | None = None) -> list[Path]:
    """The trace directories in search order: ``<repo>/traces``, ``$KVLAB_TRACE_DIRS``, the download cache
    (``cache``, else ``$KVLAB_CACHE``, else ``~/.cache/kvlab/traces``), ``<repo>/../shared/traces``."""
    dirs = [repo_traces_dir()]
    dirs += [Path(d) for d in os.environ.get("KVLAB_TRACE_DIRS", "").split(os.pathsep) if d]
    dirs += [trace_cache_dir(cache), shared_traces_dir()]
    return dirs


def _suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'x'?)`` for a close match of ``word``, else an empty string."""
    lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(lower), n=1, cutoff=0.6)
    return f" (did you mean {lower[close[0]]!r}?)" if close else ""


def _entry(name: str) -> dict[str, Any]:
    """The entry of trace or corpus ``name``; DownloadError naming the closest known name otherwise."""
    e = TRACES.get(name) if type(name) is str else None
    if e is None and type(name) is str:
        e = CORPORA.get(name)
    if e is None:
        known = sorted(entries())
        hint = _suggest(name, known) if type(name) is str else ""
        raise DownloadError(f"unknown trace {name!r}{hint}; known: {', '.join(known)}")
    return e


def download_command(name: str) -> str:
    """The command that fetches registry trace or corpus ``name``: ``kvlab download NAME``."""
    if type(name) is not str or (name not in TRACES and name not in CORPORA):
        known = sorted(entries())
        hint = _suggest(name, known) if type(name) is str else ""
        raise ConfigError(f"{name!r} is not a known trace or corpus{hint} (known: {', '.join(known)})")
    return f"kvlab download {name}"


def _members(entry: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """A folder entry's members (``files``), or None for a single-file entry."""
    return entry.get("files")


# ------------------------------------------------------------------------------------------ verify, find
def _verify_file(name: str, path: Path, size: int | None, want: str | None, prefix: str | None,
                 cache: str | os.PathLike | None) -> Path:
    """``path`` if its size and sha256 are the known ones; ChecksumError naming it and both checksums."""
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
        f"{path}: this local copy of {name!r} is not the published file ({problem}; sha256 {got}, "
        f"expected {expected}). It is truncated, corrupt or another version: delete or replace it "
        f"({download_command(name)} --force fetches a fresh copy).",
    )


def verify_local(name: str, path: str | os.PathLike, *, cache: str | os.PathLike | None = None) -> Path:
    """Check a local copy of ``name`` (a file, or for a folder entry the folder holding every member) against
    the registry's sizes and sha256s; return its path.

    Raises :class:`ChecksumError` naming the file, the expected and the actual sha256 on a mismatch (a missing
    member of a folder is a TraceFileError naming it). The hash is cached (see :func:`file_sha256`), so
    verifying an unchanged file again costs a stat.
    """
    entry = _entry(name)
    path = Path(path)
    members = _members(entry)
    if members is None:
        return _verify_file(name, path, entry.get("size"), entry.get("sha256"), entry.get("sha256_prefix"), cache)
    for member, m in members.items():
        if not (path / member).is_file():
            raise TraceFileError(str(path / member), None, None,
                                 f"missing from this copy of {name!r} ({download_command(name)} fetches it)")
        _verify_file(name, path / member, m["size"], m["sha256"], None, cache)
    return path


def _candidates(entry: dict[str, Any], cache: str | os.PathLike | None) -> list[Path]:
    fn, group = entry["filename"], entry.get("group") or ""
    return [p for d in search_dirs(cache) for p in ((d / group / fn, d / fn) if group else (d / fn,))]


def find_local(name: str, *, cache: str | os.PathLike | None = None) -> Path | None:
    """The verified local copy of trace or corpus ``name`` in the search order (:func:`search_dirs`), or None.

    The first copy found is checked by :func:`verify_local`; a wrong one raises :class:`ChecksumError`. A
    folder entry is found where a folder holds every member (a partial download is passed over).
    """
    entry = _entry(name)
    members = _members(entry)
    for p in _candidates(entry, cache):
        if p.is_file() if members is None else p.is_dir() and all((p / m).is_file() for m in members):
            return verify_local(name, p, cache=cache)
    return None


# ------------------------------------------------------------------------------------------ download
def download(
    name: str,
    cache_dir: str | os.PathLike | None = None,
    *,
    force: bool = False,
    progress: bool | None = None,
    timeout: float = 60.0,
) -> Path:
    """Path of trace or corpus ``name``: a local copy if one exists (module docstring), else downloaded into
    ``<repo>/traces/<group>/`` (``cache_dir``: into ``cache_dir`` instead).

    ``force=True`` skips the local search and downloads again (a verified file replaces the old one
    atomically). A ``cache_dir`` that is a file is refused before any work (:func:`check_cache_dir`); so is a
    target folder that cannot be created or written. A folder entry downloads only its missing members.
    """
    entry = _entry(name)
    if cache_dir is not None:
        check_cache_dir(cache_dir)
    if not force:
        local = find_local(name, cache=cache_dir)
        if local is not None:
            return local
    if cache_dir is not None:
        folder, source = Path(cache_dir), "--cache-dir (cache_dir=)"
    else:
        folder, source = repo_traces_dir() / (entry.get("group") or ""), "the repository's traces folder"
    dest = folder / entry["filename"]
    members = _members(entry)
    made = _new_folders(dest if members is not None else folder)
    try:
        check_folder(folder, source, create=True)
        if members is None:
            return _fetch_one(entry["url"], dest, entry.get("size"), entry.get("sha256"), entry.get("sha256_prefix"),
                              progress, timeout, cache_dir)
        check_folder(dest, "the download folder", create=True)
        for member, m in members.items():
            target = dest / member
            if not force and target.is_file():
                _verify_file(name, target, m["size"], m["sha256"], None, cache_dir)
                continue
            _fetch_one(f"{entry['url'].rstrip('/')}/{member}", target, m["size"], m["sha256"], None, progress,
                       timeout, cache_dir)
        return dest
    except BaseException:
        for made_folder in made:  # deepest first: only the empty folders this call created
            with contextlib.suppress(OSError):
                made_folder.rmdir()
        raise


def _new_folders(path: Path) -> list[Path]:
    """The folders on the way to ``path`` (itself included) that do not exist yet, deepest first."""
    out = []
    while not path.exists() and path != path.parent:
        out.append(path)
        path = path.parent
    return out


def _fetch_one(url: str, dest: Path, size: int | None, sha256: str | None, prefix: str | None,
               progress: bool | None, timeout: float, cache: str | os.PathLike | None) -> Path:
    """Fetch one verified file onto ``dest`` and remember its sha256 (the next load hashes nothing)."""
    path, digest = _fetch(url, dest, size=size, sha256=sha256, sha256_prefix=prefix, progress=progress,
                          timeout=timeout)
    remember_sha256(path, digest, cache=cache)
    return path


# ------------------------------------------------------------------------------------------ tables
def _source(url: str) -> str:
    """``owner/repo@ref`` of a GitHub raw or media URL (refs of 40 hex digits shortened to 7), else the host."""
    m = re.match(r"https://(?:raw|media)\.githubusercontent\.com/(?:media/)?([^/]+)/([^/]+)/([^/]+)/", url)
    if m is None:
        return url.split("/")[2] if "://" in url else url
    ref = m.group(3)
    return f"{m.group(1)}/{m.group(2)}@{ref[:7] if re.fullmatch(r'[0-9a-f]{40}', ref) else ref}"


def readme_table() -> str:
    """The Markdown table of ``traces/README.md``: one row per registered trace and corpus (registry order)."""
    rows = ["| name | kind | source | licence | requests / records | size (bytes) | sha256 | download | used for |",
            "|---|---|---|---|---:|---:|---|---|---|"]
    for name, e in entries().items():
        members = _members(e)
        size = "unknown" if e["size"] is None else f"{e['size']:,}"
        if members is not None:
            sha = f"{len(members)} files: per file in registry.json"
            size = f"{size} ({len(members)} files)"
        else:
            sha = f"`{e['sha256']}`" if e["sha256"] else f"`{e['sha256_prefix']}…`"
        n = "unknown" if e["requests"] is None else f"{e['requests']:,}"
        where = f"traces/{e['group']}/{e['filename']}"
        get = f"`{download_command(name)}`" + (f" (committed: {where})" if e["committed"] else "")
        cells = [f"`{name}`", e["kind"], f"[{_source(e['url'])}]({e['url']})", e["licence"], n, size, sha, get,
                 e["used_for"]]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def registry_table(*, locate: bool = True) -> str:
    """``kvlab download --list``: one line per trace and corpus: name, kind, size, requests or records, and
    where it is (``locate``: the verified local path, else the download command)."""
    lines = [f"{'name':<24} {'kind':<5} {'size':>13} {'n':>8}  {'here' if locate else 'description'}"]
    for name, e in entries().items():
        size = "?" if e.get("size") is None else f"{e['size']:,}"
        n = "?" if e.get("requests") is None else f"{e['requests']:,}"
        if locate:
            try:
                path = find_local(name)
                where = str(path) if path is not None else f"not here: {download_command(name)}"
            except (ChecksumError, TraceFileError) as err:
                where = f"wrong copy ({err.path}): {download_command(name)} --force"
        else:
            where = e.get("description", "")
        lines.append(f"{name:<24} {e.get('kind', 'trace'):<5} {size:>13} {n:>8}  {where}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ traces

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
    if "messages" in keys and "kvlab_trace" not in keys:  # a messages file (kvlab.workload.messages)
        return "messages"
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
    if key in CORPORA and not path.is_file():
        raise ConfigError(f"{key!r} is a text corpus, not a trace: `{download_command(key)}` prints its path "
                          "(kvlab.workload.sources reads it)")
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
