"""Family 3, multi-turn chat: sessions whose history grows turn by turn, with real questions and answers.

A session has ``turns`` user turns. Turn ``k``'s prompt is: the shared system prompt (``system_tokens`` of
real text, kind ``system``; vLLM's "common prefix"), a per-session prefix (``session_prefix`` tokens of
real text, kind ``document``, at the head of the first user message; vLLM's "conversation prefix"), then
every earlier user turn (kind ``history``) and answer (kind ``output``), then this turn's question (kind
``user``). So each turn's prompt extends the previous turn's prompt plus its answer: the reuse a prefix
cache should find.

Questions (``questions``): ``mt_bench`` (default) starts a session with an MT-Bench question and its
follow-up; ``records`` with a conversation of ``records_path`` (any local JSON / JSONL / Parquet file of
ShareGPT-style or OpenAI-chat rows, or a Hugging Face dataset name or folder through ``datasets``, offline:
:mod:`kvlab.workload.sources`), its user turns in order and its assistant turns as reference answers;
``sharegpt`` uses ShareGPT first turns; later turns draw further real questions (ShareGPT). With
``user_tokens`` set, user messages are instead spans of real text of that many tokens (the fixed-length
requests of vLLM's and SGLang's benchmarks).

Answers: an MT-Bench question with a GPT-4 reference answer, or a record's own assistant turn, is used as
it is (``answer_source="reference"``, its length counted in tokens); every other answer is a span of real
corpus text whose length is drawn from ``output`` (fitted to the Mooncake conversation trace by default;
``answer_source="corpus"``).

Arrivals: ``schedule="sessions"``: sessions start by ``arrival`` and turn ``k + 1`` arrives after turn ``k``
plus its decode time (``decode_s_per_token`` x output tokens) plus an exponential think time (mean
``think_time_s``). ``schedule="rounds"``: SGLang ``bench_multiturn``'s round barrier: every session's turn
``k`` (in a random order) before any turn ``k + 1``, requests spaced by ``arrival`` (its rate is then the
request rate).

Presets (:data:`CHAT_PRESETS`) reproduce vLLM's ``benchmarks/multi_turn`` generator and SGLang's
``bench_multiturn``; see their docstrings for the parameters and where they come from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from kvlab.errors import ConfigError
from kvlab.workload.families.base import (
    ArrivalProcess,
    FamilyConfig,
    GeneratedRequest,
    LengthDist,
    Message,
    TextPool,
    const,
    corpus,
    corpus_pool,
    questions,
    rng_of,
)
from kvlab.workload.render import Part
from kvlab.workload.sources import hf_dataset_records, load_records


class ChatConfig(FamilyConfig):
    """Multi-turn chat sessions (module docstring); lengths in tokens, times in seconds."""

    family: Literal["chat"] = "chat"
    n_sessions: Annotated[int, Field(ge=0)] = 100
    turns: LengthDist = LengthDist(kind="uniform", min=2, max=8)
    questions: Literal["mt_bench", "sharegpt", "records"] = "mt_bench"
    records_path: str | None = None  # questions="records": a local JSON/JSONL/Parquet file or a datasets name
    user_tokens: LengthDist | None = None  # None: real questions; else real text spans of this many tokens
    user_instruction: str = ""  # with user_tokens: text that opens every user message (counted in its tokens)
    system_tokens: Annotated[int, Field(ge=0)] = 0
    system_text: str | None = None  # a given shared system prompt instead of system_tokens of corpus text
    session_prefix: LengthDist = const(0)
    use_reference_answers: bool = True
    output: LengthDist = LengthDist(kind="fitted", fit="mooncake_conversation", min=1)
    schedule: Literal["sessions", "rounds"] = "sessions"
    arrival: ArrivalProcess = ArrivalProcess(process="poisson", rate=0.5)
    think_time_s: Annotated[float, Field(ge=0)] = 20.0
    decode_s_per_token: Annotated[float, Field(ge=0)] = 0.02


def _records(config: ChatConfig) -> list:
    """The conversations sessions start from: MT-Bench's, or those of ``records_path``."""
    if config.questions != "records":
        return corpus(config.text_dir)["mt_bench"]
    if config.records_path is None:
        raise ConfigError("ChatConfig: questions='records' needs records_path (a file or a datasets name)")
    path = Path(config.records_path)
    if path.is_file() and path.suffix.lower() in (".json", ".jsonl", ".parquet", ".pq"):
        recs = load_records(path)
    else:
        recs = hf_dataset_records(config.records_path)
    recs = [r for r in recs if r.user_turns]
    if not recs:
        raise ConfigError(f"ChatConfig: {config.records_path}: no record with a user turn")
    return recs


def _session_questions(
    config: ChatConfig, rng: np.random.Generator, n_turns: int, pool: TextPool, sharegpt: list[str], recs: list
) -> tuple[list[str], list[str | None], int | None]:
    """The session's user messages and reference answers (None: none); the record used (an index)."""
    if config.user_tokens is not None:
        lens = config.user_tokens.sample(rng, n_turns)
        head = config.user_instruction
        n_head = pool.count(head) if head else 0
        return [head + pool.cut(rng, int(n) - n_head) for n in lens], [None] * n_turns, None
    users: list[str] = []
    refs: list[str | None] = []
    rec = None
    if config.questions in ("mt_bench", "records"):
        rec = int(rng.integers(0, len(recs)))
        turns = recs[rec].turns
        for j, t in enumerate(turns):
            if t.role == "user" and len(users) < n_turns:
                users.append(t.content)
                nxt = turns[j + 1] if j + 1 < len(turns) and turns[j + 1].role == "assistant" else None
                refs.append(nxt.content if nxt is not None and config.use_reference_answers else None)
    while len(users) < n_turns:
        users.append(sharegpt[int(rng.integers(0, len(sharegpt)))])
        refs.append(None)
    return users, refs, rec


def generate_chat(config: ChatConfig) -> list[GeneratedRequest]:
    """The requests of ``config`` in arrival order (module docstring)."""
    rng = rng_of(config)
    pool = corpus_pool(config.tokenizer, config.text_dir)
    sharegpt = questions(config.text_dir, "sharegpt")
    recs = _records(config)
    system = config.system_text if config.system_text is not None else pool.cut(rng, config.system_tokens)
    n = config.n_sessions
    starts = config.arrival.times(rng, n) if config.schedule == "sessions" else np.zeros(n)
    n_turns = np.maximum(config.turns.sample(rng, n), 1)
    prefix_tokens = config.session_prefix.sample(rng, n)
    rows: list[dict] = []
    for s in range(n):
        users, refs, rec = _session_questions(config, rng, int(n_turns[s]), pool, sharegpt, recs)
        head = (Message("system", (Part("system", system),)),) if system else ()
        prefix = pool.cut(rng, int(prefix_tokens[s]))
        history: list[Message] = []
        t = float(starts[s])
        for k, (user, ref) in enumerate(zip(users, refs, strict=True)):
            lead = (Part("document", prefix + "\n\n"),) if prefix and k == 0 else ()
            msgs = (*head, *history, Message("user", (*lead, Part("user", user))))
            if ref is not None:
                answer, source, n_out = ref, "reference", pool.count(ref)
            else:
                n_out = int(config.output.sample(rng, 1)[0])
                answer, source = pool.cut(rng, n_out), "corpus"
            rows.append({"messages": msgs, "arrival": t, "output_tokens": n_out, "session": s, "turn": k + 1,
                         "answer_source": source, "response": (Part("output", answer),),
                         "meta": {"record": rec}})
            history += [Message("user", (*lead, Part("history", user))),
                        Message("assistant", (Part("output", answer),))]
            t += config.decode_s_per_token * n_out + float(rng.exponential(config.think_time_s))
    if config.schedule == "rounds":
        _round_barrier(rows, config.arrival, rng)
    rows.sort(key=lambda r: (r["arrival"], r["session"], r["turn"]))
    return [GeneratedRequest(tenant=0, category="chat", **r) for r in rows]


def _round_barrier(rows: list[dict], arrival: ArrivalProcess, rng: np.random.Generator) -> None:
    """Re-time ``rows``: all turn-k requests (random order) before turn k + 1, spaced by ``arrival``."""
    by_turn: dict[int, list[dict]] = {}
    for r in rows:
        by_turn.setdefault(r["turn"], []).append(r)
    order = [r for k in sorted(by_turn) for r in (by_turn[k][j] for j in rng.permutation(len(by_turn[k])))]
    for r, t in zip(order, arrival.times(rng, len(order)), strict=True):
        r["arrival"] = float(t)


# ------------------------------------------------------------------------------------------ presets
def vllm_multi_turn(**changes: object) -> ChatConfig:
    """vLLM ``benchmarks/multi_turn/generate_multi_turn.json`` (vllm-project/vllm, read December 2026).

    That file: 24 conversations; ``num_turns`` uniform 12..18 *messages*, rounded up to even (6 user turns
    with probability 1/7, 7, 8, 9 with 2/7 each; here uniform 6..9); a common prefix of 500 tokens on every
    conversation; a per-conversation prefix lognormal with average 1,000 tokens (median ratio 0.85), at most
    5,000 (vLLM also rescales its samples to that exact mean; here the distribution's mean); user messages
    uniform 120..160 tokens, each opening with ``bench_dataset.py``'s "Please rewrite the following text and
    add more content: "; answers uniform 80..120 tokens; text from one book (``pg1184.txt``) — here the
    shared corpus. The benchmark is closed-loop (``--num-clients`` clients, no delay by default); here
    sessions start as a Poisson process at 1 per second with no think time.
    """
    cfg = dict(
        n_sessions=24, turns=LengthDist(kind="uniform", min=6, max=9), system_tokens=500,
        session_prefix=LengthDist(kind="lognormal", average=1000, median_ratio=0.85, max=5000),
        user_tokens=LengthDist(kind="uniform", min=120, max=160), use_reference_answers=False,
        user_instruction="Please rewrite the following text and add more content: ",
        output=LengthDist(kind="uniform", min=80, max=120), arrival=ArrivalProcess(process="poisson", rate=1.0),
        think_time_s=0.0,
    )
    return ChatConfig(**{**cfg, **changes})


def sglang_multiturn_hicache(**changes: object) -> ChatConfig:
    """SGLang ``benchmark/hicache/bench_multiturn.py`` as in its HiCache documentation: ``--num-clients 80
    --num-rounds 10 --request-length 2048 --output-length 1 --request-rate 16 --ready-queue-policy random
    --enable-round-barrier`` (80 sessions x 10 rounds; every new user message 2,048 tokens; 1-token answers;
    Poisson requests at 16 per second; rounds separated by the barrier, random order within a round)."""
    cfg = dict(
        n_sessions=80, turns=const(10), user_tokens=const(2048), use_reference_answers=False,
        output=LengthDist(kind="constant", value=1, min=1), schedule="rounds",
        arrival=ArrivalProcess(process="poisson", rate=16.0), think_time_s=0.0,
    )
    return ChatConfig(**{**cfg, **changes})


def sglang_multiturn_default(**changes: object) -> ChatConfig:
    """SGLang ``bench_multiturn.py``'s argument defaults: ``--num-clients 256 --num-rounds 5 --request-length
    512 --output-length 64 --request-rate 1.0 --distribution poisson`` (no round barrier: the ready queue
    sends a client's next round after its answer; here sessions start at once and think time is 0)."""
    cfg = dict(
        n_sessions=256, turns=const(5), user_tokens=const(512), use_reference_answers=False,
        output=LengthDist(kind="constant", value=64, min=1), schedule="rounds",
        arrival=ArrivalProcess(process="poisson", rate=1.0), think_time_s=0.0,
    )
    return ChatConfig(**{**cfg, **changes})


def mt_bench_chat(**changes: object) -> ChatConfig:
    """Realistic chat: MT-Bench questions with GPT-4 reference answers, later turns from ShareGPT with corpus
    answers of Mooncake-fitted length, Poisson sessions (0.5 per second), 20 s mean think time."""
    return ChatConfig(**changes)


def bursty_chat(**changes: object) -> ChatConfig:
    """As :func:`mt_bench_chat` with bursty Gamma session arrivals (coefficient of variation 3)."""
    return ChatConfig(**{"arrival": ArrivalProcess(process="gamma", rate=0.5, cv=3.0), **changes})


def diurnal_chat(**changes: object) -> ChatConfig:
    """As :func:`mt_bench_chat` with a diurnal session rate (one 'day' per hour, +-80 %)."""
    return ChatConfig(**{"arrival": ArrivalProcess(process="diurnal", rate=0.5, period_s=3600, amplitude=0.8),
                         **changes})


CHAT_PRESETS = {
    "vllm_multi_turn": vllm_multi_turn,
    "sglang_multiturn_hicache": sglang_multiturn_hicache,
    "sglang_multiturn_default": sglang_multiturn_default,
    "mt_bench_chat": mt_bench_chat,
    "bursty_chat": bursty_chat,
    "diurnal_chat": diurnal_chat,
}
"""Chat presets by name: functions returning a :class:`ChatConfig` (keyword changes override fields)."""
