"""Run identity: everything that changes a run's numbers, hashed into its ``run_id``.

Invariants: two runs with equal identities give equal numbers (up to timing columns), so a finished run
with the same ``run_id`` may be reused instead of recomputed. The identity holds

* ``semantics_version``: :data:`SEMANTICS_VERSION`, bumped whenever any driver's numbers change for the
  same inputs (tests/test_golden_numbers.py fails until it is bumped and the golden file re-recorded);
* ``config``: the driver config with every default filled in (for replays ``kvlab.replay.resolve_config``:
  block size, the policy's parameters with its constructor defaults), as plain JSON;
* ``trace``: the number-affecting part of ``Workload.identity()``: ``content_sha256`` (covers every column,
  so a ``--limit`` or another file changes it), ``kind`` and ``trace_block_size``. Names and paths are
  left out: renaming a trace file does not change its numbers.
"""

from __future__ import annotations

import hashlib
import json

from kvlab.results.jsonio import json_default

SEMANTICS_VERSION: int = 1
TRACE_FIELDS = ("content_sha256", "kind", "trace_block_size")
RUN_ID_HEX = 20


def _plain(obj: object) -> object:
    """``obj`` as plain JSON values (numpy scalars, tuples and paths converted), so that an identity read
    back from a manifest hashes to the same ``run_id``."""
    return json.loads(json.dumps(obj, sort_keys=True, default=json_default))


def run_identity(config: dict, trace: dict) -> dict:
    """``{"semantics_version", "config", "trace"}`` of a run; ``trace`` is ``Workload.identity()`` (or any
    dict with :data:`TRACE_FIELDS`), ``config`` the fully resolved config as a dict."""
    missing = [f for f in TRACE_FIELDS if f not in trace]
    if missing:
        raise ValueError(f"trace identity lacks {missing} (pass Workload.identity())")
    return {
        "semantics_version": SEMANTICS_VERSION,
        "config": _plain(config),
        "trace": _plain({f: trace[f] for f in TRACE_FIELDS}),
    }


def run_id(identity: dict) -> str:
    """A stable id of an identity: the first 20 hex digits of the sha256 of its sorted compact JSON."""
    text = json.dumps(_plain(identity), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:RUN_ID_HEX]


__all__ = ["SEMANTICS_VERSION", "TRACE_FIELDS", "run_id", "run_identity"]
