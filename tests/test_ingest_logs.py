"""Serving request logs (kvlab.workload.request_log), KV cache events (kvlab.workload.kv_events) and the
validation of a replay against them (kvlab.replay.kv_validate).

Every file here is written by the test: a request log from a small multi-turn generator, and a KV event
stream from an independent from-scratch simulation of vLLM's emission rules (a block is stored when it is
full and computed, removed when its block is reused for another), with the block order kvlab documents
as vLLM's (kvlab/cache/prefix_cache.py): free blocks without a hash taken first, cached ones least recently
released first, a request's blocks released tail first.
"""

from __future__ import annotations

import collections
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from kvlab.errors import ConfigError, TraceFormatError
from kvlab.replay import ReplayConfig, replay
from kvlab.replay.kv_validate import record_replay, validate_replay
from kvlab.workload.kv_events import read_kv_events
from kvlab.workload.load import load_trace
from kvlab.workload.registry import detect_format
from kvlab.workload.request_log import downsample_sessions, load_request_log
from kvlab.workload.workload import from_lists

BS = 4  # tokens per block in these tests


# ------------------------------------------------------------------------------------------ writers
def make_log_records(n_sessions: int = 12, seed: int = 0) -> list[dict]:
    """Multi-turn chats sharing two system prompts: each turn's prompt is the previous prompt, its output and
    a new user message. Records in arrival order (the writer shuffles them)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(5, 14))] for _ in range(2)]
    records = []
    for s in range(n_sessions):
        t = rng.uniform(0, 20)
        context = list(systems[s % 2])
        for _ in range(rng.randrange(1, 5)):
            context = context + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            out = [rng.randrange(1000) for _ in range(rng.randrange(0, 7))]
            records.append({"arrival_time": 1.7e9 + round(t, 3), "prompt_token_ids": list(context),
                            "output_token_ids": out, "session_id": f"chat-{s}", "user": f"u{s % 3}"})
            context = context + out
            t += rng.uniform(1, 5)
    records.sort(key=lambda r: r["arrival_time"])
    for i, r in enumerate(records):
        r["request_id"] = f"req-{i}"
    return records


def write_log(path: Path, records: list[dict], seed: int = 1) -> Path:
    """Write ``records`` as JSONL in shuffled order (a server logs requests when they finish)."""
    lines = [json.dumps(r) for r in records]
    random.Random(seed).shuffle(lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def simulate_vllm_events(prompts: list[list[int]], capacity: int, block_size: int) -> list[dict]:
    """KVEventBatch dicts (one per request) from a from-scratch block pool following vLLM's rules.

    Sequential requests, prompt only (no decode blocks), hits capped at ``(len - 1) // block_size`` blocks,
    a request that does not fit skipped. Hashes: sha256 hex of the parent hash and the block's tokens.
    """
    free: collections.deque[int] = collections.deque(range(capacity))  # front: taken first
    block_hash: list[str | None] = [None] * capacity
    ref = [0] * capacity
    table: dict[str, list[int]] = {}  # hash -> blocks holding it, oldest first
    batches = []
    for r, tokens in enumerate(prompts):
        full = len(tokens) // block_size
        hashes, parent = [], ""
        for j in range(full):
            parent = hashlib.sha256((parent + repr(tokens[j * block_size:(j + 1) * block_size])).encode()).hexdigest()
            hashes.append(parent)
        hits = []
        for h in hashes[: (len(tokens) - 1) // block_size]:
            if h not in table:
                break
            hits.append(table[h][0])
        n_new = -(-len(tokens) // block_size) - len(hits)
        if n_new > len(free) - sum(1 for b in hits if ref[b] == 0):
            continue
        events = []
        for b in hits:
            if ref[b] == 0:
                free.remove(b)
            ref[b] += 1
        new = []
        for _ in range(n_new):
            b = free.popleft()
            if block_hash[b] is not None:
                events.append({"type": "BlockRemoved", "block_hashes": [block_hash[b]], "medium": "GPU"})
                table[block_hash[b]].remove(b)
                if not table[block_hash[b]]:
                    del table[block_hash[b]]
                block_hash[b] = None
            ref[b] = 1
            new.append(b)
        stored = list(range(len(hits), full))
        for j, b in zip(stored, new, strict=False):
            block_hash[b] = hashes[j]
            table.setdefault(hashes[j], []).append(b)
        if stored:
            events.append({
                "type": "BlockStored", "block_hashes": [hashes[j] for j in stored],
                "parent_block_hash": hashes[stored[0] - 1] if stored[0] else None,
                "token_ids": tokens[stored[0] * block_size:full * block_size], "block_size": block_size,
                "lora_id": None, "medium": "GPU",
            })
        for b in reversed(hits + new):
            ref[b] -= 1
            if ref[b] == 0:
                (free.append if block_hash[b] is not None else free.appendleft)(b)
        if events:
            batches.append({"ts": 100.0 + r, "events": events, "data_parallel_rank": 0})
    return batches


def write_events(path: Path, batches: list[dict]) -> Path:
    path.write_text("".join(json.dumps(b) + "\n" for b in batches))
    return path


def prompts_of(w) -> list[list[int]]:
    return [w.prompt(i).tolist() for i in range(len(w))]


@pytest.fixture
def log(tmp_path: Path):
    records = make_log_records()
    return write_log(tmp_path / "serve.jsonl", records), records


# ------------------------------------------------------------------------------------------ request logs
def test_load_request_log_columns(log):
    path, records = log
    w = load_request_log(path)
    assert w.kind == "tokens" and len(w) == len(records) and w.meta["format"] == "request-log"
    assert np.all(np.diff(w.arrival) >= 0) and w.arrival[0] == 0.0
    for i, rec in enumerate(records):  # records are in arrival order with distinct times
        assert w.prompt(i).tolist() == rec["prompt_token_ids"]
        assert w.output(i).tolist() == rec["output_token_ids"]
        assert w.output_length[i] == len(rec["output_token_ids"])
        assert w.meta["request_id_labels"][w.request_id[i]] == rec["request_id"]
        assert w.tenant[i] == rec["user"]
        assert w.arrival[i] == pytest.approx(rec["arrival_time"] - records[0]["arrival_time"])
    # sessions: dense codes, turns 1.., parent = the session's previous row
    for s in np.unique(w.session):
        rows = np.flatnonzero(w.session == s)
        assert w.turn[rows].tolist() == list(range(1, len(rows) + 1))
        assert w.parent[rows].tolist() == [-1, *rows[:-1].tolist()]
    assert detect_format(path) == "request-log"
    assert load_trace(path).content_sha256 == w.content_sha256
    assert load_trace(path, format="request-log", name="x").name == "x"


def test_request_log_minimal_and_unsorted(tmp_path: Path):
    p = tmp_path / "min.jsonl"
    p.write_text('{"arrival_time": 2, "prompt_token_ids": [1, 2], "output_length": 3}\n\n'
                 '{"arrival_time": 1.5, "prompt_token_ids": [], "output_length": 0, "extra": {"a": 1}}\n')
    w = load_request_log(p)
    assert w.arrival.tolist() == [0.0, 0.5] and w.input_length.tolist() == [0, 2]
    assert w.request_id.tolist() == [1, 0] and w.session is None and w.output_offsets is None
    with pytest.raises(TraceFormatError, match=r"min\.jsonl:3: field 'arrival_time': goes backwards"):
        load_request_log(p, sort=False)


BAD_LINES = [
    ('{"prompt_token_ids": [1], "output_length": 1}', "arrival_time", "missing required field"),
    ('{"arrival_time": "now", "prompt_token_ids": [1], "output_length": 1}', "arrival_time", "expected a number"),
    ('{"arrival_time": 1, "output_length": 1}', "prompt_token_ids", "missing required field"),
    ('{"arrival_time": 1, "prompt_token_ids": [1, -2], "output_length": 1}', "prompt_token_ids", ">= 0"),
    ('{"arrival_time": 1, "prompt_token_ids": [1.5], "output_length": 1}', "prompt_token_ids", "integers"),
    ('{"arrival_time": 1, "prompt_token_ids": [1]}', "output_length", "output_length or output_token_ids"),
    ('{"arrival_time": 1, "prompt_token_ids": [1], "output_length": 2, "output_token_ids": [5]}', "output_length",
     "output_token_ids has 1"),
    ('{"arrival_time": 1, "prompt_token_ids": [1], "output_length": -1}', "output_length", ">= 0"),
    ('{"arrival_time": 1, "prompt_token_ids": [1], "output_length": 1, "session_id": 1.5}', "session_id",
     "integer >= 0 or a string"),
    ('{"arrival_time": 1, "prompt_token_ids": [1], "output_length": 1, "user": 7}', "user", "string or null"),
    ('{"arrival_time": 1, "prompt_token_ids": [1], "output_length": 1, "request_id": 0}', "request_id",
     "duplicate id 0, first on line 1"),
    ('{"arrival_time": 1, "prompt_token_ids": [1], "output_length": 1, "request_id": "a"}', "request_id",
     "but an integer on line 1"),
    ('{"arrival_time": 1, "prompt_token_ids": [1], "output_length": 1}', "request_id", "missing here"),
]


@pytest.mark.parametrize(("line", "field", "message"), BAD_LINES)
def test_request_log_bad_line(tmp_path: Path, line: str, field: str, message: str):
    text = second_line_error(tmp_path / "bad.jsonl", load_request_log,
                             '{"arrival_time": 0, "prompt_token_ids": [3], "output_length": 1, "request_id": 0}', line)
    assert "\n" not in text and f"bad.jsonl:2: field '{field}'" in text and message in text, text


def second_line_error(path: Path, read, first: str, line: str) -> str:  # noqa: ANN001 - a reader of path
    """The TraceFormatError text of ``read(path)`` for a file of a good ``first`` line and ``line``."""
    path.write_text(first + "\n" + line + "\n")
    with pytest.raises(TraceFormatError) as e:
        read(path)
    return str(e.value)


def test_request_log_bad_file(tmp_path: Path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_request_log(tmp_path / "empty.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"arrival_time": 1, "prompt_token_ids": [1\n')
    with pytest.raises(TraceFormatError, match=r"broken\.jsonl:1: invalid JSON"):
        load_request_log(tmp_path / "broken.jsonl")


def test_downsample_sessions_keeps_whole_sessions(log):
    w = load_request_log(log[0])
    n_sessions = len(np.unique(w.session))
    half = downsample_sessions(w, fraction=0.5, seed=3)
    assert half.meta["downsample"]["kept_units"] == round(0.5 * n_sessions)
    kept = set(half.session.tolist())
    assert len(kept) == round(0.5 * n_sessions)
    for s in kept:  # every request of a kept session, in order, with its parent chain intact
        assert np.sum(half.session == s) == np.sum(w.session == s)
        rows = np.flatnonzero(half.session == s)
        assert half.parent[rows].tolist() == [-1, *rows[:-1].tolist()]
    assert downsample_sessions(w, fraction=0.5, seed=3).content_sha256 == half.content_sha256
    assert downsample_sessions(w, fraction=0.5, seed=4).content_sha256 != half.content_sha256
    assert set(downsample_sessions(w, count=2, seed=0).session.tolist()).__len__() == 2
    assert len(downsample_sessions(w, count=10**6)) == len(w)
    assert len(downsample_sessions(w, fraction=1.0)) == len(w)


def test_downsample_without_sessions_and_bad_args():
    w = from_lists([[1, 2], [3], [4, 5, 6], [7]], session=[-1, 0, -1, 0])
    out = downsample_sessions(w, count=2, seed=0)  # units: session 0 and the two sessionless rows
    assert out.meta["downsample"]["units"] == 3 and len(out) in (2, 3)
    assert len(downsample_sessions(from_lists([[1]] * 5), count=3)) == 3
    for kw in ({}, {"fraction": 0.5, "count": 1}, {"fraction": 0}, {"fraction": 1.5}, {"count": 0},
               {"fraction": True}, {"count": 2, "seed": -1}):
        with pytest.raises(ConfigError, match="downsample_sessions"):
            downsample_sessions(w, **kw)


def test_request_log_fuzz_one_line_errors(log, tmp_path: Path):
    """Random byte edits of a valid log load or raise one TraceFormatError line, never anything else."""
    data = log[0].read_bytes()
    rng = random.Random(7)
    p = tmp_path / "fuzz.jsonl"
    errors = 0
    for _ in range(150):
        b = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.choice(b'{}[]",:-0123456789e.ntu \n\xff')
        p.write_bytes(bytes(b))
        try:
            load_request_log(p)
        except TraceFormatError as e:
            errors += 1
            assert "\n" not in str(e) and str(e).startswith(str(p))
    assert errors > 50


# ------------------------------------------------------------------------------------------ KV events
CAPACITY = 24  # blocks: small enough that the log evicts


def config(**kw) -> ReplayConfig:
    return ReplayConfig(**{"capacity_blocks": CAPACITY, "block_size": BS, "policy": "lru", **kw})


@pytest.fixture
def served(log, tmp_path: Path):
    """The loaded log and the path of its simulated event stream."""
    w = load_request_log(log[0])
    batches = simulate_vllm_events(prompts_of(w), CAPACITY, BS)
    return w, write_events(tmp_path / "events.jsonl", batches), batches


def test_recording_does_not_change_numbers(served):
    w = served[0]
    _, _, cols = record_replay(w, config())
    frame = replay(w, config()).requests  # the compiled kernel
    for name in ("hit_blocks", "new_blocks", "evictions"):
        assert cols[name].tolist() == frame[name].tolist()
    assert frame["evictions"].sum() > 0 and frame["hit_blocks"].sum() > 0


def test_validate_replay_matches_simulated_vllm(served):
    w, path, batches = served
    report = validate_replay(w, path, config())
    assert report.ok, report.summary()
    n_stored = sum(len(e["block_hashes"]) for b in batches for e in b["events"] if e["type"] == "BlockStored")
    n_removed = sum(1 for b in batches for e in b["events"] if e["type"] == "BlockRemoved")
    assert report.replay_stored == report.events_stored == n_stored
    assert report.replay_removed == report.events_removed == n_removed > 0
    assert report.matched_ops == n_stored + n_removed and report.first_divergence is None
    assert report.requests_in_order == len(w)
    assert "replay matches" in report.summary()
    assert validate_replay(w, read_kv_events(path), config()).ok


def _corrupt(batches: list[dict], what: str) -> tuple[list[dict], int]:
    """A deep copy with one event corrupted; returns it and the 1-based line of the corrupted batch."""
    out = json.loads(json.dumps(batches))
    for ln, b in enumerate(out, 1):
        for i, e in enumerate(b["events"]):
            if what == "token" and e["type"] == "BlockStored" and ln > 3:
                e["token_ids"][-1] += 1
                return out, ln
            if what == "drop_removed" and e["type"] == "BlockRemoved":
                del b["events"][i]
                return out, ln
            if what == "swap" and len(b["events"]) >= 2 and b["events"][0]["type"] == "BlockRemoved":
                b["events"].append(b["events"].pop(0))
                return out, ln
    raise AssertionError(f"no event to corrupt for {what}")


@pytest.mark.parametrize("what", ["token", "drop_removed", "swap"])
def test_validate_replay_reports_a_corrupted_event(served, tmp_path: Path, what: str):
    w, _, batches = served
    bad, ln = _corrupt(batches, what)
    report = validate_replay(w, write_events(tmp_path / "bad.jsonl", bad), config())
    assert not report.ok
    assert report.first_divergence is not None and f"line {ln}," in report.first_divergence
    assert 0 < report.requests_in_order < len(w)
    assert f"request row {report.requests_in_order}" in report.first_divergence
    if what == "token":
        assert report.extra_stored >= 1 and report.missing_stored >= 1
    if what == "drop_removed":
        assert report.missing_removed == 1 and report.extra_removed == 0 and report.extra_stored == 0
    if what == "swap":  # same multisets, different order
        assert not (report.missing_stored or report.extra_stored or report.missing_removed or report.extra_removed)
    assert all("\n" not in m for m in report.mismatches) and "DIFFERS" in report.summary()


def test_validate_replay_other_differences(served, tmp_path: Path):
    w, _, batches = served
    # another capacity: the replay evicts differently
    assert not validate_replay(w, read_kv_events(served[1]), config(capacity_blocks=CAPACITY + 8)).ok
    # a stream recorded from the middle: the first parent hash is unknown
    late = validate_replay(w, write_events(tmp_path / "late.jsonl", batches[3:]), config())
    assert late.unresolved >= 1 and any("never stored earlier" in m for m in late.mismatches)
    # a cleared cache and a CPU-tier event
    extra = json.loads(json.dumps(batches))
    extra.append({"ts": 1e4, "events": [{"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"},
                                        {"type": "AllBlocksCleared"}]})
    rep = validate_replay(w, write_events(tmp_path / "x.jsonl", extra), config())
    assert rep.cleared == 1 and rep.skipped == 1 and not rep.ok
    # refusals: block size, mixed ranks, mode, hash traces
    with pytest.raises(ConfigError, match="block_size 4, but the replay's block size is 8"):
        validate_replay(w, served[1], config(block_size=8))
    ranks = json.loads(json.dumps(batches))
    ranks[-1]["data_parallel_rank"] = 1
    with pytest.raises(ConfigError, match=r"ranks \[0, 1\]"):
        validate_replay(w, write_events(tmp_path / "r.jsonl", ranks), config())
    with pytest.raises(ConfigError, match="mode must be 'vllm'"):
        validate_replay(w, served[1], config(mode="ideal"))
    with pytest.raises(ConfigError, match="token workload"):
        validate_replay(from_lists([[1, 2]], kind="blocks", block_size=BS), [], config())


def test_validate_replay_duplicates_and_tiny_cache(tmp_path: Path):
    """A fully cached prompt of whole blocks recomputes (and stores again) its last block: a duplicate."""
    a, b = list(range(8)), list(range(100, 112))
    prompts = [a, a, a + [9], b, a, b[:9], a, b]
    w = from_lists(prompts, arrival=list(range(len(prompts))))
    for capacity in (3, 4, 6, 50):
        events = write_events(tmp_path / f"d{capacity}.jsonl", simulate_vllm_events(prompts, capacity, BS))
        report = validate_replay(w, events, config(capacity_blocks=capacity))
        assert report.ok, (capacity, report.summary())
    # capacity 50: 5 distinct full blocks, and the last block of a / b stored again on each full repeat
    assert report.replay_stored == report.events_stored == 5 + 4


BAD_EVENTS = [
    ('{"events": []}', "ts", "missing required field"),
    ('{"ts": 1, "events": {}}', "events", "expected a list"),
    ('{"ts": 1, "events": [3]}', "events[0]", "expected an event object"),
    ('{"ts": 1, "events": [{"type": "BlockEvicted"}]}', "events[0].type", "BlockStored, BlockRemoved"),
    ('{"ts": 1, "events": [{"type": "AllBlocksCleared"}, {"type": "BlockRemoved", "block_hashes": []}]}',
     "events[1].block_hashes", "non-empty list"),
    ('{"ts": 1, "events": [{"type": "BlockRemoved", "block_hashes": [1.5]}]}', "events[0].block_hashes",
     "integer or a string"),
    ('{"ts": 1, "events": [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 2}]}',
     "events[0].parent_block_hash", "missing required field"),
    ('{"ts": 1, "events": [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": null, '
     '"token_ids": [1], "block_size": 2}]}', "events[0].token_ids", "expected block_size 2 x 1 block_hashes = 2"),
    ('{"ts": 1, "events": [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": null, '
     '"token_ids": [1], "block_size": 0}]}', "events[0].block_size", "expected an int in"),
    ('{"ts": 1, "events": [], "data_parallel_rank": "0"}', "data_parallel_rank", "int >= 0 or null"),
]


@pytest.mark.parametrize(("line", "field", "message"), BAD_EVENTS)
def test_read_kv_events_bad_line(tmp_path: Path, line: str, field: str, message: str):
    text = second_line_error(tmp_path / "ev.jsonl", read_kv_events,
                             '{"ts": 0.5, "events": [{"type": "AllBlocksCleared"}]}', line)
    assert "\n" not in text and f"ev.jsonl:2: field '{field}'" in text and message in text, text


def test_read_kv_events_integer_hashes(tmp_path: Path):
    p = tmp_path / "ints.jsonl"
    p.write_text(json.dumps({"ts": 1, "events": [
        {"type": "BlockStored", "block_hashes": [2**70, 5], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
         "block_size": 2, "lora_id": None, "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}]}) + "\n")
    ev = read_kv_events(p)
    assert [e.op for e in ev] == ["stored", "removed"] and ev[0].block_hashes == (2**70, 5)
    assert ev[0].token_ids == (1, 2, 3, 4) and ev[1].line == 1 and ev[1].index == 1
