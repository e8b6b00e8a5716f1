"""Apply a layout to generated requests and render each transformed prompt once into a token Workload.

Every transformed request is rendered with the tokenizer's chat template and tokenised once
(:func:`kvlab.workload.render.render_prompt`); segment spans come from the tokenizer's offsets. Identical
transformed requests (same messages and date) are rendered once per :class:`RenderCache`, so layouts that leave
a request unchanged cost nothing more.

The date. :class:`~kvlab.layout.base.LayoutRequest` ``date_string`` None renders as the family generated it
(a date-injecting template writes its fixed default date). Otherwise a template that injects the date gets it
as ``date_string``; for a template that injects none (kvlab's ChatML, the plain layout) the header Llama-3.1's
template writes (:data:`DATE_HEADER`) is written at the top of the system message as a ``volatile`` part, so
``date_injected`` vs ``date_fixed`` measures the same thing under every tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import pandas as pd

from kvlab.errors import ConfigError
from kvlab.layout.base import Layout, LayoutRequest, Messages, RequestContext, add_to_system
from kvlab.workload.families.base import request_columns
from kvlab.workload.render import Part, RenderedPrompt, render_prompt, rendered_workload
from kvlab.workload.tokenizer import TextTokenizer
from kvlab.workload.workload import Workload

DATE_HEADER = "Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
"""What Llama-3.1's chat template writes at the top of the system turn (``date_string`` in ``{date}``)."""


class RequestLike(Protocol):
    """What a layout reads of a generated request (:class:`kvlab.workload.families.base.GeneratedRequest`)."""

    messages: Messages
    arrival: float
    output_tokens: int
    session: int
    turn: int
    tenant: int
    category: str


class RenderCache:
    """Rendered prompts of one tokenizer, keyed by (messages, date); counts renders and reuses."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.prompts: dict[tuple, RenderedPrompt] = {}
        self.renders = 0
        self.reused = 0

    def render(self, req: LayoutRequest) -> RenderedPrompt:
        key = (req.messages, req.date_string)
        hit = self.prompts.get(key)
        if hit is not None:
            self.reused += 1
            return hit
        self.renders += 1
        out = self.prompts[key] = render_layout(self.tokenizer, req)
        return out


def render_layout(tokenizer: TextTokenizer, req: LayoutRequest) -> RenderedPrompt:
    """Render one laid-out request (the date as the module docstring says)."""
    messages = req.messages
    if req.date_string is not None and not tokenizer.injects_date:
        messages = add_to_system(messages, Part("volatile", DATE_HEADER.format(date=req.date_string)), "top")
    return render_prompt(tokenizer, messages, date_string=req.date_string)


def contexts(requests: Sequence[RequestLike], *, seed: int = 0, clock_start: float = 0.0) -> list[RequestContext]:
    """One :class:`RequestContext` per request (row ``i``, its arrival, session, turn and tenant)."""
    return [RequestContext(index=i, arrival=float(r.arrival), session=int(r.session), turn=int(r.turn),
                           tenant=int(r.tenant), seed=seed, clock_start=clock_start)
            for i, r in enumerate(requests)]


def apply_layout(requests: Sequence[RequestLike], layout: Layout, *, seed: int = 0,
                 clock_start: float = 0.0) -> list[LayoutRequest]:
    """``layout`` applied to every request (nothing rendered)."""
    return [layout(LayoutRequest(tuple(r.messages)), ctx)
            for r, ctx in zip(requests, contexts(requests, seed=seed, clock_start=clock_start), strict=True)]


def layout_workload(
    requests: Sequence[RequestLike],
    layout: Layout,
    tokenizer: TextTokenizer,
    *,
    seed: int = 0,
    clock_start: float = 0.0,
    name: str = "layout",
    cache: RenderCache | None = None,
    meta: dict | None = None,
) -> Workload:
    """A segmented token :class:`Workload` of ``requests`` (in arrival order, stable) laid out by ``layout``.

    Columns as :func:`kvlab.workload.families.family_workload` writes them (``session``, ``turn``, ``parent``,
    ``tenant`` as ``tenant<k>``, ``category``; known output ids when every request has a response text, so the
    simulator caches what a request generated), plus the ``adapter`` column when the layout sets adapters.
    ``meta["layout"]`` records the layout (label and steps), ``meta["tokenizer"]`` the tokenizer."""
    if not requests:
        raise ConfigError(f"layout_workload {name!r}: no requests")
    reqs = sorted(requests, key=lambda r: r.arrival)
    cache = cache or RenderCache(tokenizer)
    laid = apply_layout(reqs, layout, seed=seed, clock_start=clock_start)
    prompts = [cache.render(r) for r in laid]
    adapters = [r.adapter for r in laid]
    columns, out_len = request_columns(reqs, tokenizer)
    if any(a is not None for a in adapters):
        columns["adapter"] = pd.Categorical(adapters)
    return rendered_workload(
        prompts, tokenizer, arrival=[r.arrival for r in reqs], output_length=out_len, name=name,
        meta={**(meta or {}), "layout": {"label": layout.label, "steps": layout.identity()}}, **columns,
    )
