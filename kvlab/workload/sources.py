"""Text sources: real conversations, questions and passages as small uniform :class:`TextRecord` objects.

Loaders for kvlab's text corpora (registry entries of kind ``text``, ``traces/registry.json``: CacheBlend's
MuSiQue RAG passages and ready-made prompts, MT-Bench two-turn questions with GPT-4 reference answers, ShareGPT
first turns), for any local JSON / JSONL / Parquet file and for any Hugging Face dataset through ``datasets``
(offline: a local file or folder, or the datasets cache). A corpus loader called without a path reads the
registry's verified local copy (:func:`corpus_path`: ``<repo>/traces/text`` first, where MT-Bench and ShareGPT-500
are committed; then ``$KVLAB_TRACE_DIRS``, the download cache, ``../shared/traces``); a missing corpus is one
ConfigError line naming its ``kvlab download`` command. An explicit path or text folder always wins.
Records carry text only (characters); tokenising and laying out a prompt is :mod:`kvlab.workload.render`'s job.

Row shapes recognised (:func:`record_from_row`): ShareGPT (``conversations: [{from, value}]``), OpenAI
chat (``messages: [{role, content}]``), MT-Bench (``turns: [str]``), MuSiQue (``ctxs`` + ``question``) and
single prompts (``prompt`` / ``instruction`` / ``question`` / ``text``, with an optional ``response`` /
``output`` / ``answer``). Every bad input raises :class:`TextSourceError`, a one-line ConfigError (and
TraceFormatError) naming the file (or data set), the line or row, and the field.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from kvlab.errors import ConfigError, TraceFormatError, needs_line
from kvlab.workload._common import describe, iter_json_lines, one_line, parse_json_text, read_trace_bytes

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "model": "assistant", "tool": "tool", "function": "tool",
    "observation": "tool", "ipython": "tool",
}
"""Speaker names of ShareGPT-style and OpenAI-style data sets, mapped to the four roles."""


class TextSourceError(TraceFormatError, ConfigError):
    """A text source is malformed: names the file (or data set), the line or row, and the field."""


class Turn(NamedTuple):
    """One message of a conversation: ``role`` (one of :data:`ROLES`) and its text."""

    role: str
    content: str


class Document(NamedTuple):
    """A retrieved passage: title (may be empty) and text."""

    title: str
    text: str


@dataclass(frozen=True)
class TextRecord:
    """One item of a text source: a conversation (turns in order), optional passages, labels.

    Assistant turns are the data set's own answers (MT-Bench reference answers, ShareGPT replies,
    MuSiQue gold answers); a record without answers simply has none.
    """

    id: str
    turns: tuple[Turn, ...]
    documents: tuple[Document, ...] = ()
    category: str | None = None
    source: str = ""  # file or data set name
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def user_turns(self) -> list[str]:
        """The user messages, in order."""
        return [t.content for t in self.turns if t.role == "user"]

    def texts(self) -> Iterator[str]:
        """Every text of the record (document titles and texts, then turns), in order."""
        for d in self.documents:
            if d.title:
                yield d.title
            yield d.text
        for t in self.turns:
            yield t.content


@contextlib.contextmanager
def _as_source_error() -> Iterator[None]:
    """Re-raise the shared parsers' TraceFormatErrors as TextSourceErrors (same file, line, field, message)."""
    try:
        yield
    except TextSourceError:
        raise
    except TraceFormatError as e:
        raise TextSourceError(e.path, e.line, e.field, e.message) from None


# ------------------------------------------------------------------------------------------ one row
def _string(where: tuple[str, int | None, str], obj: dict, key: str, *, optional: bool = False) -> str | None:
    path, ln, pre = where
    v = obj.get(key)
    if v is None and optional:
        return None
    if type(v) is not str:
        raise TextSourceError(path, ln, key, f"{pre}expected a string, got {describe(v)}")
    return v


def _content(where: tuple[str, int | None, str], msg: dict, key: str, field_name: str) -> str:
    """A message's text: a string, or OpenAI content parts (``[{type: "text", text}]``) joined."""
    path, ln, pre = where
    v = msg.get(key)
    if type(v) is str:
        return v
    if v is None and msg.get("tool_calls") is not None:
        return json.dumps(msg["tool_calls"], ensure_ascii=False)
    if type(v) is list and all(type(p) is dict and p.get("type") == "text" and type(p.get("text")) is str for p in v):
        return "".join(p["text"] for p in v)
    raise TextSourceError(path, ln, field_name, f"{pre}expected a string (or text parts), got {describe(v)}")


def _turns(where: tuple[str, int | None, str], msgs: Any, key: str, role_key: str, text_key: str) -> list[Turn]:
    path, ln, pre = where
    if type(msgs) is not list or not msgs:
        raise TextSourceError(path, ln, key, f"{pre}expected a non-empty list of messages, got {describe(msgs)}")
    out = []
    for k, m in enumerate(msgs):
        if type(m) is not dict:
            raise TextSourceError(path, ln, key, f"{pre}message {k}: expected an object, got {describe(m)}")
        role = ROLE_ALIASES.get(m.get(role_key)) if type(m.get(role_key)) is str else None
        if role is None:
            raise TextSourceError(path, ln, key, f"{pre}message {k}: unknown {role_key} {describe(m.get(role_key))}")
        out.append(Turn(role, _content(where, m, text_key, key)))
    return out


def _record_id(obj: dict, index: int) -> str:
    for key in ("id", "question_id", "conversation_id", "_id"):
        v = obj.get(key)
        if type(v) in (str, int):
            return str(v)
    return str(index)


def record_from_row(obj: Any, *, path: str, line: int | None = None, index: int = 0) -> TextRecord:
    """A :class:`TextRecord` from one row (see the module docstring for the shapes recognised).

    ``line`` is the JSONL line (None: messages say ``row index:`` instead).
    """
    pre = "" if line is not None else f"row {index}: "
    where = (path, line, pre)
    if type(obj) is not dict:
        raise TextSourceError(path, line, None, f"{pre}expected an object, got {describe(obj)}")
    turns: list[Turn] = []
    docs: list[Document] = []
    system = _string(where, obj, "system", optional=True)
    if system:
        turns.append(Turn("system", system))
    if obj.get("conversations") is not None:
        turns += _turns(where, obj["conversations"], "conversations", "from", "value")
    elif obj.get("messages") is not None:
        turns += _turns(where, obj["messages"], "messages", "role", "content")
    elif obj.get("turns") is not None:
        qs = obj["turns"]
        if type(qs) is not list or not qs or not all(type(q) is str for q in qs):
            raise TextSourceError(path, line, "turns", f"{pre}expected a non-empty list of strings, got {describe(qs)}")
        turns += [Turn("user", q) for q in qs]
    elif obj.get("ctxs") is not None:
        ctxs = obj["ctxs"]
        if type(ctxs) is not list:
            raise TextSourceError(path, line, "ctxs", f"{pre}expected a list of passages, got {describe(ctxs)}")
        for k, c in enumerate(ctxs):
            if type(c) is not dict or type(c.get("text")) is not str or type(c.get("title", "")) is not str:
                raise TextSourceError(path, line, "ctxs", f"{pre}passage {k}: expected {{title, text}} strings")
            docs.append(Document(c.get("title", ""), c["text"]))
        turns.append(Turn("user", _string(where, obj, "question")))
        answers = obj.get("answers")
        if type(answers) is list and answers and type(answers[0]) is str:
            turns.append(Turn("assistant", answers[0]))
    else:
        key = next((k for k in ("prompt", "instruction", "question", "text") if obj.get(k) is not None), None)
        if key is None:
            keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
            raise TextSourceError(
                path, line, None,
                f"{pre}no conversations/messages/turns/ctxs/prompt/instruction/question/text field (keys: {keys})",
            )
        turns.append(Turn("user", _string(where, obj, key)))
        answer = next((k for k in ("response", "output", "answer") if obj.get(k) is not None), None)
        if answer is not None:
            turns.append(Turn("assistant", _string(where, obj, answer)))
    category = obj.get("category")
    return TextRecord(
        id=_record_id(obj, index),
        turns=tuple(turns),
        documents=tuple(docs),
        category=category if type(category) is str else None,
        source=path,
    )


# ------------------------------------------------------------------------------------------ files
def _rows(path: Path, format: str | None) -> Iterator[tuple[int | None, int, Any]]:
    """``(line or None, index, row)`` of a JSON list, a JSONL file or a Parquet file."""
    p = str(path)
    fmt = format or {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}.get(
        path.suffix.lower()
    )
    if fmt == "jsonl":
        for k, (ln, obj) in enumerate(iter_json_lines(p, read_trace_bytes(path))):
            yield ln, k, obj
    elif fmt == "json":
        items = parse_json_text(p, None, read_trace_bytes(path))
        if type(items) is dict and type(items.get("data")) is list:
            items = items["data"]
        if type(items) is not list:
            raise TextSourceError(p, None, None, f"expected a JSON list of records, got {describe(items)}")
        for k, obj in enumerate(items):
            yield None, k, obj
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(pa.BufferReader(read_trace_bytes(path)))
        except (pa.ArrowException, OSError) as e:
            raise TextSourceError(p, None, None, f"not a readable Parquet file: {one_line(str(e))}") from None
        for k, obj in enumerate(table.to_pylist()):
            yield None, k, obj
    else:
        raise TextSourceError(p, None, None, "unknown text format: name it .json, .jsonl or .parquet, or pass format=")


def load_records(path: str | os.PathLike, *, format: str | None = None, limit: int | None = None) -> list[TextRecord]:
    """Records of a local JSON (a list of rows), JSONL or Parquet file; ``format`` overrides the suffix."""
    path = Path(path)
    out = []
    with _as_source_error():
        for ln, k, obj in _rows(path, format):
            if limit is not None and len(out) >= limit:
                break
            out.append(record_from_row(obj, path=str(path), line=ln, index=k))
    return out


def hf_dataset_records(
    name_or_path: str | os.PathLike,
    *,
    split: str = "train",
    config: str | None = None,
    limit: int | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> list[TextRecord]:
    """Records of a Hugging Face dataset through ``datasets``, offline: a local file or folder, or a hub name
    already in the datasets cache (nothing is downloaded). ``config`` is the dataset configuration name."""
    try:
        import datasets
        import huggingface_hub.constants as hub_constants
    except ImportError:
        raise ConfigError("hf_dataset_records needs the 'datasets' package: pip install 'kvlab[notebooks]'") from None
    name = os.fspath(name_or_path)
    local = Path(name)
    kw: dict[str, Any] = {"split": split, "cache_dir": None if cache_dir is None else os.fspath(cache_dir)}
    if local.is_file():
        builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}.get(local.suffix.lower())
        if builder is None:
            raise TextSourceError(name, None, None, "a local data set file must end in .json, .jsonl, .parquet or .csv")
        args: tuple = (builder,)
        kw["data_files"] = {split: name}
    else:
        args = (name,) if config is None else (name, config)
    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True  # never reach the hub from here
    try:
        ds = datasets.load_dataset(*args, **kw)
    except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ValueError...)
        why = one_line(str(e), 200) or type(e).__name__
        raise TextSourceError(name, None, None, f"cannot load offline (local file/folder or datasets cache): {why}") \
            from None
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved
    rows = ds if limit is None else ds.select(range(min(limit, len(ds))))
    return [record_from_row(row, path=name, index=k) for k, row in enumerate(rows)]


# ------------------------------------------------------------------------------------------ kvlab's corpora
#: the registry name of each corpus file :func:`shared_corpus` reads, by source
CORPUS_NAMES: dict[str, tuple[str, ...]] = {
    "musique": ("cacheblend_musique",), "cacheblend": ("cacheblend_inputs",),
    "mt_bench": ("mt_bench_questions", "mt_bench_answers"), "sharegpt": ("sharegpt_500",),
}


def missing_corpora_line(names: list[str]) -> str:
    """One line naming the text corpora ``names`` that are not here and the command that fetches them (the
    ``needs data that is not here: ...; run: ...`` shape that ``kvlab figures`` reads back)."""
    from kvlab.workload.registry import download_command

    return needs_line(names, [download_command(n) for n in names],
                      f"text {'corpora' if len(names) > 1 else 'corpus'}: searched traces/, $KVLAB_TRACE_DIRS, "
                      "the download cache, ../shared/traces")


def corpus_path(name: str) -> Path:
    """The verified local path of text corpus ``name`` (a registry name: the registry's search order, ``<repo>/
    traces/text`` first); ConfigError, one line naming ``kvlab download NAME``, when there is none. A local copy
    with the wrong sha256 raises the registry's ChecksumError naming it."""
    from kvlab.workload.registry import CORPORA, find_local

    if name not in CORPORA:
        raise ConfigError(f"{name!r} is not a registered text corpus (known: {', '.join(sorted(CORPORA))})")
    path = find_local(name)
    if path is None:
        raise ConfigError(missing_corpora_line([name]))
    return path


def shared_text_dir() -> Path:
    """The first ``<dir>/text`` folder of the registry's search order (normally the committed
    ``<repo>/traces/text``, which holds MT-Bench and ShareGPT-500; downloaded corpora land there too).
    Loaders called without a path resolve each file on its own (:func:`corpus_path`)."""
    from kvlab.workload.registry import repo_traces_dir, search_dirs

    return next((d / "text" for d in search_dirs() if (d / "text").is_dir()), repo_traces_dir() / "text")


def musique_records(path: str | os.PathLike | None = None, *, limit: int | None = None) -> list[TextRecord]:
    """MuSiQue multi-hop questions with 10 retrieved passages each (CacheBlend's ``musique_s.json``).

    ``path`` is the file, or the text folder holding ``cacheblend/musique_s.json`` (default: registry corpus
    ``cacheblend_musique``). Each record: documents in retrieval order, the question as a user turn, the gold
    answer as an assistant turn.
    """
    p = Path(path) if path is not None else corpus_path("cacheblend_musique")
    if p.is_dir():
        p = p / "cacheblend" / "musique_s.json"
    recs = load_records(p, format="json", limit=limit)
    return [TextRecord(f"musique-{k}", r.turns, r.documents, "rag", r.source) for k, r in enumerate(recs)]


def cacheblend_records(dir: str | os.PathLike | None = None) -> list[TextRecord]:
    """CacheBlend's ready-made RAG prompts ``inputs/<n>.json`` (n ascending): passages ``"0"..`` and ``query``.

    ``dir``: the ``cacheblend`` folder or its ``inputs`` folder (default: registry corpus ``cacheblend_inputs``)."""
    root = corpus_path("cacheblend_inputs") if dir is None else Path(dir)
    folder = root / "inputs" if (root / "inputs").is_dir() else root
    numbered = (f for f in folder.glob("*.json") if f.stem.isascii() and f.stem.isdigit())
    files = sorted(numbered, key=lambda f: int(f.stem))
    if not files:
        raise TextSourceError(str(folder), None, None, "no <n>.json CacheBlend input files here")
    out = []
    with _as_source_error():
        for f in files:
            obj = parse_json_text(str(f), None, read_trace_bytes(f))
            if type(obj) is not dict:
                raise TextSourceError(str(f), None, None, f"expected a JSON object, got {describe(obj)}")
            keys = sorted((k for k in obj if k.isdigit()), key=int)
            docs = []
            for k in keys:
                if type(obj[k]) is not str:
                    raise TextSourceError(str(f), None, k, f"expected a string, got {describe(obj[k])}")
                docs.append(Document("", obj[k]))
            query = _string((str(f), None, ""), obj, "query")
            out.append(TextRecord(f"cacheblend-{f.stem}", (Turn("user", query),), tuple(docs), "rag", str(f)))
    return out


def mt_bench_records(
    path: str | os.PathLike | None = None, answers_path: str | os.PathLike | None = None
) -> list[TextRecord]:
    """MT-Bench's 80 two-turn questions; with GPT-4 reference answers where FastChat has them (30).

    ``path`` is ``question.jsonl`` or its folder (default: registry corpus ``mt_bench_questions``, with the
    reference answers of ``mt_bench_answers`` unless ``answers_path`` is given; a given path uses only the
    ``answers_path`` given with it). A question with answers reads user, assistant, user, assistant; without,
    user, user.
    """
    if path is None:
        q = corpus_path("mt_bench_questions")
        if answers_path is None:
            answers_path = corpus_path("mt_bench_answers")
    else:
        q = Path(path)
    if q.is_dir():
        q = q / "question.jsonl"
    answers: dict[str, list[str]] = {}
    if answers_path is not None:
        a = str(answers_path)
        with _as_source_error():
            for ln, obj in iter_json_lines(a, read_trace_bytes(answers_path)):
                choices = obj.get("choices")
                first = choices[0] if type(choices) is list and choices else None
                turns = first.get("turns") if type(first) is dict else None
                if type(turns) is not list or not all(type(t) is str for t in turns):
                    raise TextSourceError(a, ln, "choices", "expected choices[0].turns: a list of strings")
                answers[_record_id(obj, ln)] = turns
    out = []
    for r in load_records(q, format="jsonl"):
        ans = answers.get(r.id, [])
        turns: list[Turn] = []
        for k, t in enumerate(r.turns):
            turns.append(t)
            if k < len(ans):
                turns.append(Turn("assistant", ans[k]))
        meta = {"answer_source": "reference" if ans else None}
        out.append(TextRecord(r.id, tuple(turns), (), r.category, r.source, meta))
    return out


def sharegpt_records(path: str | os.PathLike | None = None, *, limit: int | None = None) -> list[TextRecord]:
    """ShareGPT conversations (a JSON list of ``{id, conversations: [{from, value}]}``); default: registry corpus
    ``sharegpt_500``, the 500 first turns (``ShareGPT_V3_filtered_500.json``: one user turn each)."""
    p = Path(path) if path is not None else corpus_path("sharegpt_500")
    return load_records(p, format="json" if p.suffix.lower() != ".jsonl" else "jsonl", limit=limit)


def shared_corpus(text_dir: str | os.PathLike | None = None) -> dict[str, list[TextRecord]]:
    """Every record of kvlab's text corpora, by source: ``musique``, ``cacheblend``, ``mt_bench``, ``sharegpt``.

    ``text_dir``: a folder laid out like ``../shared/traces/text`` (``cacheblend/``, ``mt_bench/``,
    ``sharegpt_first_turn/``); default: each corpus through the registry (:data:`CORPUS_NAMES`), and one
    ConfigError line naming every missing corpus and its ``kvlab download`` command before anything is read."""
    if text_dir is None:
        from kvlab.workload.registry import find_local

        names = [n for group in CORPUS_NAMES.values() for n in group]
        paths = {n: find_local(n) for n in names}
        missing = [n for n in names if paths[n] is None]
        if missing:
            raise ConfigError(missing_corpora_line(missing))
        return {
            "musique": musique_records(paths["cacheblend_musique"]),
            "cacheblend": cacheblend_records(paths["cacheblend_inputs"]),
            "mt_bench": mt_bench_records(paths["mt_bench_questions"], paths["mt_bench_answers"]),
            "sharegpt": sharegpt_records(paths["sharegpt_500"]),
        }
    root = Path(text_dir)
    if not root.is_dir():
        raise ConfigError(f"{root}: the text folder is missing (a folder like ../shared/traces/text; or leave "
                          "text_dir unset to use the registry's corpora)")
    return {
        "musique": musique_records(root / "cacheblend" / "musique_s.json"),
        "cacheblend": cacheblend_records(root / "cacheblend"),
        "mt_bench": mt_bench_records(root / "mt_bench" / "question.jsonl",
                                     root / "mt_bench" / "reference_answer" / "gpt-4.jsonl"),
        "sharegpt": sharegpt_records(root / "sharegpt_first_turn" / "ShareGPT_V3_filtered_500.json"),
    }


def corpus_texts(records: Iterable[TextRecord]) -> Iterator[str]:
    """Every text of ``records`` in order (e.g. a tokenizer's training text)."""
    for r in records:
        yield from r.texts()
