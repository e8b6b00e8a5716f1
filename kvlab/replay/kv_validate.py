"""Validation of a kvlab replay against recorded vLLM KV cache events (:func:`validate_replay`).

The events are read by :func:`kvlab.workload.kv_events.read_kv_events` (the format is in that module's
docstring); :func:`validate_replay` replays the request log the server was given with kvlab (vLLM counting
mode, the events' block size) while recording every block kvlab stores and every key it drops
(:func:`record_replay`), and compares the two streams.

Comparison is by token content, not by hash: a stored block's identity is its whole token prefix, rebuilt
through each ``BlockStored``'s ``parent_block_hash`` chain and ``token_ids``; kvlab's blocks get the same
identity from the request's prompt tokens. LoRA, cache salt and other extra keys are not compared. Events of
another medium than ``"GPU"`` (or null), or of a KV cache group other than 0 (or null), are counted in
``skipped`` and not compared.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvlab.cache import AccessContext, PrefixCache, pool_blocks
from kvlab.cache.prefix_cache import NO_CONTEXT, Admission, KVBlock
from kvlab.errors import ConfigError
from kvlab.policies import EvictionPolicy, make_policy
from kvlab.replay.replay import ReplayConfig, admit_requests, encode, resolve_config
from kvlab.workload.kv_events import CLEARED, REMOVED, STORED, KVEvent, read_kv_events
from kvlab.workload.workload import Workload

_ROOT = -1  # content id of the empty prefix
_MAX_SHOWN = 20  # mismatch lines kept in a report (the counts cover all)


class _Contents:
    """Dense ids for token prefixes: ``child(parent_id, tokens)`` is the id of a parent's prefix + tokens."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}
        self._fresh = -2  # unique ids for blocks whose prefix cannot be known (never equal to a real one)

    def child(self, parent: int, tokens: tuple[int, ...]) -> int:
        return self._ids.setdefault((parent, tokens), len(self._ids))

    def unknown(self) -> int:
        self._fresh -= 1
        return self._fresh


@dataclass(frozen=True, slots=True)
class _Op:
    op: str  # STORED or REMOVED
    content: int  # _Contents id of the block's token prefix
    where: str  # "request row 3, block 2" (replay) or "line 7, events[1]" (events)
    row: int = -1  # replay: the request's row


class _RecordingCache(PrefixCache):
    """A PrefixCache that records, in order, every block it keys (stores) and every key it drops (removals),
    by token content. Recording only: every state transition is the base class's, so the numbers are too."""

    def __init__(
        self, pool: int, policy: EvictionPolicy, block_size: int, workload: Workload, contents: _Contents
    ) -> None:
        super().__init__(pool, policy, block_size=block_size)
        self.ops: list[_Op] = []
        self._workload, self._contents = workload, contents
        self._row = -1
        self._chain: list[int] = []  # content ids of the current request's full blocks
        self._content_of_key: dict[Hashable, int] = {}
        self._stored_by: dict[int, int] = {}  # block id -> row of the request that stored its current key
        self.key_listener = self._removed

    def admit(self, keys: Sequence[Hashable], prompt_tokens: int, ctx: AccessContext = NO_CONTEXT,
              **kw: object) -> Admission | None:
        self._row, self._chain = ctx.seq, []
        return super().admit(keys, prompt_tokens, ctx, **kw)

    def _content(self, pos: int) -> int:
        """Content id of full block ``pos`` of the current request's prompt."""
        chain, bs = self._chain, self.block_size
        prompt = self._workload.prompt(self._row)
        while len(chain) <= pos:
            j = len(chain)
            tokens = tuple(prompt[j * bs:(j + 1) * bs].tolist())
            chain.append(self._contents.child(chain[-1] if chain else _ROOT, tokens))
        return chain[pos]

    def cache_blocks(self, blocks: Sequence[KVBlock], keys: Sequence[Hashable], start: int,
                     ctx: AccessContext = NO_CONTEXT, truths: Sequence | None = None) -> None:
        for j, block in enumerate(blocks):
            self._stored_by[block.block_id] = self._row
            c = self._content(start + j)
            self._content_of_key.setdefault(keys[start + j], c)
            self.ops.append(_Op(STORED, c, f"request row {self._row}, block {start + j}", self._row))
        super().cache_blocks(blocks, keys, start, ctx, truths)

    def _removed(self, block: KVBlock, last: bool) -> None:
        where = (f"request row {self._row} evicts block {block.position} stored by request row "
                 f"{self._stored_by[block.block_id]}")
        self.ops.append(_Op(REMOVED, self._content_of_key[block.key], where, self._row))


@dataclass
class ValidationReport:
    """The comparison of a replay's block stores and removals with a recorded event stream.

    Counts are in blocks. ``missing_*``: in the replay, not in the events; ``extra_*``: in the events, not in
    the replay (as multisets of token content). ``matched_ops``: length of the common prefix of the two
    ordered streams (stores and removals interleaved); ``requests_in_order``: requests (in trace order, from
    the first) whose stores and removals all lie in that prefix; ``first_divergence``: one line describing where they
    part, or None. ``unresolved``: events whose hash was never stored earlier in the stream; ``cleared``:
    ``AllBlocksCleared`` events (a replay never clears); ``skipped``: events of another medium or group.
    ``mismatches``: the first few problems, one line each (the counts cover all of them).
    """

    requests: int
    replay_stored: int
    replay_removed: int
    events_stored: int
    events_removed: int
    missing_stored: int
    extra_stored: int
    missing_removed: int
    extra_removed: int
    matched_ops: int
    requests_in_order: int
    first_divergence: str | None
    unresolved: int
    cleared: int
    skipped: int
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when stores, removals and their order all agree and every event was resolved."""
        return (self.first_divergence is None and not self.unresolved and not self.cleared
                and not (self.missing_stored or self.extra_stored or self.missing_removed or self.extra_removed))

    def summary(self) -> str:
        """A few lines for people: the verdict, the counts, then the mismatches."""
        head = "replay matches the KV events" if self.ok else "replay DIFFERS from the KV events"
        lines = [
            f"{head}: {self.requests} requests; stored {self.replay_stored} (replay) / {self.events_stored} (events) "
            f"blocks, removed {self.replay_removed} / {self.events_removed}; {self.matched_ops} operations "
            f"({self.requests_in_order} requests) in the same order; unresolved {self.unresolved}, "
            f"cleared {self.cleared}, skipped {self.skipped}",
        ]
        lines += [f"  {m}" for m in self.mismatches]
        return "\n".join(lines)


def record_replay(workload: Workload, config: ReplayConfig) -> tuple[list[_Op], _Contents, dict]:
    """Replay ``workload`` (Python core) recording its stores and removals; also return the per-request columns.

    ``config`` is a :class:`~kvlab.replay.ReplayConfig` in mode ``"vllm"`` without tiers.
    """
    if workload.kind != "tokens":
        raise ConfigError("validate_replay needs a token workload (KV events carry token ids), "
                          f"got kind={workload.kind!r}")
    if config.mode != "vllm":
        raise ConfigError(f"validate_replay compares with vLLM: mode must be 'vllm', got {config.mode!r}")
    if config.tiers:
        raise ConfigError("validate_replay compares one device cache: give no tiers")
    config.validate()
    config = resolve_config(workload, config)
    enc = encode(workload, config)
    policy = make_policy(config.policy, **config.policy_params)
    policy.prepare(enc)
    contents = _Contents()
    pool = pool_blocks(config.capacity_blocks, int(enc.num_blocks.sum()) + 1)
    cache = _RecordingCache(pool, policy, enc.block_size, workload, contents)
    cols = admit_requests(workload, enc, config, [cache], 0, False)
    return cache.ops, contents, cols


def _event_ops(events: Sequence[KVEvent], contents: _Contents) -> tuple[list[_Op], list[str], int, int, int]:
    """The events as ordered ops by content; also the unresolved-hash lines and the unresolved/cleared/skipped
    counts."""
    content_of: dict[int | str, int] = {}
    ops: list[_Op] = []
    problems: list[str] = []
    unresolved = cleared = skipped = 0
    for ev in events:
        where = f"line {ev.line}, events[{ev.index}]"
        if ev.op == CLEARED:
            cleared += 1
            problems.append(f"{where}: AllBlocksCleared (the replay never clears its cache)")
            continue
        if not ev.compared:
            skipped += 1
            continue
        if ev.op == REMOVED:
            for h in ev.block_hashes:
                c = content_of.get(h)
                if c is None:
                    unresolved += 1
                    problems.append(f"{where}: BlockRemoved of hash {h!r}, never stored earlier in the stream")
                    c = contents.unknown()
                ops.append(_Op(REMOVED, c, where))
            continue
        parent = _ROOT
        if ev.parent_block_hash is not None:
            if ev.parent_block_hash in content_of:
                parent = content_of[ev.parent_block_hash]
            else:
                unresolved += 1
                problems.append(f"{where}: parent_block_hash {ev.parent_block_hash!r} was never stored earlier "
                                "in the stream (recording started late?)")
                parent = contents.unknown()  # its children get ids no replay block has
        bs = ev.block_size
        for j, h in enumerate(ev.block_hashes):
            c = contents.child(parent, ev.token_ids[j * bs:(j + 1) * bs])
            content_of[h] = c
            ops.append(_Op(STORED, c, where))
            parent = c
    return ops, problems, unresolved, cleared, skipped


def validate_replay(workload: Workload, events: Sequence[KVEvent] | str | os.PathLike, config: ReplayConfig
                    ) -> ValidationReport:
    """Replay ``workload`` with ``config`` (a ReplayConfig, mode ``"vllm"``) and compare with ``events``.

    ``events``: :func:`read_kv_events`'s list, or a path to read. The replay's block size must equal every
    compared ``BlockStored``'s ``block_size`` (a ConfigError names the first line that differs); give
    ``capacity_blocks`` as the server's usable GPU blocks. The events must come from one data-parallel rank.
    The replay is kvlab's ordinary Python-core replay (same numbers as :func:`kvlab.replay.replay`), observed
    through the prefix cache's ``cache_blocks`` and ``key_listener``.

    What agreement to expect: a server that stores blocks the replay does not (decode blocks of generated
    tokens, whenever a request generates past a block boundary) or that runs requests concurrently evicts in
    another order; exact agreement is expected for a log served one request at a time with no decode blocks
    (e.g. ``max_tokens=1``), prefix caching on, and the same capacity in blocks.
    """
    if isinstance(events, str | os.PathLike):
        events = read_kv_events(events)
    ranks = sorted({ev.rank for ev in events if ev.rank is not None})
    if len(ranks) > 1:
        raise ConfigError(f"the events come from data-parallel ranks {ranks}: validate one rank's stream at a time")
    bs = config.block_size or workload.default_block_size
    for ev in events:
        if ev.op == STORED and ev.compared and ev.block_size != bs:
            raise ConfigError(f"KV events line {ev.line}, events[{ev.index}]: block_size {ev.block_size}, but the "
                              f"replay's block size is {bs} (give block_size={ev.block_size})")
    replay_ops, contents, _ = record_replay(workload, config)
    event_ops, problems, unresolved, cleared, skipped = _event_ops(events, contents)
    mismatches = list(problems)
    counts = {}
    for op in (STORED, REMOVED):
        mine = collections.Counter(o.content for o in replay_ops if o.op == op)
        theirs = collections.Counter(o.content for o in event_ops if o.op == op)
        missing, extra = mine - theirs, theirs - mine
        counts[op] = (sum(mine.values()), sum(theirs.values()), sum(missing.values()), sum(extra.values()))
        name = "BlockStored" if op == STORED else "BlockRemoved"
        for o in replay_ops:
            if o.op == op and missing[o.content] > 0:
                missing[o.content] -= 1
                mismatches.append(f"{o.where}: {op} by the replay, no matching {name} in the events")
        for o in event_ops:
            if o.op == op and extra[o.content] > 0:
                extra[o.content] -= 1
                hint = "" if o.content in mine or op == REMOVED else " (generated tokens, or a request not admitted?)"
                mismatches.append(f"{o.where}: {name} of a block the replay never {op}{hint}")
    matched = 0
    for a, b in zip(replay_ops, event_ops, strict=False):
        if (a.op, a.content) != (b.op, b.content):
            break
        matched += 1
    in_order = replay_ops[matched].row if matched < len(replay_ops) else len(workload)
    divergence = None
    if matched < max(len(replay_ops), len(event_ops)):
        a = replay_ops[matched] if matched < len(replay_ops) else None
        b = event_ops[matched] if matched < len(event_ops) else None
        other = " of another block" if a is not None and b is not None and a.op == b.op else ""
        mine_s = f"{a.where}: {a.op}" if a is not None else "replay ends"
        theirs_s = f"{b.where}: {b.op}{other}" if b is not None else "events end"
        divergence = f"operation {matched}: replay {mine_s}; events {theirs_s}"
        mismatches.insert(0, f"order differs at {divergence}")
    return ValidationReport(
        requests=len(workload),
        replay_stored=counts[STORED][0], events_stored=counts[STORED][1],
        missing_stored=counts[STORED][2], extra_stored=counts[STORED][3],
        replay_removed=counts[REMOVED][0], events_removed=counts[REMOVED][1],
        missing_removed=counts[REMOVED][2], extra_removed=counts[REMOVED][3],
        matched_ops=matched, requests_in_order=in_order, first_divergence=divergence, unresolved=unresolved,
        cleared=cleared, skipped=skipped, mismatches=mismatches[:_MAX_SHOWN],
    )


__all__ = ["ValidationReport", "record_replay", "validate_replay"]
