"""Family 1, system prompts: tenants x system prompts of given token lengths, Zipf tenant popularity, real queries.

Each tenant owns ``prompts_per_tenant`` system prompts; prompt ``p`` of tenant ``t`` has
``system_tokens[(t * prompts_per_tenant + p) % len(system_tokens)]`` tokens of real text (a span of the
shared corpus pool, :func:`~kvlab.workload.families.base.corpus_pool`). A request picks a tenant with
Zipf(``tenant_zipf``) weights (tenant 0 busiest), one of its prompts uniformly, and a real user question
(ShareGPT first turns by default); it is a one-turn session. What a prefix cache can reuse: the system
prompt, shared by every request of its tenant.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kvlab.workload.families.base import (
    ArrivalProcess,
    FamilyConfig,
    GeneratedRequest,
    LengthDist,
    Message,
    corpus_pool,
    questions,
    rng_of,
    zipf_weights,
)
from kvlab.workload.render import Part


class SystemPromptConfig(FamilyConfig):
    """Tenants with long system prompts (lengths in tokens of ``tokenizer``), Poisson requests by default."""

    family: Literal["system_prompt"] = "system_prompt"
    n_requests: Annotated[int, Field(ge=0)] = 1000
    n_tenants: Annotated[int, Field(ge=1)] = 8
    prompts_per_tenant: Annotated[int, Field(ge=1)] = 1
    system_tokens: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)] = [512, 1024, 2048, 4096]
    tenant_zipf: Annotated[float, Field(ge=0)] = 1.0
    questions: Literal["sharegpt", "mt_bench", "musique", "all"] = "sharegpt"
    arrival: ArrivalProcess = ArrivalProcess(process="poisson", rate=4.0)
    output: LengthDist = LengthDist(kind="fitted", fit="mooncake_conversation", min=1)


def generate_system_prompt(config: SystemPromptConfig) -> list[GeneratedRequest]:
    """The requests of ``config`` in arrival order (module docstring)."""
    rng = rng_of(config)
    pool = corpus_pool(config.tokenizer, config.text_dir)
    qs = questions(config.text_dir, config.questions)
    k = config.prompts_per_tenant
    systems = [
        [pool.cut(rng, config.system_tokens[(t * k + p) % len(config.system_tokens)]) for p in range(k)]
        for t in range(config.n_tenants)
    ]
    n = config.n_requests
    times = config.arrival.times(rng, n)
    tenants = rng.choice(config.n_tenants, size=n, p=zipf_weights(config.n_tenants, config.tenant_zipf))
    which = rng.integers(0, k, size=n)
    qi = rng.integers(0, len(qs), size=n)
    out_tokens = config.output.sample(rng, n)
    out = []
    for i in range(n):
        t, p = int(tenants[i]), int(which[i])
        msgs = (Message("system", (Part("system", systems[t][p]),)), Message("user", (Part("user", qs[qi[i]]),)))
        out.append(GeneratedRequest(
            messages=msgs, arrival=float(times[i]), output_tokens=int(out_tokens[i]), session=i, turn=1,
            tenant=t, category="system_prompt", answer_source="none",
            meta={"system_prompt": (t, p), "question": int(qi[i])},
        ))
    return out
