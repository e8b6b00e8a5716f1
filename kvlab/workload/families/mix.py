"""Mixes of families: (family config, weight) pairs interleaved deterministically by arrival.

Each component is generated from its own config (its own seed); with ``n_requests`` set, component ``i``
keeps its earliest ``round(n_requests * weight_i / sum(weights))`` requests (largest remainders; earlier
turns of a session always come before later ones, so no kept turn loses its parent). Sessions and tenants
are renumbered so that ids of different components never collide (component order, then the component's
own ids). The merged stream is sorted by ``(arrival, component, position)``: the same config always gives
the same interleaving.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from kvlab.schema import Schema
from kvlab.workload.families.agent import AgentConfig
from kvlab.workload.families.base import GeneratedRequest
from kvlab.workload.families.chat import ChatConfig
from kvlab.workload.families.rag import RAGConfig
from kvlab.workload.families.registry import generate_family
from kvlab.workload.families.system_prompt import SystemPromptConfig

AnyFamilyConfig = Annotated[SystemPromptConfig | RAGConfig | ChatConfig | AgentConfig, Field(discriminator="family")]


class MixComponent(Schema):
    """One family config and its weight (a share of the requests when the mix has ``n_requests``)."""

    config: AnyFamilyConfig
    weight: Annotated[float, Field(gt=0)] = 1.0


class MixConfig(Schema):
    """Several families in one request stream (module docstring)."""

    family: Literal["mix"] = "mix"
    components: Annotated[list[MixComponent], Field(min_length=1)]
    n_requests: Annotated[int, Field(ge=0)] | None = None


def _quotas(n: int, weights: list[float]) -> list[int]:
    share = np.array(weights) / sum(weights) * n
    q = np.floor(share).astype(int)
    for j in np.argsort(-(share - q), kind="stable")[: n - int(q.sum())]:
        q[j] += 1
    return q.tolist()


def generate_mix(config: MixConfig) -> list[GeneratedRequest]:
    """The merged requests of ``config`` (module docstring)."""
    parts = [generate_family(c.config) for c in config.components]
    if config.n_requests is not None:
        parts = [p[:q] for p, q in zip(parts, _quotas(config.n_requests, [c.weight for c in config.components]),
                                        strict=True)]
    keyed = []
    s_off = t_off = 0
    for ci, reqs in enumerate(parts):
        for j, r in enumerate(reqs):
            meta = {**r.meta, "component": ci}
            keyed.append(((r.arrival, ci, j), dataclasses.replace(r, session=r.session + s_off,
                                                                    tenant=r.tenant + t_off, meta=meta)))
        s_off += 1 + max((r.session for r in reqs), default=-1)
        t_off += 1 + max((r.tenant for r in reqs), default=-1)
    keyed.sort(key=lambda x: x[0])
    return [r for _, r in keyed]
