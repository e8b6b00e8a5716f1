"""Family 2, RAG: k retrieved MuSiQue passages per query, Zipf document popularity, in retrieval order.

The corpus is every distinct passage of the shared MuSiQue file (CacheBlend's ``musique_s.json``: 150
questions x 10 retrieved passages), numbered in order of first appearance. Two popularity models:

* ``popularity="document"`` (default): each passage gets a popularity rank (a seeded permutation) and
  weight Zipf(``doc_zipf``); a request draws ``k`` distinct passages by successive sampling without
  replacement proportional to the weights (Gumbel top-k), and the *draw order is the retrieval order* (the
  first drawn is ranked first). The question is that of the first MuSiQue record holding the top passage.
* ``popularity="query"``: questions are Zipf(``query_zipf``)-popular (seeded ranks); a request takes its
  question's first ``k`` passages in MuSiQue's own retrieval order.

Prompt: a fixed instruction (``system``), then the passages (one ``document`` part each, title and text)
and the question (``user``) in the user message. ``meta["documents"]`` lists the passage ids in prompt
order, so a layout transform can put them in canonical (id) order.
"""

from __future__ import annotations

import functools
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from kvlab.workload.families.base import (
    ArrivalProcess,
    FamilyConfig,
    GeneratedRequest,
    LengthDist,
    Message,
    corpus,
    rng_of,
    zipf_weights,
)
from kvlab.workload.render import Part

RAG_INSTRUCTION = "Answer the question using only the passages below. Cite the passage titles you used.\n"


class RAGConfig(FamilyConfig):
    """k passages per query (``k`` <= 10 in query mode), Zipf popularity of documents or of queries."""

    family: Literal["rag"] = "rag"
    n_requests: Annotated[int, Field(ge=0)] = 1000
    k: Annotated[int, Field(ge=1, le=50)] = 5
    popularity: Literal["document", "query"] = "document"
    doc_zipf: Annotated[float, Field(ge=0)] = 1.0
    query_zipf: Annotated[float, Field(ge=0)] = 1.0
    instruction: str = RAG_INSTRUCTION
    arrival: ArrivalProcess = ArrivalProcess(process="poisson", rate=4.0)
    output: LengthDist = LengthDist(kind="fitted", fit="mooncake_conversation", min=1)


@functools.lru_cache(maxsize=4)
def musique_passages(text_dir: str | None) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[int, ...], ...]]:
    """Distinct MuSiQue passages ``(title, text)`` in first-appearance order, and each record's passage ids
    in retrieval order."""
    ids: dict[tuple[str, str], int] = {}
    per_record = []
    for r in corpus(text_dir)["musique"]:
        row = []
        for d in r.documents:
            row.append(ids.setdefault((d.title, d.text), len(ids)))
        per_record.append(tuple(row))
    return tuple(ids), tuple(per_record)


def document_text(title: str, text: str) -> str:
    """A passage as it appears in the prompt."""
    return (f"Title: {title}\n" if title else "") + text + "\n\n"


def generate_rag(config: RAGConfig) -> list[GeneratedRequest]:
    """The requests of ``config`` in arrival order (module docstring)."""
    rng = rng_of(config)
    docs, per_record = musique_passages(config.text_dir)
    records = corpus(config.text_dir)["musique"]
    owner: dict[int, int] = {}
    for r, row in enumerate(per_record):
        for d in row:
            owner.setdefault(d, r)
    n = config.n_requests
    times = config.arrival.times(rng, n)
    if config.popularity == "document":
        k = min(config.k, len(docs))
        rank = rng.permutation(len(docs))  # rank[d]: popularity rank of passage d (0 = most popular)
        logw = np.log(zipf_weights(len(docs), config.doc_zipf))[rank]
        keys = logw[None, :] + rng.gumbel(size=(n, len(docs)))
        top = np.argsort(-keys, axis=1, kind="stable")[:, :k]  # successive sampling order = retrieval order
        chosen = [tuple(int(d) for d in row) for row in top]
        rec = [owner[c[0]] for c in chosen]
    else:
        rank = rng.permutation(len(records))
        w = zipf_weights(len(records), config.query_zipf)[rank]
        rec = rng.choice(len(records), size=n, p=w / w.sum()).tolist()
        chosen = [per_record[r][: config.k] for r in rec]
    out_tokens = config.output.sample(rng, n)
    out = []
    for i in range(n):
        parts = tuple(Part("document", document_text(*docs[d])) for d in chosen[i])
        question = records[rec[i]].user_turns[0]
        msgs = (Message("system", (Part("system", config.instruction),)),
                Message("user", (*parts, Part("user", question))))
        out.append(GeneratedRequest(
            messages=msgs, arrival=float(times[i]), output_tokens=int(out_tokens[i]), session=i, turn=1, tenant=0,
            category="rag", answer_source="none", meta={"documents": chosen[i], "record": int(rec[i])},
        ))
    return out
