"""Recorded vLLM KV cache events: reading them (:func:`read_kv_events`).

A KV event stream cannot rebuild a workload: a request whose prompt is fully cached emits no event at all
(a hit stores nothing and evicts nothing), output lengths and arrival times are absent, and several
requests' blocks share one batch. It can *validate* a replay of the request log the server was given:
:func:`kvlab.replay.kv_validate.validate_replay` (a driver, above this data floor) replays the log with
kvlab (vLLM counting mode, the events' block size) while recording every block kvlab stores and every key
it drops, and compares the two streams.

Accepted file (:func:`read_kv_events`): JSONL, one ``KVEventBatch`` per line, as vLLM's ``msgspec`` structs
encode to JSON (field names as in ``vllm/distributed/kv_events.py``; defaults may be omitted)::

    {"ts": 1718000000.25, "events": [
        {"type": "BlockRemoved", "block_hashes": [h0], "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": h0 | null,
         "token_ids": [... block_size * 2 ints ...], "block_size": 16, "lora_id": null, "medium": "GPU"},
        {"type": "AllBlocksCleared"}],
     "data_parallel_rank": 0}

``ts`` is a number (seconds); ``events`` a list; ``data_parallel_rank`` an int >= 0 or null/absent. A block
hash is a JSON integer (any size) or a string (vLLM's ``bytes`` hashes, e.g. base64 or hex). ``BlockStored``
needs ``block_hashes`` (non-empty), ``parent_block_hash`` (the hash of the block before the first one, null
for a sequence's first block), ``token_ids`` (exactly ``block_size * len(block_hashes)`` ints >= 0) and
``block_size`` (int >= 1); ``lora_id``, ``lora_name``, ``extra_keys``, ``medium`` and ``group_idx`` are
optional. ``BlockRemoved`` needs ``block_hashes``. Other keys are ignored. A malformed line raises
``TraceFormatError`` naming the file, the line and the field (``events[2].token_ids``).

Events of another medium than ``"GPU"`` (or null), or of a KV cache group other than 0 (or null), are read
with ``compared=False``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvlab.errors import TraceFormatError
from kvlab.workload._common import (
    MAX_REQUEST_TOKENS,
    check_int_list,
    describe,
    get_number,
    iter_json_lines,
    read_trace_bytes,
)

#: the ops of a :class:`KVEvent`
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
_TYPES = {"BlockStored": STORED, "BlockRemoved": REMOVED, "AllBlocksCleared": CLEARED}
_GPU_MEDIA = (None, "GPU")


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One event of a recorded stream, flattened out of its batch.

    ``op``: ``"stored"``, ``"removed"`` or ``"cleared"``; ``line``: 1-based line of its batch in the file;
    ``index``: its position in the batch's ``events``; ``ts``: the batch's time stamp (seconds);
    ``block_hashes`` / ``parent_block_hash`` / ``token_ids`` / ``block_size`` (tokens) as recorded (empty /
    None for the ops without them); ``compared``: False for another medium or KV cache group (skipped).
    """

    op: str
    line: int
    index: int
    ts: float
    block_hashes: tuple[int | str, ...] = ()
    parent_block_hash: int | str | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int | None = None
    rank: int | None = None
    compared: bool = True


def read_kv_events(path: str | os.PathLike) -> list[KVEvent]:
    """Read a JSONL stream of KV event batches (module docstring), in file order."""
    p = str(path)
    out: list[KVEvent] = []
    for ln, obj in iter_json_lines(p, read_trace_bytes(path)):
        ts = get_number(p, ln, obj, "ts")
        rank = obj.get("data_parallel_rank")
        if rank is not None and (type(rank) is not int or rank < 0):
            raise TraceFormatError(p, ln, "data_parallel_rank", f"expected an int >= 0 or null, got {describe(rank)}")
        events = obj.get("events")
        if type(events) is not list:
            what = "missing required field" if events is None else f"expected a list, got {describe(events)}"
            raise TraceFormatError(p, ln, "events", what)
        for i, ev in enumerate(events):
            out.append(_parse_event(p, ln, i, ev, ts, rank))
    return out


def _parse_event(p: str, ln: int, i: int, ev: object, ts: float, rank: int | None) -> KVEvent:
    """One element of a batch's ``events`` as a KVEvent (field names in errors: ``events[i].name``)."""
    where = f"events[{i}]"
    if type(ev) is not dict:
        raise TraceFormatError(p, ln, where, f"expected an event object, got {describe(ev)}")
    kind = ev.get("type")
    op = _TYPES.get(kind) if type(kind) is str else None
    if op is None:
        raise TraceFormatError(p, ln, f"{where}.type", f"expected one of {', '.join(_TYPES)}, got {describe(kind)}")
    if op == CLEARED:
        return KVEvent(CLEARED, ln, i, ts, rank=rank)
    hashes = _hash_list(p, ln, f"{where}.block_hashes", ev.get("block_hashes"))
    medium, group = ev.get("medium"), ev.get("group_idx")
    if medium is not None and type(medium) is not str:
        raise TraceFormatError(p, ln, f"{where}.medium", f"expected a string or null, got {describe(medium)}")
    if group is not None and (type(group) is not int or group < 0):
        raise TraceFormatError(p, ln, f"{where}.group_idx", f"expected an int >= 0 or null, got {describe(group)}")
    compared = medium in _GPU_MEDIA and group in (None, 0)
    if op == REMOVED:
        return KVEvent(REMOVED, ln, i, ts, hashes, rank=rank, compared=compared)
    if "parent_block_hash" not in ev:
        raise TraceFormatError(p, ln, f"{where}.parent_block_hash", "missing required field (null for a first block)")
    parent = ev["parent_block_hash"]
    if parent is not None:
        parent = _hash_list(p, ln, f"{where}.parent_block_hash", [parent])[0]
    bs = ev.get("block_size")
    if type(bs) is not int or not 1 <= bs <= MAX_REQUEST_TOKENS:
        what = "missing required field" if bs is None else f"expected an int in [1, {MAX_REQUEST_TOKENS:,}]"
        raise TraceFormatError(p, ln, f"{where}.block_size", what if bs is None else f"{what}, got {describe(bs)}")
    if "token_ids" not in ev:
        raise TraceFormatError(p, ln, f"{where}.token_ids", "missing required field")
    tokens = check_int_list(p, ln, f"{where}.token_ids", ev["token_ids"])
    if len(tokens) != bs * len(hashes):
        raise TraceFormatError(
            p, ln, f"{where}.token_ids",
            f"has {len(tokens)} tokens, expected block_size {bs} x {len(hashes)} block_hashes = {bs * len(hashes)}",
        )
    return KVEvent(STORED, ln, i, ts, hashes, parent, tuple(tokens), bs, rank, compared)


def _hash_list(p: str, ln: int, key: str, v: object) -> tuple[int | str, ...]:
    """A non-empty list of block hashes (JSON integers or strings)."""
    if type(v) is not list or not v:
        what = "missing required field" if v is None else f"expected a non-empty list of hashes, got {describe(v)}"
        raise TraceFormatError(p, ln, key, what)
    for h in v:
        if type(h) is not int and type(h) is not str:
            raise TraceFormatError(p, ln, key, f"a block hash is an integer or a string, got {describe(h)}")
    return tuple(v)


__all__ = ["CLEARED", "REMOVED", "STORED", "KVEvent", "read_kv_events"]
