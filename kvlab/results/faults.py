"""Fault points for crash tests: :func:`checkpoint` kills its own process at a chosen moment.

Set ``KVLAB_FAULT_KILL="phase:N"`` (several as ``"a:N,b:M"``) and the N-th call of
``checkpoint("phase")`` in a process sends SIGKILL to that process, exactly like ``kill -9`` from
outside. Without the variable a checkpoint is one dictionary look-up and does nothing.

Phases placed in kvlab: ``run-file`` (after each file of a run is written into its temporary folder),
``run-commit`` (a run's temporary folder complete, before it is renamed into place), ``run-swapped``
(a replaced run's old copy not yet deleted), ``table-commit`` (a sweep table or its manifest written to
its temporary, before the rename) and ``between-runs`` (after a sweep run and its table update).
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "KVLAB_FAULT_KILL"
PHASES = ("run-file", "run-commit", "run-swapped", "table-commit", "between-runs")
_calls: Counter[str] = Counter()


def checkpoint(phase: str) -> None:
    """Count a call of ``phase``; SIGKILL this process if ``KVLAB_FAULT_KILL`` names this call."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    _calls[phase] += 1
    for item in spec.split(","):
        name, _, n = item.strip().partition(":")
        if name == phase and n.isdigit() and _calls[phase] == int(n):
            os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["ENV", "PHASES", "checkpoint"]
