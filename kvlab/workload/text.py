"""Token workloads from real text (../shared/traces/text): RAG prompts, MT-Bench sessions, ShareGPT turns.

A tokenizer is any object with ``encode(str) -> list[int]`` (a Hugging Face tokenizer qualifies);
:class:`ByteTokenizer` is a deterministic, download-free stand-in for tests and offline use.

Prompts are built from *pieces* tokenised one at a time and concatenated: the first piece with the
tokenizer's special tokens (e.g. BOS), later pieces as continuations (``add_special_tokens=False`` for
Hugging Face tokenizers). A later turn's prompt therefore extends the earlier turn's token ids exactly, the
property a prefix cache depends on; tokenising the joined string instead could merge tokens across piece
boundaries. The chat template is deliberately plain (``USER:`` / ``ASSISTANT:`` lines after an optional
system prompt); pass your own prefixes for a model's template.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.arguments import require_text, unicode_problem
from kvlab.errors import TraceFormatError
from kvlab.workload._common import (
    Tokenizer,
    csr,
    describe,
    encode_text,
    get_int,
    get_str,
    iter_json_lines,
    parse_json_text,
    read_trace_bytes,
    sha256_file,
)
from kvlab.workload.workload import Workload

CHAT_SYSTEM_PROMPT = (
    "A conversation between a user and a helpful AI assistant. The assistant answers the user's questions "
    "accurately, in detail and politely."
)
RAG_SYSTEM_PROMPT = (
    "Read the passages below, then answer the question that follows them using only the passages.\n\nPassages:"
)
USER_PREFIX = "\nUSER: "
ASSISTANT_PREFIX = "\nASSISTANT:"


class ByteTokenizer:
    """UTF-8 bytes as token ids: ``id = byte + offset`` (vocabulary ``256 + offset``), no special tokens.

    Deterministic and dependency-free; identical text always gives identical ids and the ids of a
    concatenation are the concatenation of the ids, so prefix structure is preserved exactly.
    """

    def __init__(self, offset: int = 0) -> None:
        self.offset = int(offset)

    @property
    def vocab_size(self) -> int:
        return 256 + self.offset

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens`` is accepted for API parity and has no effect); text with
        a lone surrogate is one ConfigError (:func:`kvlab.arguments.require_text`)."""
        off = self.offset
        try:
            data = text.encode("utf-8")
        except (UnicodeEncodeError, AttributeError):
            require_text(text, "text")
            raise
        return [b + off for b in data]

    def decode(self, ids: Sequence[int]) -> str:
        """Inverse of :meth:`encode` (invalid UTF-8 is replaced)."""
        return bytes(int(i) - self.offset for i in ids).decode("utf-8", errors="replace")


class _PromptBuilder:
    """Token ids of pieces: the first with special tokens, the rest as continuations."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer

    def start(self, text: str) -> list[int]:
        return encode_text(self.tok, text)

    def more(self, text: str) -> list[int]:
        return encode_text(self.tok, text, continuation=True)


def _checksum(paths: Sequence[Path]) -> str:
    """sha256 of one file, or of the (name, sha256) list of several."""
    if len(paths) == 1:
        return sha256_file(paths[0])
    h = hashlib.sha256()
    for p in paths:
        h.update(f"{p.name}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def _workload(
    prompts: list[list[int]],
    out_len: list[int],
    *,
    interval: float,
    name: str,
    source: Path,
    checksum: str,
    meta: dict,
    arrival: list[float] | None = None,
    outputs: list[list[int]] | None = None,
    **columns: object,
) -> Workload:
    counts = np.array([len(p) for p in prompts], dtype=np.int64)
    flat = [t for p in prompts for t in p]
    kw: dict[str, object] = {}
    if outputs is not None:
        kw["output_offsets"] = csr([len(o) for o in outputs])
        kw["output_values"] = np.array([t for o in outputs for t in o], dtype=np.int64)
    return Workload(
        arrival=np.arange(len(prompts), dtype=np.float64) * interval if arrival is None else np.array(arrival),
        input_length=counts,
        output_length=np.array(out_len, dtype=np.int64),
        prompt_offsets=csr(counts),
        prompt_values=np.array(flat, dtype=np.int64),
        kind="tokens",
        name=name,
        source=str(source),
        checksum=checksum,
        meta=meta,
        **kw,
        **columns,
    )


def _valid_text(path: str, line: int | None, field: str, text: str, where: str = "") -> None:
    """TraceFormatError naming the file, line and field when ``text`` is not valid Unicode (a lone surrogate
    from a ``"\\ud800"`` JSON escape): tokenizers cannot encode it."""
    problem = unicode_problem(text)
    if problem is not None:
        raise TraceFormatError(path, line, field, where + problem)


def _load_json(path: Path) -> object:
    """One JSON document; unreadable files and invalid JSON are TraceFormatErrors naming the file."""
    return parse_json_text(str(path), None, read_trace_bytes(path))


def rag_prompts(
    dir: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    system_prompt: str | None = RAG_SYSTEM_PROMPT,
    interval: float = 1.0,
    output_length: int = 32,
) -> Workload:
    """One RAG request per CacheBlend ``inputs/<n>.json`` file (n ascending): system + passages + query.

    ``dir`` is the ``cacheblend`` folder or its ``inputs`` folder. Each file holds passages ``"0"`` ..
    ``str(chunk_num - 1)`` and ``"query"`` (instruction + question). Pieces are tokenised separately
    (module docstring). Request ``i`` arrives at ``i * interval`` s; ``request_id`` is the file number;
    ``category`` is ``"rag"``; ``output_length`` is fixed (short extractive answers).
    """
    if system_prompt is not None:
        require_text(system_prompt, "system_prompt")
    root = Path(dir)
    folder = root / "inputs" if (root / "inputs").is_dir() else root
    numbered = (f for f in folder.glob("*.json") if f.stem.isascii() and f.stem.isdigit())
    files = sorted(numbered, key=lambda f: int(f.stem))
    if not files:
        raise TraceFormatError(str(folder), None, None, "no <n>.json CacheBlend input files here")
    build = _PromptBuilder(tokenizer)
    prompts: list[list[int]] = []
    for f in files:
        obj = _load_json(f)
        if type(obj) is not dict:
            raise TraceFormatError(str(f), None, None, f"expected a JSON object, got {describe(obj)}")
        n = obj.get("chunk_num", None)
        n_chunks = n if type(n) is int else int(n) if type(n) is str and n.isdigit() and len(n) < 10 else -1
        if not 0 <= n_chunks < len(obj):  # passages "0".."n-1" and the query are keys of obj
            raise TraceFormatError(
                str(f), None, "chunk_num", f"expected a passage count (int or digit string), got {describe(n)}"
            )
        pieces = [obj.get(str(k)) for k in range(n_chunks)] + [obj.get("query")]
        for key, piece in zip([*map(str, range(n_chunks)), "query"], pieces, strict=True):
            if type(piece) is not str:
                raise TraceFormatError(str(f), None, key, f"expected a string, got {describe(piece)}")
            _valid_text(str(f), None, key, piece)
        if system_prompt is not None:
            ids = build.start(system_prompt)
            rest = pieces
        else:
            ids, rest = build.start(pieces[0]), pieces[1:]
        for piece in rest:
            ids += build.more(piece)
        prompts.append(ids)
    n = len(prompts)
    return _workload(
        prompts,
        [output_length] * n,
        interval=interval,
        name="cacheblend_rag",
        source=folder,
        checksum=_checksum(files),
        meta={"format": "cacheblend", "files": [f.name for f in files]},
        request_id=np.array([int(f.stem) for f in files], dtype=np.int64),
        category=pd.Categorical(["rag"] * n),
    )


def mt_bench_sessions(
    path: str | os.PathLike,
    tokenizer: Tokenizer,
    answers_path: str | os.PathLike | None = None,
    *,
    system_prompt: str | None = CHAT_SYSTEM_PROMPT,
    interval: float = 1.0,
    turn_gap: float = 30.0,
    output_length: int = 256,
) -> Workload:
    """Two-turn MT-Bench sessions: turn 2's prompt = turn 1's prompt + answer (if known) + question 2.

    ``path`` is ``question.jsonl`` or its folder; ``answers_path`` an optional answers file in FastChat's
    format (``reference_answer/gpt-4.jsonl``: ``question_id`` → ``choices[0].turns``). With an answer,
    turn 1's ``output_tokens`` are exactly the answer ids that turn 2's prompt contains and
    ``output_length`` is their count; without one, turn 2 follows turn 1's prompt directly and
    ``output_length`` is the given default. Question ``k`` (file order) sends turn 1 at ``k * interval``
    and turn 2 ``turn_gap`` s later; rows are ordered by arrival. Columns: session = question_id, turn,
    parent, category = MT-Bench category; ``output_tokens`` only when ``answers_path`` is given.
    """
    if system_prompt is not None:
        require_text(system_prompt, "system_prompt")
    qpath = Path(path)
    if qpath.is_dir():
        qpath = qpath / "question.jsonl"
    p = str(qpath)
    questions: list[tuple[int, str, list[str]]] = []
    for ln, obj in iter_json_lines(p, read_trace_bytes(qpath)):
        qid = get_int(p, ln, obj, "question_id", min_value=0)
        cat = get_str(p, ln, obj, "category")
        turns = obj.get("turns")
        if type(turns) is not list or len(turns) < 2 or not all(type(t) is str for t in turns[:2]):
            raise TraceFormatError(p, ln, "turns", f"expected a list of >= 2 strings, got {describe(turns)}")
        for j, t in enumerate(turns[:2]):
            _valid_text(p, ln, f"turns[{j}]", t)
        questions.append((qid, cat, turns[:2]))
    answers: dict[int, list[str]] = {}
    files = [qpath]
    if answers_path is not None:
        apath = Path(answers_path)
        files.append(apath)
        a = str(apath)
        for ln, obj in iter_json_lines(a, read_trace_bytes(apath)):
            qid = get_int(a, ln, obj, "question_id", min_value=0)
            choices = obj.get("choices")
            turns = choices[0].get("turns") if type(choices) is list and choices and type(choices[0]) is dict else None
            if type(turns) is not list or len(turns) < 2 or not all(type(t) is str for t in turns[:2]):
                raise TraceFormatError(a, ln, "choices", "expected choices[0].turns: a list of >= 2 strings")
            for j, t in enumerate(turns[:2]):
                _valid_text(a, ln, f"choices[0].turns[{j}]", t)
            answers[qid] = turns[:2]
    build = _PromptBuilder(tokenizer)
    rows: list[tuple[float, int, int, int, str, list[int], list[int] | None]] = []
    # (arrival, order, question_id, turn, category, prompt, output ids or None)
    for k, (qid, cat, (q1, q2)) in enumerate(questions):
        if system_prompt is not None:
            p1 = build.start(system_prompt) + build.more(USER_PREFIX + q1 + ASSISTANT_PREFIX)
        else:
            p1 = build.start(USER_PREFIX.lstrip("\n") + q1 + ASSISTANT_PREFIX)
        ans = answers.get(qid)
        a1 = build.more(" " + ans[0]) if ans else None
        a2 = build.more(" " + ans[1]) if ans else None
        p2 = p1 + (a1 or []) + build.more(USER_PREFIX + q2 + ASSISTANT_PREFIX)
        rows.append((k * interval, 2 * k, qid, 1, cat, p1, a1))
        rows.append((k * interval + turn_gap, 2 * k + 1, qid, 2, cat, p2, a2))
    rows.sort(key=lambda r: (r[0], r[1]))
    row_of = {(r[2], r[3]): i for i, r in enumerate(rows)}
    with_answers = answers_path is not None
    return _workload(
        [r[5] for r in rows],
        [len(r[6]) if r[6] is not None else output_length for r in rows],
        interval=interval,
        arrival=[r[0] for r in rows],
        outputs=[r[6] or [] for r in rows] if with_answers else None,
        name="mt_bench",
        source=qpath,
        checksum=_checksum(files),
        meta={"format": "mt_bench", "answered_questions": len([q for q in questions if q[0] in answers])},
        session=np.array([r[2] for r in rows], dtype=np.int64),
        turn=np.array([r[3] for r in rows], dtype=np.int64),
        parent=np.array([row_of[(r[2], 1)] if r[3] == 2 else -1 for r in rows], dtype=np.int64),
        category=pd.Categorical([r[4] for r in rows]),
    )


def sharegpt_first_turns(
    path: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    system_prompt: str | None = CHAT_SYSTEM_PROMPT,
    interval: float = 1.0,
    output_length: int = 256,
    limit: int | None = None,
) -> Workload:
    """Single-turn requests from a ShareGPT JSON list (``[{id, conversations: [{from, value}, ...]}]``).

    Each item's first ``human`` message becomes one prompt (system prompt + ``USER:`` line); items
    without one are errors. Request ``i`` arrives at ``i * interval`` s; ``output_length`` is fixed;
    ``request_id`` is the item's index in the file; ``category`` is ``"sharegpt"``. ``limit`` keeps the
    first items only.
    """
    if system_prompt is not None:
        require_text(system_prompt, "system_prompt")
    path = Path(path)
    p = str(path)
    items = _load_json(path)
    if type(items) is not list:
        raise TraceFormatError(p, None, None, f"expected a JSON list of conversations, got {describe(items)}")
    if limit is not None:
        items = items[:limit]
    build = _PromptBuilder(tokenizer)
    prompts: list[list[int]] = []
    for i, item in enumerate(items):
        conv = item.get("conversations") if type(item) is dict else None
        text = None
        if type(conv) is list:
            text = next((m.get("value") for m in conv if type(m) is dict and m.get("from") in ("human", "user")), None)
        if type(text) is not str:
            raise TraceFormatError(p, None, "conversations", f"item {i}: no human message with a string value")
        _valid_text(p, None, "conversations", text, f"item {i}: ")
        if system_prompt is not None:
            ids = build.start(system_prompt) + build.more(USER_PREFIX + text + ASSISTANT_PREFIX)
        else:
            ids = build.start(USER_PREFIX.lstrip("\n") + text + ASSISTANT_PREFIX)
        prompts.append(ids)
    n = len(prompts)
    return _workload(
        prompts,
        [output_length] * n,
        interval=interval,
        name=path.stem,
        source=path,
        checksum=_checksum([path]),
        meta={"format": "sharegpt"},
        category=pd.Categorical(["sharegpt"] * n),
    )
