"""The engine's lower tiers: a :class:`~kvlab.tiers.TierStack` beside its cache core, with real stores.

:func:`attach_tiers` builds the stack (docs/tiers.md semantics, the replay's), each tier's store, chosen by its
medium's name (:data:`~kvlab.engine.tiers.store.STORES`), and a :class:`~kvlab.engine.tiers.mover.TierIO` that
moves the K/V bytes. Unnamed, the media are :func:`default_stores`: every tier in host DRAM, except, with a
``tier_dir``, the last one, which is on disk there (docs/engine.md, "Real tiers in the engine").
:func:`tier_results` adds the replay's per-request tier columns and the ``tiers`` summary list, with each
tier's store kind, read and write errors and I/O seconds.

Units: blocks, bytes, seconds.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence

import numpy as np
import pandas as pd

from kvlab.cache import PrefixCache
from kvlab.engine.kv_pool import KVPool
from kvlab.engine.tiers.mover import TierIO
from kvlab.engine.tiers.store import StoreSpec, TierDir, TierStore, check_stores, make_store
from kvlab.errors import ConfigError
from kvlab.tiers import Tier, TierStack, check_tiers, parse_tier
from kvlab.tiers.results import tier_columns, tier_summary

MEDIUM_STORES = {"dram": "dram", "nvme": "disk"}
"""The store of a tier whose ``medium`` (a :mod:`kvlab.tiers.timing` preset name) starts with a key here: host
memory presets (``dram_ddr5``) in DRAM, NVMe presets (``nvme_gen4``, ``nvme_gen5``) on disk."""


def default_stores(tiers: int | Sequence[Tier], on_disk: bool) -> list[str]:
    """The stores of the tiers when none are named. A tier with a ``medium`` gets that medium's store
    (:data:`MEDIUM_STORES`; on disk only with a ``tier_dir``, ``on_disk``); the others are in DRAM, except that
    with ``on_disk`` and no tier naming a disk medium the last tier is on disk. ``tiers``: the tiers, or their
    count (none naming a medium)."""
    specs = [None] * tiers if isinstance(tiers, int) else list(tiers)
    media = [next((store for prefix, store in MEDIUM_STORES.items()
                   if getattr(t, "medium", None) and t.medium.startswith(prefix)), None) for t in specs]
    if not on_disk:
        return ["dram"] * len(specs)
    if specs and "disk" not in media and media[-1] is None:
        media[-1] = "disk"
    return [m or "dram" for m in media]


def attach_tiers(cache: PrefixCache, pool: KVPool, tiers: Sequence[Tier | str] | None, *,
                 tier_dir: str | os.PathLike | None = None, max_load_tokens: int | None = None, defer: bool = False,
                 fsync: bool = True, quota_bytes: int | None = None,
                 stores: Sequence[str] | None = None) -> TierIO | None:
    """Tiers ``tiers`` (:class:`Tier` or its ``--tier`` spelling) below ``cache`` (whose block ids are
    ``pool``'s), their bytes in real stores; None without tiers. ``capacity_gib`` tiers are sized with the
    pool's bytes per block. ``stores``: each tier's medium by name (:data:`~kvlab.engine.tiers.store.STORES`,
    level 1 first); default :func:`default_stores` (by each tier's ``medium``, else DRAM; with ``tier_dir`` and no
    disk medium named, the last tier on disk).
    ``tier_dir``: where disk stores keep their files (``fsync``, ``quota_bytes``: their options).
    ``defer``: stores of blocks keyed now wait for ``TierIO.flush`` (the scheduler keys blocks at schedule).
    Every name and rule is checked before any work (ConfigError)."""
    tiers = [t if isinstance(t, Tier) else parse_tier(str(t), "tiers") for t in tiers or []]
    if tier_dir is not None and not tiers:
        raise ConfigError("tier_dir needs tiers=[Tier(...)]: it holds the last tier's data")
    check_tiers(tiers, max_load_tokens=max_load_tokens)  # the replay's and simulator's tier rules, before any work
    media = list(stores) if stores is not None else default_stores(tiers, tier_dir is not None)
    check_stores(media, [t.name for t in tiers], has_dir=tier_dir is not None)
    if not tiers:
        return None
    layout = pool.layout
    resolved = [t.resolve(layout.bytes_per_block) for t in tiers]
    stack = TierStack(cache, resolved, max_load_tokens=max_load_tokens)
    where = TierDir(tier_dir) if tier_dir is not None else None
    pin = pool.device.type == "cuda"
    made: list[TierStore] = [
        make_store(medium, StoreSpec(lt.spec.name, layout, lt.chunk, lt.cache.capacity_blocks, pin=pin,
                                     directory=where.path if where is not None else None, fsync=fsync,
                                     quota_bytes=quota_bytes))
        for medium, lt in zip(media, stack.tiers, strict=True)]
    io = TierIO(pool, made, defer=defer, tier_dir=where)
    io.stack, io.tiers, io.max_load_tokens = stack, resolved, max_load_tokens
    stack.attach(io)
    weakref.finalize(io, _close, made, where)  # this run's files go when the engine does (or at exit)
    return io


def _close(stores: list[TierStore], where: TierDir | None) -> None:
    for s in stores:
        s.close()
    if where is not None:
        where.close()


def tier_config(io: TierIO | None) -> dict:
    """The tiers' part of an engine's config (empty without tiers)."""
    if io is None:
        return {}
    return {"tiers": [t.label() for t in io.tiers], "tier_stores": [s.kind for s in io.stores],
            "tier_dir": str(io.dir.path) if io.dir is not None else None, "max_load_tokens": io.max_load_tokens}


def request_tier_hits(io: TierIO, tier_hits: Sequence[int] | None) -> list[int]:
    """One request's loaded blocks per tier (level 1 first), zeros when it loaded none."""
    return list(tier_hits) if tier_hits else [0] * len(io.tiers)


def tier_results(frame: pd.DataFrame, tier_hits: Sequence[Sequence[int]], io: TierIO | None, block_size: int) -> dict:
    """Adds ``hit_tokens_device`` and ``hit_tokens_<tier>`` to ``frame`` (``tier_hits``: loaded blocks per
    request and tier); returns the summary's ``device_token_hit_rate`` and ``tiers`` list (bytes from the pool's
    layout; per tier also ``store``, ``read_errors``, ``write_errors``, ``read_s``, ``write_s``). Without tiers
    (``io`` None): nothing."""
    if io is None:
        return {}
    hits = np.asarray([request_tier_hits(io, h) for h in tier_hits], np.int64).reshape(len(frame), len(io.tiers))
    tier_columns(frame, {"tier_hit_blocks": hits}, io.tiers, block_size)
    out = tier_summary(frame, [t.counters for t in io.stack.tiers], io.tiers, block_size,
                       per_block=io.pool.layout.bytes_per_block)
    for entry, extra in zip(out["tiers"], io.summary(), strict=True):
        entry.update(extra)
    return out
