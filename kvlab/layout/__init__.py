"""Prompt-layout transforms and the layout study (docs/layout.md, "Layout transforms" and "Study").

A transform is a pure function of one request's messages (plus its adapter and template date), registered by
name (:mod:`kvlab.layout.registry`: :data:`TRANSFORMS`, :func:`make_layout`); :func:`layout_workload` applies a
layout to generated requests and renders each prompt once. Groups: :mod:`kvlab.layout.volatile` (volatile
content, system edits, date, adapters), :mod:`kvlab.layout.order` (tools, documents), :mod:`kvlab.layout.history`
(truncation, reasoning).
The study is :mod:`kvlab.layout.study`. Names are imported on first use (``kvlab layout-study --help`` stays fast).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TRANSFORMS": "registry", "Layout": "base", "LayoutRequest": "base", "RequestContext": "base", "Transform": "base",
    "get_transform": "registry", "make_layout": "registry", "request_rng": "base",
    "RenderCache": "apply", "apply_layout": "apply", "layout_workload": "apply", "render_layout": "apply",
    "LayoutStudyConfig": "config", "LayoutStudyResult": "study", "run_study": "study",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlab.layout' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvlab.layout.{module}"), name)
