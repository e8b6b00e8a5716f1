"""Errors kvlab raises for bad input. Every message names the file, line and field where known."""

from __future__ import annotations


class KvlabError(Exception):
    """Base class of kvlab's own errors."""


def printable(text: str) -> str:
    """``text`` with control characters (newlines included) escaped, so a message stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class TraceFormatError(KvlabError, ValueError):
    """A trace file is malformed. Carries ``path``, ``line`` (1-based, or None) and ``field`` (or None)."""

    def __init__(self, path: str, line: int | None, field: str | None, message: str) -> None:
        self.path, self.line, self.field, self.message = str(path), line, field, message
        where = printable(str(path))
        if line is not None:
            where += f":{line}"
        if field is not None:
            where += f": field '{field}'"
        super().__init__(f"{where}: {message}")


class ConfigError(KvlabError, ValueError):
    """A configuration value is invalid (names the option)."""


class CapacityError(KvlabError, RuntimeError):
    """The cache cannot satisfy an operation (e.g. reset while requests run)."""


class DownloadError(KvlabError, RuntimeError):
    """A public trace could not be fetched (offline, checksum mismatch, unknown name)."""


class TraceFileError(TraceFormatError):
    """A trace path cannot be read as a file (missing, a directory, permission denied); ``line`` is None."""


class ChecksumError(DownloadError):
    """A trace file's size or sha256 differs from the registry's. Carries ``path``, ``expected``, ``actual``."""

    def __init__(self, path: str, expected: str | None, actual: str, message: str) -> None:
        self.path, self.expected, self.actual = str(path), expected, actual
        super().__init__(message)


class ResultsError(KvlabError, ValueError):
    """A results folder or file cannot be read: names the file and what is wrong (missing, bad JSON,
    truncated, checksum mismatch, unreadable parquet)."""


class ResultsLocationError(KvlabError, ValueError):
    """An output location is refused before anything is written (not empty and not a kvlab result of
    the right kind, a file, a symbolic link, not writable); the message names the path and what to do."""


NEEDS_RUN = "; run: "
"""The words between the missing names and the commands in :func:`needs_line` (what kvlab.needs parses back)."""
NEEDS_AND = " && "
"""The separator of several commands in :func:`needs_line`: one shell line that fetches them all."""


def needs_line(names: list[str], commands: list[str], detail: str = "") -> str:
    """The one line for registry data that is not here: ``needs data that is not here: a, b[ (detail)]; run:
    kvlab download a && kvlab download b`` (``commands``: each name's ``kvlab download`` command, in order).
    Notebooks (:mod:`kvlab.needs`) and the text loaders (:mod:`kvlab.workload.sources`) both say it, and
    ``kvlab figures`` reads the commands back out of it."""
    where = f" ({detail})" if detail else ""
    return f"needs data that is not here: {', '.join(names)}{where}{NEEDS_RUN}{NEEDS_AND.join(commands)}"
