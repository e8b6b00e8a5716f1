"""Measure the engine's real tiers: disk store reads (cold and warm) and writes, DRAM copies; a disk profile.

:func:`measure_disk` times :class:`~kvlab.engine.tiers.store.DiskStore` operations at one or more chunk sizes
(one op = one slot file of ``chunk`` blocks): ``write`` (checksums, write, fsync, rename: the store's code path),
``write_nofsync`` (the same without fsync), ``read_warm`` (page cache hot, checksums verified), ``read_cold``
(the file's pages dropped first with ``posix_fadvise(DONTNEED)``, then the store's read), ``read_direct``
(``O_DIRECT``: the device's read speed, no page cache and no checksum; skipped, and said so, where the file
system refuses O_DIRECT). :func:`measure_dram` times host copies of the same sizes (on a CPU-only machine a DRAM
tier is a memcpy; host-to-device bandwidth needs a GPU: benchmarks/gpu_check.sh).

:func:`disk_profile` fits ``seconds = latency_s + bytes / bandwidth_Bps`` through the medians of one operation
at every measured size (least squares; one size: no latency term) and returns the plain dict the simulator's
tier timing takes. Units: bytes, seconds, bytes/s.
"""

from __future__ import annotations

import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kvlab.engine.kv_pool import KVLayout
from kvlab.engine.tiers.store import DiskStore, checksums

#: Llama-3-8B's KV layout (32 layers, 8 KV heads, head_dim 128, bf16) in 16-token blocks: 2 MiB a block
LLAMA3_8B = KVLayout(32, 8, 128, 16, torch.bfloat16)
OPS = ("write", "write_nofsync", "read_warm", "read_cold", "read_direct")


def _stats(seconds: list[float], nbytes: int) -> dict:
    med = statistics.median(seconds)
    return {"ops": len(seconds), "bytes_per_op": nbytes, "median_s": med, "p90_s": sorted(seconds)[
        int(0.9 * (len(seconds) - 1))], "mean_s": statistics.fmean(seconds), "MBps": nbytes / med / 1e6}


def _direct_read(path: Path, size: int) -> float | None:
    """Seconds of one O_DIRECT read of ``path`` (``size`` bytes, a multiple of 4096); None if refused."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    try:
        t0 = time.perf_counter()
        n = os.preadv(fd, [buf], 0)
        dt = time.perf_counter() - t0
    except OSError:
        return None
    finally:
        os.close(fd)
        buf.close()
    return dt if n == size else None


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_disk(directory: str | os.PathLike | None = None, *, layout: KVLayout = LLAMA3_8B,
                 chunks: Sequence[int] = (1, 16), ops: int = 12) -> dict:
    """Disk store timings at each chunk size (``ops`` files each; module docstring). ``directory``: where the
    files go (a new temporary directory inside it, removed after; default: the system's temp dir)."""
    out: dict = {"directory": str(directory or tempfile.gettempdir()), "block_bytes": layout.bytes_per_block,
                 "layout": layout.to_dict(), "sizes": {}, "cold_method": "posix_fadvise(DONTNEED) then read"}
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="kvlab-bench-tier-io-", dir=directory) as tmp:
        for c in chunks:
            store = DiskStore(Path(tmp), f"b{c}", layout, c)
            data = torch.randn((c, *layout.pool_shape(1)[1:]), generator=gen).to(layout.dtype)
            nbytes = c * layout.bytes_per_block
            t: dict[str, list[float]] = {op: [] for op in OPS}
            for i in range(ops):
                t0 = time.perf_counter()
                store.store(i, data)
                t["write"].append(time.perf_counter() - t0)
            store.fsync = False
            for i in range(ops):
                t0 = time.perf_counter()
                store.store(ops + i, data)
                t["write_nofsync"].append(time.perf_counter() - t0)
            os.sync()
            for i in range(ops):
                store.release(store.load(i))  # warm the page cache (and the store's read buffer)
                t0 = time.perf_counter()
                back = store.load(i)
                t["read_warm"].append(time.perf_counter() - t0)
                store.release(back)
            for i in range(ops):
                _drop(store.path(i))
                t0 = time.perf_counter()
                back = store.load(i)
                t["read_cold"].append(time.perf_counter() - t0)
                if not torch.equal(back.view(torch.uint8), data.view(torch.uint8)):
                    raise RuntimeError(f"slot {i} read back different bytes")
                store.release(back)
            for i in range(ops):
                dt = _direct_read(store.path(i), store.file_bytes)
                if dt is None:
                    break
                t["read_direct"].append(dt)
            raw = memoryview(data.view(torch.uint8).reshape(-1).numpy())
            t0 = time.perf_counter()
            checksums(raw, layout.bytes_per_block)
            sum_s = time.perf_counter() - t0
            out["sizes"][str(c)] = {"chunk_blocks": c, "bytes_per_op": nbytes, "checksum_GBps": nbytes / sum_s / 1e9,
                                    **{op: _stats(v, nbytes) for op, v in t.items() if v}}
            if not t["read_direct"]:
                out["read_direct"] = "O_DIRECT refused by this file system: read_direct not measured"
            store.close()
    return out


def measure_dram(*, layout: KVLayout = LLAMA3_8B, chunks: Sequence[int] = (1, 16), ops: int = 20,
                 device: str | torch.device = "cpu") -> dict:
    """Copy timings of ``chunk`` blocks between a DRAM tier's host memory and the pool's ``device``: on the CPU
    a host memcpy (``copy``); on CUDA, from page-locked host memory as a DramStore holds it, ``h2d`` (a load)
    and ``d2h`` (a store), each synchronised."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    what = "pinned host <-> device copies" if cuda else "host memcpy (torch copy_): a DRAM tier on a CPU engine"
    out: dict = {"what": what, "device": str(device), "sizes": {}}
    for c in chunks:
        shape = (c, *layout.pool_shape(1)[1:])
        host = torch.empty(shape, dtype=layout.dtype, pin_memory=cuda).copy_(torch.randn(shape))
        dev = torch.empty_like(host, device=device)
        pairs = {"h2d": (dev, host), "d2h": (host, dev)} if cuda else {"copy": (dev, host)}
        row: dict = {"chunk_blocks": c}
        for name, (dst, src) in pairs.items():
            dst.copy_(src)
            secs = []
            for _ in range(ops):
                if cuda:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=cuda)
                if cuda:
                    torch.cuda.synchronize(device)
                secs.append(time.perf_counter() - t0)
            row[name] = _stats(secs, c * layout.bytes_per_block)
        out["sizes"][str(c)] = row
    return out


def disk_profile(measured: dict, op: str = "read_cold") -> dict:
    """``{"latency_s", "bandwidth_Bps", "source"}`` of ``op`` (one of :data:`OPS`) from :func:`measure_disk`'s
    result: least squares of median seconds on bytes per op over the measured sizes (module docstring)."""
    pts = [(s["bytes_per_op"], s[op]["median_s"]) for s in measured["sizes"].values() if op in s]
    if not pts:
        raise ValueError(f"no {op} measurements")
    if len(pts) == 1:
        (b, sec), lat = pts[0], 0.0
        bw = b / sec
    else:
        mb, ms = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
        slope = sum((b - mb) * (s - ms) for b, s in pts) / sum((b - mb) ** 2 for b, _ in pts)
        bw = 1.0 / slope if slope > 0 else max(b / s for b, s in pts)
        lat = max(0.0, ms - slope * mb) if slope > 0 else min(s for _, s in pts)
    sizes = ", ".join(f"{b // 1024} KiB" for b, _ in pts)
    return {"latency_s": lat, "bandwidth_Bps": bw,
            "source": f"measured {op} of kvlab's DiskStore in {measured['directory']} ({sizes} per op; "
                      f"bench_tier_io.py)"}


def medium_preset(measured: dict, read: str = "read_cold") -> dict:
    """The fields of a simulator medium preset (kvlab.tiers.timing.Preset, without its name) from
    :func:`measure_disk`'s result: ``read`` op's fitted latency and bandwidth, the write latency and bandwidth of
    ``write`` (the store's path: fsync and rename included), queue depth 1 (kvlab's store does one op at a time)."""
    r, w = disk_profile(measured, read), disk_profile(measured, "write")
    return {"kind": "medium", "bandwidth": r["bandwidth_Bps"], "latency_s": r["latency_s"],
            "write_bandwidth": w["bandwidth_Bps"], "write_latency_s": w["latency_s"], "queue_depth": 1,
            "calibrated": True,
            "description": f"kvlab DiskStore on {measured['directory']} ({read}, write with fsync)",
            "source": r["source"]}


SOURCES = ("miss", "device", "dram", "disk_warm", "disk_cold")


def measure_tier_ttft(model: torch.nn.Module, *, prefix_tokens: Sequence[int] = (256, 1024), tail_tokens: int = 16,
                      block_size: int = 16, repeats: int = 3, directory: str | os.PathLike | None = None,
                      num_threads: int | None = 2) -> list[dict]:
    """Real TTFT (the engine's ``prefill_s``) of a prompt whose first ``P`` tokens (a multiple of
    ``block_size``) are served by each source: ``miss`` (computed), ``device`` (pool hits), ``dram`` / ``disk``
    (loaded from a tier; the device cache is reset after the priming request; ``disk_cold`` drops the tier
    files' pages first). A fresh random prefix per repeat; the tail (``tail_tokens``) is always computed.
    One row per (prefix, source): median, best and every repeat's seconds, hit tokens, verify of the last
    repeat."""
    from kvlab.engine.driver import Engine
    from kvlab.engine.request import Request
    from kvlab.tiers import Tier

    rng = np.random.default_rng(0)
    vocab = int(model.config.vocab_size)
    warm = Engine(model, capacity_blocks=-(-(max(prefix_tokens) + tail_tokens) // block_size), block_size=block_size,
                  num_threads=num_threads)
    for n in (*prefix_tokens, max(prefix_tokens) + tail_tokens):  # first calls of each size are slow
        warm.release(warm.prefill(Request(rng.integers(0, vocab, n))).state)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvlab-tier-ttft-", dir=directory) as tmp:
        for p in prefix_tokens:
            blocks = -(-(p + tail_tokens) // block_size)
            for source in SOURCES:
                tier = {"dram": "dram", "disk_warm": "ssd", "disk_cold": "ssd"}.get(source)
                where = Path(tmp) / f"{source}-{p}" if tier == "ssd" else None
                eng = Engine(model, capacity_blocks=2 * blocks + 2, block_size=block_size, num_threads=num_threads,
                             tiers=[Tier(name=tier, capacity_blocks=4 * blocks)] if tier else None, tier_dir=where)
                secs, hits, passed = [], [], None
                for r in range(repeats + 1):  # the first round warms up (allocator, kernels)
                    prefix = rng.integers(0, vocab, p)
                    prime = eng.prefill(Request(np.concatenate([prefix, rng.integers(0, vocab, tail_tokens)])))
                    eng.release(prime.state)
                    if source != "device":
                        eng.cache.reset()  # the device forgets; a tier keeps its copy
                    if source == "disk_cold":
                        for f in where.glob("*.kvb"):
                            _drop(f)
                    res = eng.prefill(Request(np.concatenate([prefix, rng.integers(0, vocab, tail_tokens)])))
                    if r:
                        secs.append(res.prefill_s)
                        hits.append(res.hit_tokens)
                    if r == repeats:
                        passed = bool(eng.verify(res.state).passed)
                    eng.release(res.state)
                if eng.tier_io is not None:
                    eng.tier_io.close()
                rows.append({"prefix_tokens": p, "source": source, "ttft_median_s": statistics.median(secs),
                             "ttft_min_s": min(secs),
                             "ttft_s": secs, "hit_tokens": hits[-1], "verify_passed": passed,
                             "kv_bytes": p * eng.layout.bytes_per_token})
    return rows
