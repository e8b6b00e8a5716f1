"""Per-request KV block management over the shared :class:`PrefixCache` (vLLM v1's ``KVCacheManager``).

Used by the scheduler of both serving executors (the cost-model simulator and the real engine under the
scheduler) and by the real engine's sequential driver (:class:`kvlab.engine.Engine`). A request's
sequence is its prompt followed by the tokens it has sampled; ``keys`` are the chained keys of the full
blocks of everything known about that sequence: the prompt, then (token traces with reference answers)
the known output tokens, so a block filled by output tokens is keyed like a prompt block and a later
turn can reuse the answer. Hash traces have no output ids: their keys stop at the prompt's last full
block, so the partial prompt block and every output block stay unkeyed. A driver that learns keys as
tokens are sampled (the engine) appends them with :meth:`KVCacheManager.extend_keys`.

Requests are admitted through the admission sequence of :mod:`kvlab.cache.admission` (lookup in
:meth:`~KVCacheManager.get_computed_blocks`; fit, pin, on_miss, allocate, load in
:meth:`~KVCacheManager.allocate_slots`; key when blocks are full of computed tokens).

Invariants (``bs`` = block size in tokens):

* ``req.blocks`` holds ``ceil(tokens with a slot / bs)`` blocks, in sequence order; each is pinned
  (ref count > 0) while the request holds it.
* ``req.blocks[:req.num_keyed_blocks]`` carry ``req.keys[:num_keyed_blocks]`` (hit or computed here).
* A block gets its key when it becomes full of tokens that are computed: with ``cache_at="schedule"``
  (vLLM v1) in the step that computes its last token, so requests scheduled later in the same step can
  hit it; with ``cache_at="compute"`` only once that step has run (keyed by :meth:`cache_computed` right
  after the forward pass, or at the request's next allocation or when it is freed).
* Hits are capped so that the last known token is always recomputed (docs/semantics.md,
  "Lookup, admission and release (one request)"): at most ``(num_tokens - 1) // bs`` blocks.
* ``allocate_slots`` either succeeds or changes nothing (no touch, no allocation, no eviction, no key).
* ``free`` releases tail first, so LRU evicts a sequence's tail before its head; it keys only blocks full
  of computed tokens, so a request whose forward pass failed (``num_computed_tokens`` not advanced) leaves
  no key over unwritten K/V.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvlab.cache import admission
from kvlab.cache.admission import Lookup
from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext
from kvlab.cache.prefix_cache import PrefixCache
from kvlab.errors import ConfigError

CACHE_AT = ("schedule", "compute")
_NEVER = 1 << 62  # key_at when every known key is placed


@dataclass(slots=True, eq=False)
class KVRequest:
    """The KV state of one request (tokens; blocks of ``block_size`` tokens).

    ``num_tokens`` = prompt + sampled tokens known so far (-1 at construction means ``prompt_tokens``);
    ``num_computed_tokens`` = leading tokens whose KV is in ``blocks`` (hits included). Counters:
    ``hit_blocks`` at the first admission, ``readmission_hit_blocks`` summed over later admissions (after
    preemption), ``new_blocks`` / ``evictions`` / ``orphan_evictions`` over the request's life.
    ``truths`` (optional, parallel to ``keys``): each full block's true identity, recorded on the block
    when it is keyed (the engine counts false hits with it; lookups do not check it).
    ``slot_tokens`` and ``key_at`` are the manager's bookkeeping for its fast path.
    """

    request_id: int
    prompt_tokens: int
    keys: Sequence[Hashable]
    truths: Sequence | None = None
    num_tokens: int = -1
    num_computed_tokens: int = 0
    ctx: AccessContext = field(default_factory=AccessContext)
    blocks: list[KVBlock] = field(default_factory=list)
    num_keyed_blocks: int = 0
    admissions: int = 0
    hit_blocks: int = 0
    readmission_hit_blocks: int = 0
    new_blocks: int = 0
    evictions: int = 0
    orphan_evictions: int = 0
    slot_tokens: int = 0  # = len(blocks) * block_size: tokens the held blocks have room for
    key_at: int = 0  # tokens after which the next block gets a key (a huge number when no key is left)
    lower: Sequence = ()  # lower-tier hits found by get_computed_blocks, for the admission that follows it
    tier_hits: list[int] = field(default_factory=list)  # blocks loaded per lower tier at the first admission

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            self.num_tokens = self.prompt_tokens
        if self.ctx.request_id < 0:
            self.ctx.request_id = self.request_id
        self.ctx.prompt_tokens = self.prompt_tokens


class KVCacheManager:
    """Allocates, keys and frees the blocks of running requests in one :class:`PrefixCache`.

    ``now`` (seconds) is stamped on the access context of every cache event; the scheduler sets it
    before each step. ``now=None``: the manager leaves each request's ``ctx.time`` as its driver set it
    (the sequential engine: the request's arrival, as in the replay). ``admissions`` counts successful
    admissions; ``ctx.seq`` is the driver's to set.
    """

    def __init__(self, cache: PrefixCache, *, cache_at: str = "schedule", now: float | None = 0.0) -> None:
        if cache_at not in CACHE_AT:
            raise ConfigError(f"cache_at must be one of {CACHE_AT}, got {cache_at!r}")
        self.cache = cache
        self.block_size = cache.block_size
        self.cache_at = cache_at
        self._key_scheduled = cache_at == "schedule"
        self.now = now
        self.admissions = 0

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, req: KVRequest) -> tuple[list[KVBlock], int]:
        """Admission steps 1-2 for a request that holds no blocks: ``(hit blocks, hit tokens)``, no side effects.

        Looks up the keys of the known full blocks, stops at the first miss and caps the hits at
        ``(num_tokens - 1) // block_size`` blocks (the last known token is always recomputed).
        """
        found = admission.lookup(self.cache, req.keys, req.num_tokens)
        req.lower = found.lower  # (tiers: used by the allocate_slots that admits it, right after)
        return found.hits, found.num_blocks * self.block_size

    def allocate_slots(
        self, req: KVRequest, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] | None = None
    ) -> bool:
        """Give ``req`` slots for ``num_new_tokens`` more tokens; False (and nothing changed) if they do not fit.

        ``new_computed_blocks`` (from :meth:`get_computed_blocks`; pass it, even empty, to *admit* a
        request that holds no blocks) are pinned first and counted as hits of this admission (admission
        steps 3-7); a running request's new blocks take steps 3, 5 and 6 (:mod:`kvlab.cache.admission`).
        The fit rule is the core's: the new blocks must not exceed the free blocks minus the hits that are
        currently evictable. Blocks that become full of computed tokens get their keys (``cache_at``).
        """
        admit = new_computed_blocks is not None
        if not admit:  # fast path (most decode steps): room in the held blocks and no block to key
            total = req.num_computed_tokens + num_new_tokens
            if total <= req.slot_tokens and (total if self._key_scheduled else req.num_computed_tokens) < req.key_at:
                return True
        bs = self.block_size
        blocks = req.blocks
        cache = self.cache
        ctx = req.ctx
        if self.now is not None:
            ctx.time = self.now
        if admit:
            if blocks:
                raise ConfigError(f"request {req.request_id} is admitted while it holds blocks")
            hits = new_computed_blocks if isinstance(new_computed_blocks, list) else list(new_computed_blocks)
            found = Lookup(hits, req.lower)
            req.lower = ()
            num_hit = found.num_blocks  # hits on every tier: their tokens count as computed
            computed = req.num_computed_tokens + num_hit * bs
            need = -(-(computed + num_new_tokens) // bs) - len(found.hits)  # lower-tier hits need device blocks
            placed = admission.admit(cache, found, req.keys, need, ctx)
            if placed is None:
                return False
            self.admissions += 1
            req.admissions += 1
            if req.admissions == 1:
                req.hit_blocks = num_hit
            else:
                req.readmission_hit_blocks += num_hit
            blocks.extend(found.hits)
            req.num_keyed_blocks = len(found.hits)
            req.num_computed_tokens = computed
            loaded = len(found.lower)
            if loaded:  # loaded blocks get their keys now (their K/V is in the pool once loaded)
                admission.key(cache, placed.blocks[:loaded], req.keys, len(found.hits), ctx, req.truths,
                              loaded=loaded)
                req.num_keyed_blocks += loaded
                if req.admissions == 1:
                    req.tier_hits = placed.loaded
        else:
            computed = req.num_computed_tokens
            need = -(-(computed + num_new_tokens) // bs) - len(blocks)
            placed = admission.grow(cache, req.keys, len(blocks), need, ctx) if need > 0 else None
            if placed is None and need > 0:
                return False
        if placed is not None and placed.blocks:
            blocks.extend(placed.blocks)
            req.new_blocks += len(placed.blocks)
            req.evictions += placed.evictions
            req.orphan_evictions += placed.orphan_evictions
        req.slot_tokens = len(blocks) * bs
        upto = computed + num_new_tokens if self._key_scheduled else computed
        self._key(req, min(upto // bs, len(req.keys)))
        return True

    def cache_computed(self, req: KVRequest) -> int:
        """Key every held block that is full of computed tokens (``num_computed_tokens``) and has a known
        key: the call right after a forward pass wrote them (admission step 8). Returns the blocks keyed."""
        k0 = req.num_keyed_blocks
        self._key(req, min(req.num_computed_tokens // self.block_size, len(req.keys), len(req.blocks)))
        return req.num_keyed_blocks - k0

    def extend_keys(self, req: KVRequest, keys: Sequence[Hashable], truths: Sequence | None = None) -> None:
        """Append the keys (and, when the request records them, truths) of further full blocks of ``req``'s
        sequence, e.g. blocks filled by sampled tokens; they are keyed like the others (``cache_at``). A list
        ``req.keys`` (``req.truths``) is extended in place."""
        if not keys:
            return
        if not isinstance(req.keys, list):
            req.keys = list(req.keys)
        req.keys.extend(keys)  # type: ignore[attr-defined]
        if req.truths is not None:
            if truths is None or len(truths) != len(keys):
                raise ConfigError(f"request {req.request_id} records truths: extend_keys needs one per key")
            if not isinstance(req.truths, list):
                req.truths = list(req.truths)
            req.truths.extend(truths)  # type: ignore[attr-defined]
        if req.blocks:  # re-arm the fast path's trigger (it was off when every earlier key was placed)
            req.key_at = (req.num_keyed_blocks + 1) * self.block_size

    def _key(self, req: KVRequest, n_key: int) -> None:
        """Give blocks ``num_keyed_blocks .. n_key - 1`` their keys (admission step 8); update ``key_at``."""
        k0 = req.num_keyed_blocks
        if n_key > k0:
            admission.key(self.cache, req.blocks[k0:n_key], req.keys, k0, req.ctx, req.truths)
            req.num_keyed_blocks = k0 = n_key
        req.key_at = (k0 + 1) * self.block_size if k0 < len(req.keys) else _NEVER

    def free(self, req: KVRequest) -> None:
        """Release every block of ``req`` (tail first), keying computed full blocks first; ``req`` then holds
        no blocks. The caller resets ``num_computed_tokens`` when the request is to be recomputed."""
        ctx = req.ctx
        if self.now is not None:
            ctx.time = self.now
        if req.blocks:
            self._key(req, min(req.num_computed_tokens // self.block_size, len(req.keys), len(req.blocks)))
            self.cache.release(req.blocks, ctx)
        req.blocks = []
        req.num_keyed_blocks = 0
        req.slot_tokens = 0
        req.key_at = 0
