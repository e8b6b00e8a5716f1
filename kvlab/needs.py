"""What a notebook needs from the trace and corpus registry, checked in its first code cell.

Every notebook's first code cell calls :func:`require` with the registry names (traces and text corpora,
``traces/registry.json``; :func:`kvlab.workload.registry.find_local`) of the data it reads; ``require()`` with
no name states that it runs on embedded data only (generated workloads, the committed ``traces/text`` corpora,
the committed ``kvlab-bpe`` vocabulary). When a name has no verified local copy, :class:`DataNeeded` stops the
notebook with one line naming the ``kvlab download`` commands (:func:`needs_line`); IPython shows that line
instead of a traceback, papermill reports it as the cell's error, and ``kvlab figures`` reads the commands back
(:func:`commands_in`) to list which notebooks need which downloads.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvlab.errors import NEEDS_AND as AND
from kvlab.errors import NEEDS_RUN as RUN
from kvlab.errors import KvlabError, needs_line


class DataNeeded(KvlabError, RuntimeError):
    """Registry data a notebook needs is not here. ``names``: the missing registry names; ``commands``: the
    ``kvlab download`` command of each, in the same order. The message is one line
    (:func:`kvlab.errors.needs_line`)."""

    def __init__(self, names: list[str], commands: list[str]) -> None:
        self.names = list(names)
        self.commands = list(commands)
        super().__init__(needs_line(self.names, self.commands))

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for this error (instead of a traceback): the one line."""
        return [f"{type(self).__name__}: {self}"]


def commands_in(text: str) -> list[str]:
    """The ``kvlab download`` commands of a :func:`needs_line` found in ``text`` (e.g. a notebook's error
    line as papermill reports it); [] when ``text`` holds none."""
    match = re.search(r"needs data that is not here: [^;\n]*" + re.escape(RUN) + r"([^\n]*?)\s*$", text)
    if match is None:
        return []
    return [c.strip() for c in match.group(1).split(AND.strip()) if c.strip()]


def require(*names: str) -> dict[str, Path]:
    """The verified local path of each registry name in ``names`` (the registry's search order: ``<repo>/traces``,
    ``$KVLAB_TRACE_DIRS``, the download cache, ``../shared/traces``); raises :class:`DataNeeded` (one line naming
    every missing name and its ``kvlab download`` command) when any is not here. ``require()`` with no name
    declares that the caller needs no download and returns ``{}``. An unknown name raises the registry's
    one-line error, a local copy with the wrong sha256 its ChecksumError."""
    from kvlab.workload.registry import download_command, find_local

    found = {n: find_local(n) for n in dict.fromkeys(names)}
    absent = [n for n, p in found.items() if p is None]
    if absent:
        raise DataNeeded(absent, [download_command(n) for n in absent])
    return {n: p for n, p in found.items() if p is not None}


__all__ = ["AND", "RUN", "DataNeeded", "commands_in", "needs_line", "require"]
