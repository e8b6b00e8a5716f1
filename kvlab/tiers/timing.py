"""Tier timing for the serving simulator: links and media as resources, the cost of a load or a store.

A lower tier names a **medium** (where its data rests: host DRAM, an NVMe SSD; optional) and a **link**
(between it and the device: PCIe, an RDMA NIC), both presets of ``kvlab/data/tiers/presets.json``
(:func:`preset`, :func:`presets`) or JSON files of one (:func:`preset_file`: a measured disk). Tiers that
name the same preset share one resource (two tiers behind one PCIe link share its time). Each resource
keeps its reserved busy intervals; an operation keeps it busy for ::

    t(B bytes in n operations) = ceil(n / queue_depth) × latency_s + B / bandwidth

(``bandwidth``: bytes/s per direction; a medium has a read and a write bandwidth), in the earliest idle gap
of the resource at or after the time the data is there. Loads and stores share a resource's time (a store
delays the loads queued behind it). The operation size is the real
one: with ``kv_layout="layer"`` (vLLM's per-layer KV tensors) a chunk of ``c`` blocks is ``layers``
operations of ``c × bytes_per_block / layers`` bytes (Llama-3-8B, 16-token block: 2 MiB, 64 KiB per layer);
with ``"block"`` (layer-contiguous pages, LMCache / HiCache ``page_first``) one operation per chunk.

* **load** from tier ``k`` (:meth:`TierTiming.load`): medium ``k`` (read), then link ``k``: a disk tier's
  data is staged through host DRAM before it crosses the link to the device.
* **store** into tier ``k`` from the device: link ``k``, then medium ``k`` (write); from the tier above
  (``write_back`` below level 1: a host-side copy): medium ``k`` only.

Units: seconds, bytes, blocks of the run's block size.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

from kvlab.errors import ConfigError

KV_LAYOUTS = ("layer", "block")
KVLayout = Literal["layer", "block"]


@dataclass(frozen=True, slots=True)
class Preset:
    """A link or a medium (bytes/s, seconds); ``source`` says where the numbers come from."""

    name: str
    kind: str  # "link" or "medium"
    bandwidth: float  # per direction (a medium's read bandwidth)
    latency_s: float  # per operation
    queue_depth: int = 1  # operations in flight
    write_bandwidth: float | None = None  # a medium's; None: ``bandwidth``
    write_latency_s: float | None = None  # a medium's, per write operation (e.g. with fsync); None: ``latency_s``
    calibrated: bool = False
    description: str = ""
    source: str = ""

    def seconds(self, nbytes: float, ops: int, write: bool = False) -> float:
        """Busy time of ``ops`` operations moving ``nbytes`` bytes in all."""
        bw = self.write_bandwidth if write and self.write_bandwidth else self.bandwidth
        latency = self.write_latency_s if write and self.write_latency_s is not None else self.latency_s
        return -(-ops // self.queue_depth) * latency + nbytes / bw


@cache
def presets() -> dict[str, Preset]:
    """Every shipped preset by name (``kvlab/data/tiers/presets.json``)."""
    path = resources.files("kvlab") / "data" / "tiers" / "presets.json"
    data = json.loads(path.read_text())
    return {name: Preset(name=name, **fields) for name, fields in data["presets"].items()}


#: a preset file's fields -> their JSON types (a boolean is never a number)
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "name": str, "kind": str, "bandwidth": (int, float), "latency_s": (int, float), "queue_depth": int,
    "write_bandwidth": (int, float), "write_latency_s": (int, float), "calibrated": bool, "description": str,
    "source": str}


def preset_file(path: str | Path) -> Preset:
    """A preset from a JSON file of its fields (``kind``, ``bandwidth``, ``latency_s``, optional ``queue_depth``,
    ``write_bandwidth``, ``write_latency_s``, ``calibrated``, ``description``, ``source``; ``name`` defaults to the
    file's stem): e.g. a disk measured by kvlab.engine.tiers.measure.medium_preset. ConfigError if malformed."""
    from kvlab.inputs import load_json_object

    path = Path(path)
    # a regular file (a FIFO would block); json reads NaN / Infinity: a NaN latency is faster than free
    data = load_json_object(path, "timing preset")
    for key, value in data.items():
        kind = _FIELD_TYPES.get(key)
        if value is None and key in ("write_bandwidth", "write_latency_s"):
            continue  # unset: the read side's
        if kind is not None and (isinstance(value, bool) != (kind is bool) or not isinstance(value, kind)):
            what = {bool: "true or false", str: "a string", int: "an integer"}.get(kind, "a number")  # type: ignore[call-overload]
            raise ConfigError(f"timing preset {str(path)!r}: {key} must be {what}, got {value!r}")
    try:
        name = re.sub(r"[^A-Za-z0-9_]", "_", str(data.pop("name", path.stem)))
        p = Preset(name=name if name[:1].isalpha() else f"p_{name}", **data)
    except TypeError as exc:
        raise ConfigError(f"cannot read timing preset {str(path)!r}: {exc}") from None
    if p.kind not in ("link", "medium") or not p.bandwidth > 0 or p.latency_s < 0 or p.queue_depth < 1 or (
            p.write_bandwidth is not None and not p.write_bandwidth > 0) or (
            p.write_latency_s is not None and not p.write_latency_s >= 0):
        raise ConfigError(f"timing preset {str(path)!r}: needs kind link or medium, bandwidth > 0, latency_s >= 0, "
                          "queue_depth >= 1 (write_bandwidth > 0, write_latency_s >= 0 where given)")
    return p


def preset(name: str, kind: str | None = None) -> Preset:
    """The preset called ``name``: a shipped one (:func:`presets`) or a JSON file (:func:`preset_file`), of
    ``kind`` ("link" or "medium") if given. ConfigError (a ValueError) otherwise."""
    known = presets()
    p = known.get(name)
    if p is None and name.endswith(".json") and Path(name).exists():
        p = preset_file(name)  # refuses a FIFO or folder by name (kvlab.inputs.regular_file)
    if p is None or (kind is not None and p.kind != kind):
        what = f"a {kind} preset" if kind else "a timing preset"
        names = sorted(n for n, q in known.items() if kind is None or q.kind == kind)
        raise ConfigError(f"must be {what} ({', '.join(names)}, or a .json file of one), got {name!r}")
    return p


def check_preset(name: str, kind: str | None = None) -> str:
    """``name`` if it names a preset (:func:`preset`) of ``kind``; ConfigError otherwise."""
    preset(name, kind)
    return name


class Resource:
    """A preset in use: its reserved busy intervals (s; sorted, disjoint, those ending after the last
    :meth:`prune`) and the bytes it moved. A transfer takes the earliest idle gap, at or after the time its data
    is there, long enough for it: a transfer issued for later (a disk read's link hop, once staged) leaves the
    resource free for transfers that can run before it."""

    __slots__ = ("busy", "busy_s", "bytes", "preset")

    def __init__(self, p: Preset) -> None:
        self.preset = p
        self.busy: list[tuple[float, float]] = []
        self.bytes = 0.0
        self.busy_s = 0.0

    @property
    def busy_until(self) -> float:
        """End of the last reserved interval (0 when none is kept)."""
        return self.busy[-1][1] if self.busy else 0.0

    def reserve(self, ready: float, nbytes: float, ops: int, write: bool = False) -> tuple[float, float]:
        """Occupy the resource for one transfer whose data is there at ``ready``: ``(start, end)``."""
        t = self.preset.seconds(nbytes, ops, write)
        busy = self.busy
        start = ready
        i = 0
        for i, (s, e) in enumerate(busy):  # noqa: B007 - i is the insertion point after the loop
            if start + t <= s:
                break
            if e > start:
                start = e
        else:
            i = len(busy)
        busy.insert(i, (start, start + t))
        self.bytes += nbytes
        self.busy_s += t
        return start, start + t

    def prune(self, now: float) -> None:
        """Forget intervals that ended by ``now`` (no later transfer can start before ``now``)."""
        busy = self.busy
        k = 0
        while k < len(busy) and busy[k][1] <= now:
            k += 1
        if k:
            del busy[:k]


@dataclass(slots=True)
class Transfer:
    """A load's timing (s): the staging hops (media) end at ``staged``; the link hops run ``link_start`` ..
    ``end``; ``nbytes`` moved."""

    staged: float
    link_start: float
    end: float
    nbytes: float


class TierTiming:
    """The resources of one serving instance's tiers (a fresh busy-until state per instance).

    ``tiers``: the lower tiers, level 1 first, each with a ``link`` (ConfigError naming the tier otherwise);
    ``block_bytes``: KV bytes of one block; ``layers``: the model's layers (operation size, overlap).
    """

    def __init__(self, tiers: Sequence, block_bytes: int, layers: int, kv_layout: str = "layer") -> None:
        if kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        self.block_bytes = block_bytes
        self.layers = layers
        self.kv_layout = kv_layout
        self.resources: dict[str, Resource] = {}
        self.links: list[Resource] = []
        self.media: list[Resource | None] = []
        self.chunks: list[int] = []
        for t in tiers:
            if t.link is None:
                raise ConfigError(f"tier {t.name!r}: link (link=) is needed when tiers are timed (another tier names "
                                  "a link or medium)")
            self.links.append(self._resource(t.link, "link", t.name))
            self.media.append(self._resource(t.medium, "medium", t.name) if t.medium else None)
            self.chunks.append(t.chunk_blocks)

    def _resource(self, name: str, kind: str, tier: str) -> Resource:
        try:
            p = preset(name, kind)
        except ConfigError as err:
            raise ConfigError(f"tier {tier!r}: {kind} ({kind}=) {err}") from None
        if p.name not in self.resources:  # keyed (and named in the time series) by the preset's name
            self.resources[p.name] = Resource(p)
        return self.resources[p.name]

    # ------------------------------------------------------------------ sizes
    def ops(self, level: int, blocks: int) -> int:
        """Operations that move ``blocks`` blocks of tier ``level`` (whole chunks; per layer with ``layer``)."""
        chunks = -(-blocks // self.chunks[level - 1])
        return chunks * self.layers if self.kv_layout == "layer" else chunks

    # ------------------------------------------------------------------ loads
    def load(self, now: float, per_level: Sequence[int], staged: Sequence[int] | None = None) -> Transfer:
        """Load ``per_level[i]`` blocks from level ``i + 1`` at ``now``: each level's medium (if any), then its
        link; ``staged[i]`` of them are already in host memory (prefetched: no medium hop)."""
        staged_end = self.staging(now, per_level, staged)
        start, end = self.link_hops(staged_end, per_level)
        return Transfer(staged_end, start, end, float(sum(per_level)) * self.block_bytes)

    def staging(self, now: float, per_level: Sequence[int], staged: Sequence[int] | None = None) -> float:
        """The medium hops of a load (disk to host memory): the time its data is in host memory."""
        end = now
        for i, blocks in enumerate(per_level):
            medium = self.media[i]
            left = blocks - (staged[i] if staged is not None else 0)
            if medium is not None and left > 0:
                end = max(end, medium.reserve(now, left * self.block_bytes, self.ops(i + 1, left))[1])
        return end

    def link_hops(self, ready: float, per_level: Sequence[int]) -> tuple[float, float]:
        """The link hops of a load whose data is in host memory at ``ready``: ``(first start, last end)``."""
        first, end = math.inf, ready
        for i, blocks in enumerate(per_level):
            if blocks > 0:
                s, e = self.links[i].reserve(ready, blocks * self.block_bytes, self.ops(i + 1, blocks))
                first, end = min(first, s), max(end, e)
        return (first if first < math.inf else ready), end

    def snapshot(self) -> list[tuple[list, float, float]]:
        """Every resource's state, for :meth:`restore` (an estimate reserves, then restores)."""
        return [(list(r.busy), r.bytes, r.busy_s) for r in self.resources.values()]

    def restore(self, state: list[tuple[list, float, float]]) -> None:
        for r, (busy, nbytes, busy_s) in zip(self.resources.values(), state, strict=True):
            r.busy, r.bytes, r.busy_s = busy, nbytes, busy_s

    def prune(self, now: float) -> None:
        """Forget every resource's intervals that ended by ``now`` (the clock; called once per step)."""
        for r in self.resources.values():
            r.prune(now)

    # ------------------------------------------------------------------ stores
    def store(self, now: float, level: int, blocks: int, from_device: bool) -> float:
        """Store ``blocks`` blocks into tier ``level`` at ``now``: from the device (link, then medium write) or
        from the tier above (medium write only). Returns the time the copy is done."""
        if blocks <= 0:
            return now
        b = blocks * self.block_bytes
        ops = self.ops(level, blocks)
        end = now
        if from_device:
            end = self.links[level - 1].reserve(now, b, ops, write=True)[1]
        medium = self.media[level - 1]
        if medium is not None:
            end = medium.reserve(end, b, ops, write=True)[1]
        return end


def overlapped_end(t_start: float, compute_s: float, link_start: float, link_end: float, layers: int) -> float:
    """End of a step whose loads run layer by layer beside its compute: layer ``j``'s compute waits for layer
    ``j``'s KV. With uniform layers (compute ``c / L`` each, loads ``(e - s) / L`` each) the last layer ends at
    ``max(t + c, s + (e - s) / L + c, e + c / L)`` (the max of a linear recurrence is at its endpoints)."""
    if link_end <= link_start:
        return t_start + compute_s
    return max(t_start + compute_s, link_start + (link_end - link_start) / layers + compute_s,
               link_end + compute_s / layers)


def load_vs_recompute(cost, tiers: Sequence, level: int, prefix_tokens: Sequence[int], *, block_size: int,  # noqa: ANN001
                      new_tokens: int = 1, kv_layout: str = "layer") -> dict[str, list[float]]:
    """Break-even of loading against recomputing a prefix held by tier ``level`` (1 = below the device), on idle
    links: per prefix length ``p`` (tokens, whole blocks), ``load_s`` = the load of its ``p / block_size`` blocks
    (medium, then link), ``recompute_s`` = ``cost.duration([(p + new_tokens, 0)]) - cost.duration([(new_tokens,
    p)])``: the compute the load saves (``cost``: a :class:`kvlab.sim.cost.CostModel`). Loading pays where
    ``load_s < recompute_s``. Returns ``{"prefix_tokens", "load_s", "recompute_s"}``."""
    block_bytes = block_size * cost.model.kv_bytes_per_token
    out: dict[str, list[float]] = {"prefix_tokens": [], "load_s": [], "recompute_s": []}
    for p in prefix_tokens:
        blocks = int(p) // block_size
        timing = TierTiming(tiers, block_bytes, cost.model.num_layers, kv_layout)
        per_level = [blocks if i == level - 1 else 0 for i in range(len(tiers))]
        out["prefix_tokens"].append(blocks * block_size)
        out["load_s"].append(timing.load(0.0, per_level).end if blocks else 0.0)
        tokens = blocks * block_size
        out["recompute_s"].append(cost.duration([(tokens + new_tokens, 0)]) - cost.duration([(new_tokens, tokens)]))
    return out
