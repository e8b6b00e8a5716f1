"""JSON text for results files: numpy scalars and arrays converted, keys sorted by default."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def json_default(obj: object) -> object:
    """``json.dumps`` fallback: numpy numbers and arrays, paths."""
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def dumps(obj: object, *, sort_keys: bool = True) -> str:
    """JSON text with numpy scalars converted; keys sorted by default (stable for diffs and hashing)."""
    return json.dumps(obj, indent=2, sort_keys=sort_keys, default=json_default)


__all__ = ["dumps", "json_default"]
