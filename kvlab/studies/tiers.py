"""Issue 12's tiered-storage study (notebooks/04_tiered_storage.ipynb loads its results and plots them).

One named node sizes every tier (:class:`Node`: an 80 GB H100 serving Llama-3-8B in bf16, its KV pool as vLLM
sizes it, host DRAM and NVMe tiers in GiB of KV). On each workload (Mooncake FAST'25 conversation; a synthetic
RAG-heavy chat, :func:`synthetic_workload`) the study replays, all with LRU on every tier and vLLM counting:

* ``scenarios``: device only, + DRAM, + DRAM + SSD on one node; the same on a cluster of ``nodes`` nodes under
  each router, plus a pool shared by all nodes below their SSDs (:mod:`kvlab.replay.cluster`);
* ``write_policy``: one node with DRAM + SSD, both tiers ``write_through`` or both ``write_back``;
* ``dram_sweep``: one node, device + DRAM of each size, each write policy (the DRAM size that reaches
  ``target`` × the ideal hit rate);
* ``ssd_sweep``: one node, device + DRAM of the node's size + SSD of each size.

Results (kvlab.results layout, one run folder per workload under OUT, reused while its identity matches):
tables ``runs`` (one row per replay), ``tiers`` (one row per replay and tier), ``nodes`` (per node of the
scenario replays), ``targets`` (the DRAM size per write policy) and ``requests`` (per request of the scenario
replays); ``summary.json`` holds the node, the workload's footprint and the targets. Units: capacities in GiB
(2**30 bytes) of KV, bytes in bytes, hit rates and shares as fractions of all prompt tokens.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from kvlab.errors import ConfigError
from kvlab.replay import ReplayConfig, encode
from kvlab.replay.cluster import ClusterResult, replay_cluster
from kvlab.results import build_manifest, is_complete, read_results, run_id, run_identity, safe_name, write_results
from kvlab.tiers.spec import Tier
from kvlab.units import GIB, TIB
from kvlab.workload.workload import Workload

#: bumped when the study's numbers change for the same config (stale result folders are recomputed)
STUDY_VERSION = 3
SECTIONS = ("scenarios", "write_policy", "dram_sweep", "ssd_sweep")
LEVELS = ("device", "dram", "ssd", "pool")


@dataclass(frozen=True)
class Node:
    """The node the tiers are sized from: ``hardware`` serving ``model`` (bf16 KV), the device's KV pool as vLLM
    sizes it (:func:`kvlab.profiles.kv_pool_blocks` at ``gpu_memory_utilization``), a host DRAM tier of
    ``dram_gib`` and an NVMe SSD tier of ``ssd_gib`` (GiB of KV), blocks of ``block_size`` tokens."""

    model: str = "llama-3-8b"
    hardware: str = "h100"
    gpu_memory_utilization: float = 0.9
    block_size: int = 512
    dram_gib: float = 1024.0
    ssd_gib: float = 8192.0

    def kv_bytes_per_block(self) -> int:
        """KV bytes of one block (bytes)."""
        from kvlab.profiles import load_model

        return int(load_model(self.model).kv_bytes_per_token) * self.block_size

    def device_blocks(self) -> int:
        """KV blocks of the device (blocks of ``block_size`` tokens)."""
        from kvlab.profiles import kv_pool_blocks, load_hardware, load_model

        return kv_pool_blocks(load_model(self.model), load_hardware(self.hardware), self.block_size,
                              gpu_memory_utilization=self.gpu_memory_utilization)

    def describe(self) -> dict:
        """The node in numbers: device blocks and GiB, KV bytes per token and block, tier sizes."""
        per_block = self.kv_bytes_per_block()
        blocks = self.device_blocks()
        return {**asdict(self), "device_blocks": blocks, "device_gib": blocks * per_block / GIB,
                "kv_bytes_per_token": per_block // self.block_size, "kv_bytes_per_block": per_block,
                "dram_blocks": int(self.dram_gib * GIB // per_block),
                "ssd_blocks": int(self.ssd_gib * GIB // per_block)}


@dataclass(frozen=True)
class StudyConfig:
    """What the study runs (capacities in GiB of KV). ``tier_write``: the private tiers' write policy in the
    scenarios and the SSD sweep; ``pool_write``: the pool's (``write_through``: every block a node computes is
    published to the pool; a ``write_back`` pool below the SSDs would only get what an SSD evicts)."""

    node: Node = field(default_factory=Node)
    nodes: int = 8
    routers: tuple[str, ...] = ("prefix", "round_robin")
    pool_gib: float = 16384.0
    pool_write: str = "write_through"
    tier_write: str = "write_back"
    writes: tuple[str, ...] = ("write_through", "write_back")
    dram_sweep_gib: tuple[float, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    ssd_sweep_gib: tuple[float, ...] = (128, 512, 1024, 2048, 4096, 8192, 16384)
    policy: str = "lru"
    target: float = 0.95
    limit: int | None = None  # requests per workload (None: all)
    synthetic_requests: int = 10_000

    @classmethod
    def quick(cls) -> StudyConfig:
        """The test suite's: 1,500 requests per workload, 4 nodes, three DRAM and two SSD sizes."""
        return cls(nodes=4, dram_sweep_gib=(64, 256, 1024), ssd_sweep_gib=(256, 1024), limit=1_500,
                   synthetic_requests=1_500)

    def to_dict(self) -> dict:
        return {"study_version": STUDY_VERSION, **asdict(self)}


@dataclass(frozen=True)
class Case:
    """One replay of the study: ``nodes`` nodes under ``router``, each with DRAM / SSD tiers of the given GiB
    (None: absent) written with ``write``, above a shared pool of ``pool_gib`` (None: none)."""

    section: str
    scenario: str
    nodes: int = 1
    router: str = "prefix"
    dram_gib: float | None = None
    ssd_gib: float | None = None
    pool_gib: float | None = None
    write: str = "write_back"
    pool_write: str = "write_through"

    def key(self) -> tuple:
        """What decides the numbers (equal keys: one replay serves both rows)."""
        private = self.dram_gib is not None or self.ssd_gib is not None
        return (self.nodes, self.router if self.nodes > 1 else "-", self.dram_gib, self.ssd_gib, self.pool_gib,
                self.write if private else "-", self.pool_write if self.pool_gib else "-")

    def tiers(self) -> tuple[list[Tier], Tier | None]:
        private = [Tier(name=name, capacity_gib=gib, write=self.write)
                   for name, gib in (("dram", self.dram_gib), ("ssd", self.ssd_gib)) if gib is not None]
        pool = Tier(name="pool", capacity_gib=self.pool_gib, write=self.pool_write) if self.pool_gib else None
        return private, pool


def cases(config: StudyConfig) -> list[Case]:
    """Every replay of the study, in section order (see the module docstring)."""
    node, w = config.node, config.tier_write
    out: list[Case] = [Case("scenarios", "device", write=w),
                       Case("scenarios", "+DRAM", dram_gib=node.dram_gib, write=w),
                       Case("scenarios", "+DRAM+SSD", dram_gib=node.dram_gib, ssd_gib=node.ssd_gib, write=w)]
    for router in config.routers:
        common = {"nodes": config.nodes, "router": router, "write": w, "pool_write": config.pool_write}
        out += [Case("scenarios", "device", **common),
                Case("scenarios", "+DRAM", dram_gib=node.dram_gib, **common),
                Case("scenarios", "+DRAM+SSD", dram_gib=node.dram_gib, ssd_gib=node.ssd_gib, **common),
                Case("scenarios", "+DRAM+SSD+pool", dram_gib=node.dram_gib, ssd_gib=node.ssd_gib,
                     pool_gib=config.pool_gib, **common)]
    out += [Case("write_policy", "+DRAM+SSD", dram_gib=node.dram_gib, ssd_gib=node.ssd_gib, write=x)
            for x in config.writes]
    out += [Case("dram_sweep", "+DRAM", dram_gib=float(g), write=x)
            for x in config.writes for g in config.dram_sweep_gib]
    out += [Case("ssd_sweep", "+DRAM+SSD", dram_gib=node.dram_gib, ssd_gib=float(g), write=w)
            for g in config.ssd_sweep_gib]
    return out


def synthetic_workload(n_requests: int = 10_000, seed: int = 0) -> Workload:
    """The study's synthetic workload: :func:`kvlab.workload.synthetic_chat` with many long shared documents
    (1,000 documents of 4k-12k tokens, Zipf 0.9, 70 % of sessions RAG): ~1.3 TiB of distinct Llama-3-8B KV
    at 10,000 requests, so a TB-scale DRAM tier is close to binding."""
    from kvlab.workload.generate import synthetic_chat

    return synthetic_chat(n_requests, seed=seed, n_docs=1000, doc_tokens=(4000, 12000), rag_fraction=0.7,
                          doc_zipf=0.9)


def study_workloads(config: StudyConfig) -> list[Workload]:
    """Mooncake conversation (first ``limit`` requests) and the synthetic workload."""
    from kvlab.workload import load_trace

    mooncake = load_trace("mooncake_conversation")
    if config.limit is not None:
        mooncake = mooncake.head(config.limit)
    return [mooncake, synthetic_workload(config.synthetic_requests)]


@dataclass
class StudyResult:
    """The study's tables, every workload's rows together (see the module docstring), and each summary."""

    runs: pd.DataFrame
    tiers: pd.DataFrame
    nodes: pd.DataFrame
    targets: pd.DataFrame
    requests: pd.DataFrame
    summaries: dict[str, dict]


def run_study(out: str | Path, config: StudyConfig | None = None, *, workloads: list[Workload] | None = None,
              resume: bool = True, progress: bool = False) -> StudyResult:
    """Run (or, with ``resume``, read back) the study into ``out/<workload>/`` for each workload."""
    config = config or StudyConfig()
    out = Path(out)
    parts: dict[str, list[pd.DataFrame]] = {k: [] for k in ("runs", "tiers", "nodes", "targets", "requests")}
    summaries = {}
    for workload in workloads if workloads is not None else study_workloads(config):
        folder = out / safe_name(workload.name)
        identity = run_identity(config.to_dict(), workload.identity())
        if not (resume and is_complete(folder, identity)):
            tables, summary = study_workload(workload, config, progress=progress)
            manifest = build_manifest(config.to_dict(), trace=workload.identity(), driver="tiers-study",
                                      identity=identity)
            write_results(folder, tables, summary, manifest)
        saved = read_results(folder)
        for name in parts:
            parts[name].append(saved.tables[name])
        summaries[workload.name] = saved.summary
    return StudyResult(**{k: pd.concat(v, ignore_index=True) for k, v in parts.items()}, summaries=summaries)


def study_workload(workload: Workload, config: StudyConfig, *, progress: bool = False) -> tuple[dict, dict]:
    """Every case on one workload: the tables and the summary :func:`run_study` writes."""
    t0 = time.perf_counter()
    node = config.node.describe()
    base = ReplayConfig(capacity_blocks=node["device_blocks"], block_size=config.node.block_size,
                        policy=config.policy, model=config.node.model, backend="python")
    if workload.kind == "blocks" and workload.block_size != config.node.block_size:
        raise ConfigError(f"{workload.name}: a {workload.block_size}-token block trace; the node has "
                          f"{config.node.block_size}-token blocks")
    encoded = encode(workload, base)
    done: dict[tuple, ClusterResult] = {}
    runs, tiers, nodes, requests = [], [], [], []
    for case in tqdm(cases(config), disable=not progress, desc=f"study {workload.name}", unit="run"):
        if case.key() not in done:
            private, pool = case.tiers()
            done[case.key()] = replay_cluster(workload, base.replace(tiers=private), nodes=case.nodes, pool=pool,
                                              router=case.router, encoded=encoded)
        result = done[case.key()]
        labels = {"trace": workload.name, **_labels(case)}
        runs.append({**labels, **_run_row(result, node), "run_id": run_id(run_identity(result.config,
                                                                                        workload.identity()))})
        tiers += [{**labels, **_tier_row(t, case.nodes)} for t in result.summary.get("tiers", [])]
        if case.section == "scenarios":
            nodes += [{**labels, **row} for row in result.summary["per_node"]]
            requests.append(_request_rows(result.requests, labels))
    runs_f, tiers_f = pd.DataFrame(runs), pd.DataFrame(tiers)
    targets = dram_targets(runs_f, config.target)
    footprint = int(encoded.num_keys) * node["kv_bytes_per_block"]
    summary = {
        "trace": workload.name, "requests": len(workload), "prompt_tokens": int(encoded.prompt_tokens.sum()),
        "distinct_blocks": int(encoded.num_keys), "footprint_gib": footprint / GIB,
        "ideal_hit_rate": float(runs_f["ideal_hit_rate"].iloc[0]), "node": node, "config": config.to_dict(),
        "targets": targets.to_dict("records"), "replays": len(done), "seconds": time.perf_counter() - t0,
    }
    targets.insert(0, "trace", workload.name)
    tables = {"requests": pd.concat(requests, ignore_index=True), "runs": runs_f, "tiers": tiers_f,
              "nodes": pd.DataFrame(nodes), "targets": targets}
    return tables, summary


def _labels(case: Case) -> dict:
    return {"section": case.section, "scenario": case.scenario, "nodes": case.nodes,
            "router": case.router if case.nodes > 1 else "single node", "dram_gib": case.dram_gib,
            "ssd_gib": case.ssd_gib, "pool_gib": case.pool_gib, "write": case.write,
            "pool_write": case.pool_write if case.pool_gib else None}


def _run_row(result: ClusterResult, node: dict) -> dict:
    s = result.summary
    shares = {f"share_{level}": 0.0 for level in LEVELS}
    shares["share_device"] = s.get("device_token_hit_rate", s["token_hit_rate"])
    for t in s.get("tiers", []):
        shares[f"share_{t['name']}"] = t["hit_share"]
    return {"device_blocks": node["device_blocks"], "device_gib": node["device_gib"], "requests": s["requests"],
            "prompt_tokens": s["prompt_tokens"], "token_hit_rate": s["token_hit_rate"],
            "device_token_hit_rate": shares["share_device"], **shares, "ideal_hit_rate": s["ideal_hit_rate"],
            "node_ideal_hit_rate": s["node_ideal_hit_rate"],
            "share_of_ideal": s["token_hit_rate"] / s["ideal_hit_rate"] if s["ideal_hit_rate"] else None,
            "device_evictions": s["evictions"], "replay_seconds": s["replay_seconds"]}


def _tier_row(t: dict, nodes: int) -> dict:
    """One tier of one replay; a private tier's counts are summed over the ``nodes`` nodes, its ``capacity_gib``
    is per node, ``total_gib`` over all of them, ``fill`` = resident / total at the end."""
    keep = ("hit_share", "local_hit_rate", "blocks_stored", "stores_skipped", "stores_never_read",
            "stores_never_loaded", "evictions", "resident_blocks", "ever_full", "bytes_written", "bytes_read",
            "write_amplification", "shared", "capacity_blocks", "capacity_bytes")
    row = {"tier": t["name"], **{k: t[k] for k in keep}}
    row["capacity_gib"] = t["capacity_bytes"] / GIB
    copies = 1 if t["shared"] else nodes
    row["total_gib"] = row["capacity_gib"] * copies
    row["resident_gib"] = t["resident_blocks"] * t["capacity_bytes"] / t["capacity_blocks"] / GIB
    row["fill"] = t["resident_blocks"] / (t["capacity_blocks"] * copies)
    row["never_loaded_share"] = t["stores_never_loaded"] / t["blocks_stored"] if t["blocks_stored"] else None
    return row


def _request_rows(frame: pd.DataFrame, labels: dict) -> pd.DataFrame:
    cols = ["request_id", "node", "prompt_tokens", "hit_tokens", "ideal_hit_tokens"]
    out = frame[cols].copy()
    for level in LEVELS:
        col = f"hit_tokens_{level}"
        out[col] = frame[col] if col in frame else (frame["hit_tokens"] if level == "device" else 0)
    for k in ("scenario", "nodes", "router", "trace"):
        out.insert(0, k, labels[k])
    return out


def capacity_at(capacity: np.ndarray, rate: np.ndarray, goal: float) -> float | None:
    """The capacity (GiB, log-linear interpolation between sweep points) where ``rate`` first reaches
    ``goal``; None if no point does. ``capacity`` ascending."""
    for i, (c, r) in enumerate(zip(capacity, rate, strict=True)):
        if r >= goal:
            if i == 0:
                return float(c)
            c0, r0 = capacity[i - 1], rate[i - 1]
            f = (goal - r0) / (r - r0)
            return float(np.exp(np.log(c0) + f * (np.log(c) - np.log(c0))))
    return None


def dram_targets(runs: pd.DataFrame, target: float) -> pd.DataFrame:
    """Per write policy: the DRAM size (GiB) where the DRAM sweep reaches ``target`` × the ideal hit rate
    (``dram_gib_at_target`` NaN if no swept size does), and the hit rate at the largest size swept."""
    rows = []
    sweep = runs[runs["section"] == "dram_sweep"]
    for write, part in sweep.groupby("write", sort=False):
        part = part.sort_values("dram_gib")
        ideal = float(part["ideal_hit_rate"].iloc[0])
        at = capacity_at(part["dram_gib"].to_numpy(), part["token_hit_rate"].to_numpy(), target * ideal)
        rows.append({"write": write, "target": target, "ideal_hit_rate": ideal, "target_hit_rate": target * ideal,
                     "dram_gib_at_target": np.nan if at is None else at,
                     "largest_dram_gib": float(part["dram_gib"].iloc[-1]),
                     "hit_rate_at_largest": float(part["token_hit_rate"].iloc[-1])})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- the study table (markdown)
def _fmt(v: object, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "–"
    if isinstance(v, bool | np.bool_):
        return "yes" if v else "no"
    if isinstance(v, float | np.floating):
        return f"{v:,.{digits}f}"
    return str(v)


def markdown_table(frame: pd.DataFrame, digits: int = 3) -> str:
    """``frame`` as a GitHub markdown table (floats with ``digits`` decimals, NaN/None as –)."""
    head = "| " + " | ".join(map(str, frame.columns)) + " |"
    rule = "|" + "|".join("---:" if pd.api.types.is_numeric_dtype(frame[c]) else "---" for c in frame) + "|"
    rows = ["| " + " | ".join(_fmt(v, digits) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([head, rule, *rows])


def study_tables(result: StudyResult) -> dict[str, pd.DataFrame]:
    """The study's headline tables: ``scenarios`` (token hit rate and per-tier shares), ``write_policy``
    (per tier: TiB written and read, write amplification, share of stores never loaded) and ``dram_target``
    (the DRAM size per write policy for the target share of the ideal hit rate)."""
    runs = result.runs
    sc = runs[runs["section"] == "scenarios"]
    scenarios = pd.DataFrame({
        "trace": sc["trace"], "nodes": sc["nodes"], "router": sc["router"], "tiers": sc["scenario"],
        "token hit rate": sc["token_hit_rate"], "device": sc["share_device"], "DRAM": sc["share_dram"],
        "SSD": sc["share_ssd"], "pool": sc["share_pool"], "of ideal": sc["share_of_ideal"],
        "private ideal": sc["node_ideal_hit_rate"]})
    tiers = result.tiers
    wp = tiers[tiers["section"] == "write_policy"].merge(
        runs[runs["section"] == "write_policy"][["trace", "write", "token_hit_rate"]], on=["trace", "write"])
    write = pd.DataFrame({
        "trace": wp["trace"], "write": wp["write"], "token hit rate": wp["token_hit_rate"], "tier": wp["tier"],
        "hit share": wp["hit_share"], "written TiB": wp["bytes_written"] / TIB,
        "read TiB": wp["bytes_read"] / TIB, "write amp.": wp["write_amplification"],
        "never loaded": wp["never_loaded_share"], "evicted unread": wp["stores_never_read"] / wp["blocks_stored"],
        "ever full": wp["ever_full"]})
    tg = result.targets
    target = pd.DataFrame({
        "trace": tg["trace"], "write": tg["write"], "ideal": tg["ideal_hit_rate"],
        "target": tg["target_hit_rate"], "DRAM GiB at target": tg["dram_gib_at_target"],
        "hit rate at largest DRAM": tg["hit_rate_at_largest"], "largest DRAM GiB": tg["largest_dram_gib"]})
    return {"scenarios": scenarios, "write_policy": write, "dram_target": target}


def study_markdown(result: StudyResult) -> str:
    """The study table for the issue: the three :func:`study_tables` in markdown, each under a heading."""
    titles = {"scenarios": "Token hit rate and per-tier hit shares (fractions of prompt tokens)",
              "write_policy": "Write policies, one node with DRAM + SSD",
              "dram_target": "DRAM for the target share of the ideal hit rate (device + DRAM, one node)"}
    parts = []
    for name, frame in study_tables(result).items():
        parts += [f"**{titles[name]}**", "", markdown_table(frame.reset_index(drop=True)), ""]
    return "\n".join(parts)
