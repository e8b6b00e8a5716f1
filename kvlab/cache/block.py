"""The unit of KV storage: one block of ``block_size`` token slots in the pool."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block of the pool.

    Invariants: ``ref_cnt >= 0`` (number of running requests using it); ``key`` is set only while the
    block holds a full, cached block of tokens (it is then findable through the cache index);
    ``position`` is the block's index in its sequence (0 = first block of a prompt), valid with ``key``;
    ``parent`` is the key of the previous block in the sequence (None for position 0), used for orphan
    accounting. ``truth`` is an optional collision-free identity used by verify mode.
    """

    block_id: int
    ref_cnt: int = 0
    key: Hashable | None = None
    position: int = -1
    parent: Hashable | None = None
    truth: Hashable | None = None
