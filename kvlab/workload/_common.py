"""Shared helpers of the trace loaders: line parsing, typed field access, checksums, atomic writes.

Every validation failure raises :class:`~kvlab.errors.TraceFormatError` with the file, the 1-based line
and the field. Integers must be JSON integers (``true``, ``"12"`` and ``12.0`` are rejected); numbers
(timestamps in seconds) may be integers or floats but never booleans, NaN or infinite. A file that
cannot be read at all raises :class:`~kvlab.errors.TraceFileError` (a TraceFormatError without a line).

Token counts (``input_length``, ``output_length``, block sizes) are capped at ``MAX_REQUEST_TOKENS``, so
a record that claims 10**15 tokens is refused with its field named instead of being allocated later.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from kvlab.errors import ConfigError, TraceFileError, TraceFormatError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_REQUEST_TOKENS = 2**28  # 268 M tokens: far beyond any model's context, and 2 GiB as expanded int64 ids
_MISSING = object()
_BOM = "\ufeff"


def read_trace_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of trace file ``path``; a missing file, a directory or an unreadable file is a TraceFileError."""
    check_regular_file(path)
    try:
        return Path(path).read_bytes()
    except (OSError, ValueError) as e:
        raise trace_file_error(path, e) from None


def check_regular_file(path: str | os.PathLike) -> None:
    """Raise TraceFileError unless ``path`` is a regular file (opening a pipe or device could block forever)."""
    try:
        mode = Path(path).stat().st_mode
    except (OSError, ValueError) as e:
        raise trace_file_error(path, e) from None
    if stat.S_ISDIR(mode):
        raise TraceFileError(str(path), None, None, "is a directory, not a trace file")
    if not stat.S_ISREG(mode):
        raise TraceFileError(str(path), None, None, "is not a regular file (a pipe or device?)")


def trace_file_error(path: str | os.PathLike, e: OSError | ValueError) -> TraceFileError:
    """The one-line TraceFileError for an OSError (or a ValueError for a bad path) while opening ``path``."""
    if isinstance(e, IsADirectoryError):
        return TraceFileError(str(path), None, None, "is a directory, not a trace file")
    if isinstance(e, FileNotFoundError):
        return TraceFileError(str(path), None, None, "no such file")
    if isinstance(e, PermissionError):
        return TraceFileError(str(path), None, None, "permission denied: cannot read this file")
    if isinstance(e, OSError):
        return TraceFileError(str(path), None, None, f"cannot read: {e.strerror or type(e).__name__}")
    return TraceFileError(ascii(str(path)), None, None, f"not a usable path ({e})")  # e.g. a NUL byte


def one_line(text: str, limit: int = 300) -> str:
    """A library's message as one printable line: first line only, control characters escaped, capped."""
    first = (text.strip().splitlines() or [""])[0]
    if not first.isprintable():
        first = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in first)
    return first if len(first) <= limit else first[: limit - 3] + "..."


def field_label(key: str) -> str:
    """``key`` as it may appear in a one-line message: printable and at most 40 characters."""
    if key.isprintable() and len(key) <= 40:
        return key
    text = ascii(key)[1:-1] if not key.isprintable() else key
    return text if len(text) <= 40 else text[:37] + "..."


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def describe(value: Any) -> str:
    """Short description of a JSON value for error messages."""
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, str):
        s = value if len(value) <= 20 else value[:17] + "..."
        return f"string {s!r}"
    if isinstance(value, float):
        return f"float {value!r}"
    if value is None:
        return "null"
    if isinstance(value, list):
        return f"list of {len(value)}"
    if isinstance(value, dict):
        return "object"
    text = repr(value)
    if len(text) > 40:
        text = f"{text[:20]}... ({len(text)} chars)"
    return f"{type(value).__name__} {text}"


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``object_pairs_hook`` that refuses an object naming one key twice (which value would count?)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return obj


_decoder = json.JSONDecoder(object_pairs_hook=_unique_keys)
_decode = _decoder.decode
_scan_once = _decoder.scan_once  # the C scanner: no whitespace regexes, for the common clean line


def parse_json_text(path: str, ln: int | None, text: str | bytes) -> Any:
    """One JSON document (a line, a file, a metadata blob) or a TraceFormatError at ``path:ln``.

    A leading UTF-8 byte-order mark is ignored; duplicate keys, non-UTF-8 bytes, integer literals beyond
    Python's digit limit and nesting too deep to parse are errors like any other invalid JSON.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceFormatError(path, ln, None, f"not UTF-8 ({e.reason} at byte {e.start})") from None
    if text.startswith(_BOM):
        text = text[1:]
    try:
        return _decode(text)
    except json.JSONDecodeError as e:
        raise TraceFormatError(
            path, ln, None, f"invalid JSON ({e.msg} at column {e.colno}); truncated or corrupt line?"
        ) from None
    except _DuplicateKey as e:
        raise TraceFormatError(path, ln, field_label(e.key), "duplicate key in one JSON object") from None
    except RecursionError:
        raise TraceFormatError(path, ln, None, "invalid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer literal beyond Python's digit limit
        raise TraceFormatError(path, ln, None, f"invalid JSON ({one_line(str(e), 200)})") from None


def iter_json_lines(path: str, data: bytes) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_no, object)`` for each non-blank line; a line that is not a JSON object is an error.

    Lines end in LF or CRLF; a UTF-8 byte-order mark at the start of the file is ignored. Lines are
    decoded one at a time, so the first bad line in file order is the one reported.
    """
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    for ln, chunk in enumerate(data.split(b"\n"), 1):
        try:
            raw = chunk.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceFormatError(path, ln, None, f"not UTF-8 ({e.reason} at byte {e.start} of the line)") from None
        if not raw or raw.isspace():
            continue
        try:
            obj, end = _scan_once(raw, 0)
        except Exception:  # StopIteration, duplicate keys, deep nesting...: parse again for the message
            end = -1
        if end != len(raw):  # leading/trailing whitespace (CRLF), extra data or an error
            obj = parse_json_text(path, ln, raw)
        if type(obj) is not dict:
            raise TraceFormatError(path, ln, None, f"expected a JSON object, got {describe(obj)}")
        yield ln, obj


def get_int(
    path: str,
    ln: int | None,
    obj: dict,
    key: str,
    *,
    min_value: int | None = None,
    max_value: int | None = None,
    default: Any = _MISSING,
) -> int:
    """``obj[key]`` as a JSON integer (not bool/str/float) within int64, ``>= min_value``, ``<= max_value``."""
    v = obj.get(key, _MISSING)
    if v is _MISSING:
        if default is _MISSING:
            raise TraceFormatError(path, ln, key, "missing required field")
        return default
    if type(v) is not int:
        raise TraceFormatError(path, ln, key, f"expected an integer, got {describe(v)}")
    if min_value is not None and v < min_value:
        raise TraceFormatError(path, ln, key, f"must be >= {min_value}, got {_short_int(v)}")
    if max_value is not None and v > max_value:
        raise TraceFormatError(path, ln, key, f"must be <= {max_value:,}, got {_short_int(v)}")
    if v > INT64_MAX or v < INT64_MIN:
        raise TraceFormatError(path, ln, key, f"{_short_int(v)} does not fit in int64")
    return v


def get_length(path: str, ln: int | None, obj: dict, key: str, *, default: Any = _MISSING) -> int:
    """A token count: a JSON integer in ``[0, MAX_REQUEST_TOKENS]``."""
    v = obj.get(key)
    if type(v) is int and 0 <= v <= MAX_REQUEST_TOKENS:
        return v
    return get_int(path, ln, obj, key, min_value=0, max_value=MAX_REQUEST_TOKENS, default=default)


def block_size_arg(where: str, value: Any) -> int:
    """A loader's ``block_size`` argument: an int in ``[1, MAX_REQUEST_TOKENS]``, else a ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 1 <= value <= MAX_REQUEST_TOKENS:
        raise ConfigError(f"{where}: block_size must be an int in [1, {MAX_REQUEST_TOKENS:,}], got {value!r}")
    return int(value)


def _short_int(v: int) -> str:
    text = str(v)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def get_number(path: str, ln: int, obj: dict, key: str) -> float:
    """``obj[key]`` as a finite JSON number (int or float, not bool/str)."""
    v = obj.get(key, _MISSING)
    if v is _MISSING:
        raise TraceFormatError(path, ln, key, "missing required field")
    if type(v) is not float and type(v) is not int:
        raise TraceFormatError(path, ln, key, f"expected a number, got {describe(v)}")
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise TraceFormatError(path, ln, key, f"must be a finite float64, got {describe(v)}")
    return f


def get_str(path: str, ln: int, obj: dict, key: str, *, default: Any = _MISSING) -> str:
    """``obj[key]`` as a JSON string."""
    v = obj.get(key, _MISSING)
    if v is _MISSING:
        if default is _MISSING:
            raise TraceFormatError(path, ln, key, "missing required field")
        return default
    if type(v) is not str:
        raise TraceFormatError(path, ln, key, f"expected a string, got {describe(v)}")
    return v


def check_int_list(path: str, ln: int | None, key: str, v: Any, *, min_value: int = 0) -> list[int]:
    """``v`` as a list of JSON integers in ``[min_value, INT64_MAX]``."""
    if type(v) is not list:
        raise TraceFormatError(path, ln, key, f"expected a list of integers, got {describe(v)}")
    if not v:
        return v
    if set(map(type, v)) != {int}:
        bad = next(x for x in v if type(x) is not int)
        raise TraceFormatError(path, ln, key, f"expected a list of integers, found {describe(bad)}")
    lo, hi = min(v), max(v)
    if lo < min_value:
        raise TraceFormatError(path, ln, key, f"values must be >= {min_value}, found {_short_int(lo)}")
    if hi > INT64_MAX:
        raise TraceFormatError(path, ln, key, f"value {_short_int(hi)} does not fit in int64")
    return v


def get_int_list(path: str, ln: int, obj: dict, key: str, *, min_value: int = 0) -> list[int]:
    """``obj[key]`` as a list of non-negative (``>= min_value``) JSON integers."""
    v = obj.get(key, _MISSING)
    if v is _MISSING:
        raise TraceFormatError(path, ln, key, "missing required field")
    return check_int_list(path, ln, key, v, min_value=min_value)


def check_block_count(path: str, ln: int, key: str, n_ids: int, input_length: int, block_size: int) -> None:
    """Require ``n_ids == ceil(input_length / block_size)``."""
    expected = -(-input_length // block_size)
    if n_ids != expected:
        raise TraceFormatError(
            path,
            ln,
            key,
            f"has {n_ids} block ids, expected ceil(input_length {input_length} / block_size {block_size}) = {expected}",
        )


def csr(counts: list[int] | np.ndarray) -> np.ndarray:
    """CSR offsets (int64, n + 1 entries starting at 0) from per-row counts."""
    counts = np.asarray(counts, dtype=np.int64)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


def int_array(values: list[int]) -> np.ndarray:
    """A flat list of Python ints (already range-checked) as int64."""
    return np.array(values, dtype=np.int64) if values else np.zeros(0, dtype=np.int64)


def _default_mode(path: str) -> None:
    """Make a mkstemp file (created 0600) world-readable like a plain data file (0644)."""
    os.chmod(path, 0o644)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kw: Any) -> Iterator[IO]:
    """Open a temp file beside ``path``; on success fsync and ``os.replace`` it onto ``path``.

    On any exception the temp file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        _default_mode(tmp)
        with os.fdopen(fd, mode, **kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside ``path`` for a writer that opens files itself; rename it onto ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        _default_mode(tmp)
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class Tokenizer(Protocol):
    """Anything with ``encode(str) -> list[int]`` (a Hugging Face tokenizer qualifies)."""

    def encode(self, text: str) -> list[int]: ...


def encode_text(tokenizer: Tokenizer, text: str, *, continuation: bool = False) -> list[int]:
    """Token ids of ``text`` as Python ints.

    ``continuation=True`` marks a piece appended to an already tokenised prompt: Hugging Face tokenizers
    are then called with ``add_special_tokens=False`` so no second BOS lands mid-prompt (tokenizers
    without that keyword are called plainly). A ``tokenizers.Encoding`` result is unwrapped via ``.ids``.
    """
    if continuation:
        try:
            ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[call-arg]
        except TypeError:
            ids = tokenizer.encode(text)
    else:
        ids = tokenizer.encode(text)
    if hasattr(ids, "ids"):
        ids = ids.ids
    return [int(x) for x in ids]
