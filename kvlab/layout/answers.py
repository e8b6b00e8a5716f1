"""The layout study's optional section: what a layout does to answers, where a checkpoint is available.

For every family request with a reference answer (``answer_source="reference"``: MT-Bench's GPT-4 answers in the
chat family), under each layout: the mean log-likelihood per answer token (nats) of the reference answer after the
laid-out prompt, scored by a local causal LM (:func:`kvlab.engine.model.load_model`) with the checkpoint's own
tokenizer and chat template. A layout that reorders or drops context changes it; a cache-friendly layout that
leaves it unchanged is free. Without a configured checkpoint (``answers.checkpoint``) the section is skipped and
says why; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd


def skipped(reason: str) -> dict:
    """The section's result when it does not run."""
    return {"status": "skipped", "reason": reason, "table": None}


def answers_section(config: Any, generated: dict[str, list]) -> dict:
    """Run the section for ``config.answers`` (a :class:`~kvlab.layout.config.AnswersSpec`) over the generated
    requests of each family, or explain why not. Returns ``{"status", "reason", "table"}`` (``table``: one row per
    family x layout: requests scored, mean log-likelihood per token)."""
    spec = config.answers
    if spec.checkpoint is None:
        return skipped("no checkpoint configured (answers.checkpoint: a local Hugging Face causal LM folder); "
                       "none is shipped or downloaded")
    path = Path(spec.checkpoint)
    if not (path / "config.json").is_file():
        return skipped(f"answers.checkpoint {path} is not a local model folder (no config.json)")
    scored = {f: [r for r in reqs if r.answer_source == "reference" and r.response][: spec.limit]
              for f, reqs in generated.items()}
    if not any(scored.values()):
        return skipped("no generated request has a reference answer (the chat family with MT-Bench questions has)")
    from kvlab.engine.model import load_model
    from kvlab.workload.tokenizer import load_tokenizer

    model = load_model(str(path), device=spec.device, local_files_only=True)
    tokenizer = load_tokenizer(str(path))
    rows = []
    for family, reqs in scored.items():
        if not reqs:
            continue
        for layout in config.layouts(family):
            values = [answer_loglik(model, tokenizer, layout, r, i, config) for i, r in enumerate(reqs)]
            rows.append({"family": family, "layout": layout.label, "requests": len(values),
                         "loglik_per_token": sum(values) / len(values)})
    return {"status": "done", "reason": f"scored by {path}", "table": pd.DataFrame(rows)}


def answer_loglik(model: Any, tokenizer: Any, layout: Any, request: Any, index: int, config: Any) -> float:
    """Mean log-likelihood per token (nats) of ``request``'s reference answer after its prompt laid out by
    ``layout`` and rendered with ``tokenizer``."""
    import torch

    from kvlab.layout.apply import render_layout
    from kvlab.layout.base import LayoutRequest, RequestContext

    ctx = RequestContext(index=index, arrival=request.arrival, session=request.session, turn=request.turn,
                         tenant=request.tenant, seed=config.seed, clock_start=config.clock_start_s)
    prompt = render_layout(tokenizer, layout(LayoutRequest(tuple(request.messages)), ctx)).ids
    answer = tokenizer.encode("".join(p.text for p in request.response), add_special_tokens=False)
    ids = torch.tensor([prompt + answer], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt):, None]).squeeze(1)
    return float(logp.mean())
