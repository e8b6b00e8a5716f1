"""Shared fixtures. Real data lives outside the repository, in ``<repo>/../shared/traces``.

Tests that need it skip when it is absent, except under ``CI=true``, where a missing file is a failure.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


@pytest.fixture(autouse=True, scope="session")
def _private_trace_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests write their trace cache (downloads, verified checksums) under a temporary folder, never the
    user's ``~/.cache/kvlab``."""
    if "KVLAB_CACHE" not in os.environ:
        os.environ["KVLAB_CACHE"] = str(tmp_path_factory.mktemp("kvlab-cache"))


def _missing(what: str) -> None:
    msg = f"needs ../shared/traces/{what}" if what else "needs ../shared/traces"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg + " (CI=true: shared data must be present)")
    pytest.skip(msg)


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """``<repo>/../shared/traces`` (skip if absent; fail under CI=true)."""
    if not SHARED_TRACES.is_dir():
        _missing("")
    return SHARED_TRACES


@pytest.fixture(scope="session")
def shared_file() -> Callable[[str], Path]:
    """``shared_file("mooncake/conversation_trace.jsonl")`` → that path (skip if absent; fail if CI=true)."""

    def get(rel: str) -> Path:
        path = SHARED_TRACES / rel
        if not path.exists():
            _missing(rel)
        return path

    return get
