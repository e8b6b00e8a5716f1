"""Workload families built from real text: system prompts, RAG, multi-turn chat, agents, and mixes of them.

One config per family (a validated pydantic model with a fixed seed) -> :func:`generate` -> a list of
:class:`GeneratedRequest` (messages of tagged parts, arrival in seconds, output tokens, labels) ->
:func:`family_workload` (rendered once with a tokenizer) -> a segmented token
:class:`~kvlab.workload.workload.Workload`. docs/layout.md ("Families") describes each family.

>>> reqs = generate(RAGConfig(n_requests=100, k=5, seed=1))           # doctest: +SKIP
>>> w = family_workload(reqs, load_tokenizer())                        # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvlab.errors import ConfigError
from kvlab.workload.families.agent import TOOL_CATALOGUE, AgentConfig
from kvlab.workload.families.base import (
    ANSWER_SOURCES,
    FITTED_OUTPUT_LENGTHS,
    REASONING_CLOSE,
    REASONING_OPEN,
    ArrivalProcess,
    FamilyConfig,
    GeneratedRequest,
    LengthDist,
    is_reasoning,
    reasoning_part,
    request_columns,
)
from kvlab.workload.families.chat import CHAT_PRESETS, ChatConfig
from kvlab.workload.families.mix import MixComponent, MixConfig, generate_mix
from kvlab.workload.families.rag import RAGConfig
from kvlab.workload.families.registry import SINGLE_FAMILIES, generate_family
from kvlab.workload.families.system_prompt import SystemPromptConfig
from kvlab.workload.render import render_prompt, rendered_workload
from kvlab.workload.tokenizer import TextTokenizer
from kvlab.workload.workload import Workload

FAMILIES: dict[str, tuple[type, Callable]] = {**SINGLE_FAMILIES, "mix": (MixConfig, generate_mix)}
"""Family name -> (config class, generator)."""

PRESETS: dict[str, Callable[..., FamilyConfig]] = {
    **CHAT_PRESETS,
    "system_prompts": lambda **kw: SystemPromptConfig(**kw),
    "rag": lambda **kw: RAGConfig(**kw),
    "agent": lambda **kw: AgentConfig(**kw),
    "agent_qwen3": lambda **kw: AgentConfig(**{"reasoning": "qwen3", **kw}),
}
"""Named configs: ``PRESETS[name](**changes)`` returns a config (chat presets: :data:`CHAT_PRESETS`)."""


def family_config(family: str, **fields: object) -> FamilyConfig | MixConfig:
    """A config by family name (``FAMILIES``) and fields; ConfigError for an unknown name."""
    if family not in FAMILIES:
        raise ConfigError(f"unknown workload family {family!r} (one of {', '.join(FAMILIES)})")
    return FAMILIES[family][0](**fields)


def generate(config: FamilyConfig | MixConfig) -> list[GeneratedRequest]:
    """The requests of a family config, in arrival order; deterministic per config (and its seed)."""
    return generate_mix(config) if isinstance(config, MixConfig) else generate_family(config)


def family_workload(
    requests: Sequence[GeneratedRequest],
    tokenizer: TextTokenizer,
    *,
    name: str = "family",
    date_string: str | None = None,
    meta: dict | None = None,
) -> Workload:
    """Render every request once (:func:`~kvlab.workload.render.render_prompt`) into a segmented token Workload.

    Rows follow the requests' arrival order (stable). Columns: ``session``, ``turn``, ``parent`` (row of the
    same session's previous turn, -1 if none or not present), ``tenant`` (``tenant<k>``), ``category`` (the
    family). ``output_length`` is the response's token count under ``tokenizer`` when every request has a
    response text (then the response ids are the workload's known outputs), else ``output_tokens``.
    ``meta["answer_source"]`` counts requests per answer source.
    """
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    reqs = [requests[i] for i in order]
    prompts = [render_prompt(tokenizer, r.messages, date_string=date_string) for r in reqs]
    columns, out_len = request_columns(reqs, tokenizer)
    counts = {s: sum(r.answer_source == s for r in reqs) for s in ANSWER_SOURCES}
    return rendered_workload(
        prompts, tokenizer, arrival=[r.arrival for r in reqs], output_length=out_len, name=name,
        meta={**(meta or {}), "answer_source": counts}, **columns,
    )


__all__ = [
    "ANSWER_SOURCES", "FAMILIES", "FITTED_OUTPUT_LENGTHS", "PRESETS", "REASONING_CLOSE", "REASONING_OPEN",
    "TOOL_CATALOGUE", "AgentConfig", "ArrivalProcess", "ChatConfig", "FamilyConfig", "GeneratedRequest",
    "LengthDist", "MixComponent", "MixConfig", "RAGConfig", "SystemPromptConfig", "family_config",
    "family_workload", "generate", "is_reasoning", "reasoning_part",
]
