"""What the prefix cache sees of the tiers below the device: the :class:`LowerTiers` protocol.

The cache core sits below kvlab.tiers and never imports it; :class:`kvlab.tiers.TierStack` implements this
protocol and sets itself as ``cache.tiers``. The admission steps (:mod:`kvlab.cache.admission`) call these
methods, in this order for one request: ``lookup``, then ``pin`` (something found) or ``begin`` (nothing),
then ``load``, then ``keyed``. Units: positions and counts in device blocks.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence, Sized
from typing import Protocol

from kvlab.cache.block import KVBlock
from kvlab.cache.context import AccessContext


class LowerTiers(Protocol):
    """The tiers below one device cache, as the cache's admission uses them. ``found`` is what ``lookup``
    returned (its length: the blocks that will be loaded), or ``()`` when there was no lookup."""

    def lookup(self, keys: Sequence[Hashable], start: int, limit: int) -> Sized:
        """Hits of ``keys[start:limit]`` (``start`` = the device's hits), each tier from the first miss above it;
        no side effects."""
        ...

    def begin(self, ctx: AccessContext) -> None:
        """The request ``ctx`` is admitted now and found nothing below the device."""
        ...

    def pin(self, found: Sized, ctx: AccessContext) -> None:
        """Count and pin what ``lookup`` found for request ``ctx`` (before the device allocates)."""
        ...

    def load(self, found: Sized, keys: Sequence[Hashable], device_hits: int, ctx: AccessContext,
             into: Sequence[KVBlock] = ()) -> list[int]:
        """Copy ``found`` into the device blocks ``into`` and release the pins; the loaded blocks per lower tier
        (index 0 = the tier just below the device)."""
        ...

    def keyed(self, keys: Sequence[Hashable], start: int, end: int, loaded: int, ctx: AccessContext) -> None:
        """The device keyed positions ``start .. end - 1`` of ``keys``, the first ``loaded`` of them loaded."""
        ...


__all__ = ["LowerTiers"]
