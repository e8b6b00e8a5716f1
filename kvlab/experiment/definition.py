"""An experiment's definition and its hash: what ``kvlab run`` records so that two different experiments never
share a results folder silently (docs/experiments.md, "Definitions").

The definition is the validated experiment, normalised (defaults filled in, existing file paths absolute), without
the fields that never change a run's numbers (:data:`NOT_IN_DEFINITION`); its hash is the sha256 of its canonical
JSON, so comments, key order and spelling out defaults do not change it.
"""

from __future__ import annotations

import hashlib
import json
import os

from kvlab.experiment.config import Experiment

#: top-level fields left out of the definition: neither changes a run's numbers (``analysis`` is applied when
#: results are read; ``description`` is prose)
NOT_IN_DEFINITION = ("analysis", "description")


def _absolute(value: object) -> object:
    """A path that exists, absolute (so the directory kvlab runs from does not change the definition)."""
    return os.path.abspath(value) if isinstance(value, str) and os.path.exists(value) else value


def definition(experiment: Experiment) -> dict:
    """The experiment's definition: its validated, normalised fields (defaults filled in, file paths absolute)
    without :data:`NOT_IN_DEFINITION`; what :func:`definition_hash` hashes."""
    data = experiment.model_dump(mode="json", exclude=set(NOT_IN_DEFINITION))
    data["trace"]["path"] = _absolute(data["trace"]["path"])
    if isinstance(data.get("engine"), dict):
        data["engine"]["model"] = _absolute(data["engine"]["model"])
    for kind in ("grid", "zip"):
        for axis in ("trace.path", "engine.model"):
            if axis in data["sweep"][kind]:
                data["sweep"][kind][axis] = [_absolute(v) for v in data["sweep"][kind][axis]]
    return data


def definition_hash(experiment: Experiment) -> str:
    """sha256 (hex) of the canonical JSON of :func:`definition` (sorted keys, no spaces): comments, key order,
    defaults spelled out or not, ``analysis:`` and ``description:`` do not change it; any field that can change
    a run (or the set of runs) does. Recorded as ``"experiment": {"name", "definition"}`` in the experiment
    folder's manifest and in each run's manifest."""
    text = json.dumps(definition(experiment), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def record(experiment: Experiment) -> dict:
    """``{"name", "definition"}``: the ``"experiment"`` entry of the experiment folder's manifest (runs' manifests
    hold the same two keys in theirs)."""
    return {"name": experiment.name, "definition": definition_hash(experiment)}


__all__ = ["NOT_IN_DEFINITION", "definition", "definition_hash", "record"]
