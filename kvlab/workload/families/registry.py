"""The single families by name: config class and generator (a mix of them is :mod:`kvlab.workload.families.mix`,
which generates its components through :func:`generate_family`; :data:`kvlab.workload.families.FAMILIES` adds
``"mix"``)."""

from __future__ import annotations

from collections.abc import Callable

from kvlab.errors import ConfigError
from kvlab.workload.families.agent import AgentConfig, generate_agent
from kvlab.workload.families.base import GeneratedRequest
from kvlab.workload.families.chat import ChatConfig, generate_chat
from kvlab.workload.families.rag import RAGConfig, generate_rag
from kvlab.workload.families.system_prompt import SystemPromptConfig, generate_system_prompt

SINGLE_FAMILIES: dict[str, tuple[type, Callable[..., list[GeneratedRequest]]]] = {
    "system_prompt": (SystemPromptConfig, generate_system_prompt),
    "rag": (RAGConfig, generate_rag),
    "chat": (ChatConfig, generate_chat),
    "agent": (AgentConfig, generate_agent),
}
"""Family name -> (config class, generator), every family but ``mix``."""


def generate_family(config: object) -> list[GeneratedRequest]:
    """The requests of one single family's config (:data:`SINGLE_FAMILIES`), in arrival order."""
    name = getattr(config, "family", None)
    if name not in SINGLE_FAMILIES or not isinstance(config, SINGLE_FAMILIES[name][0]):
        raise ConfigError(f"generate: {type(config).__name__} is not a family config")
    return SINGLE_FAMILIES[name][1](config)
