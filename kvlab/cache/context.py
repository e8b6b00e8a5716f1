"""What a policy is told about an access (the context of the policy events, docs/semantics.md, "Eviction policy
interface")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class AccessContext:
    """The request-level context of a cache event.

    ``time`` is the request's arrival time in seconds of trace time, in every driver (so time-aware
    policies behave the same in the replay, the simulator and the engine); ``seq`` is a logical clock:
    the request's index in the trace.
    ``prompt_tokens`` is the request's prompt length in tokens. The block index in the request is
    the block's own ``position``.
    """

    time: float = 0.0
    seq: int = 0
    request_id: int = -1
    tenant: str | None = None
    category: str | None = None
    turn: int = -1
    prompt_tokens: int = 0


NO_CONTEXT = AccessContext()
