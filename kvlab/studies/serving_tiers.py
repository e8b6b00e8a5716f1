"""Issue 14's study: what tiers do to TTFT in the serving simulator (notebooks/04_tiered_storage.ipynb, part 2).

The node is part 1's (:class:`kvlab.studies.tiers.Node`: Llama-3-8B in bf16 on the H100 profile, its KV pool as
vLLM sizes it, a host DRAM tier of ``dram_gib`` and an NVMe SSD tier of ``ssd_gib``, 512-token blocks), the
workloads too (the whole Mooncake FAST'25 conversation trace; the synthetic RAG-heavy chat generated with 4,000
requests instead of part 1's 10,000, so that the study takes minutes: it hashes every prompt token of every
simulation). The tiers are timed
(kvlab.tiers.timing, docs/tiers.md "Timing in the simulator"): DRAM behind a PCIe 5 ×16 link, the SSD an NVMe
Gen4 drive staged through host memory behind the same link; both ``write_back`` as in part 1's scenarios.

**Load.** The simulator serves each workload once with every arrival at 0, device only: its *saturation
throughput* is ``requests / makespan_s`` (requests/s). Every case then runs at ``load`` × that rate
(``SimConfig.rate``: the trace's arrivals rescaled to that mean rate, their pattern kept) — not at the trace's
own rate, which one node cannot serve.

**Cases** (:func:`cases`), at each load, all with the same device pool (``capacity_blocks`` from the node):
device only; + DRAM; + DRAM + SSD; each tiered one with ``load_or_recompute``; + DRAM + SSD with layer overlap
(``tier_overlap``) and with each prefetch policy (``tier_prefetch``).

**Break-even** (:func:`break_even`): load against recompute of a prefix per tier path (link, medium) and KV
layout, from :func:`kvlab.tiers.timing.load_vs_recompute` on idle links (16-token blocks, as vLLM).

Results (kvlab.results layout, one run folder under ``out``, reused while its identity matches): tables
``requests`` (per request of the three baseline cases at each load: TTFT and its split), ``runs`` (one row per
simulation: TTFT mean / p50 / p90 and its split into queueing, load and compute means,
hit rates, bytes loaded), ``traffic`` (one row per simulation and tier, link or medium: bytes written / read
per tier, bytes moved per link and medium), ``break_even`` (one row per path, layout and prefix length) and
``saturation`` (one row per workload). Units: seconds, bytes, requests/s, hit rates as fractions of prompt
tokens. Every link and medium preset is uncalibrated (docs/tiers.md), as are the hardware profile's factors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.results import build_manifest, is_complete, read_results, run_identity, write_results
from kvlab.studies.tiers import Node, markdown_table, study_workloads
from kvlab.tiers.spec import Tier
from kvlab.workload.workload import Workload

#: bumped when the study's numbers change for the same config (stale result folders are recomputed)
SERVING_STUDY_VERSION = 1
TIER_SETS = ("device", "+DRAM", "+DRAM+SSD")
PREFETCH = ("best_effort", "wait_complete", "timeout")
#: break-even paths: (label, link preset, medium preset or None); a tier one level below the device
BREAK_EVEN_PATHS = (("DRAM, PCIe 5", "pcie5_x16", None), ("DRAM, PCIe 4", "pcie4_x16", None),
                    ("NVMe Gen4 via DRAM, PCIe 5", "pcie5_x16", "nvme_gen4"),
                    ("NVMe Gen5 via DRAM, PCIe 5", "pcie5_x16", "nvme_gen5"),
                    ("RDMA 400 Gb/s", "rdma_400g", None), ("Mooncake 4 x 200 Gb/s", "mooncake_4x200g", None))


@dataclass(frozen=True)
class ServingStudyConfig:
    """What the study runs. ``node``: part 1's node (model, hardware, block size, tier sizes in GiB);
    ``loads``: fractions of the measured saturation throughput; ``dram_link``, ``ssd_medium``, ``ssd_link``:
    timing presets (or preset files); ``limit`` / ``synthetic_requests``: requests per workload (None: the
    whole Mooncake trace); ``break_even_paths``: (label, link, medium) per curve, ``break_even_tokens``: the
    longest prefix of the break-even curves (tokens, in blocks of ``break_even_block_size``)."""

    node: Node = field(default_factory=Node)
    loads: tuple[float, ...] = (0.5, 0.8)
    tier_write: str = "write_back"
    dram_link: str = "pcie5_x16"
    ssd_medium: str = "nvme_gen4"
    ssd_link: str = "pcie5_x16"
    prefetch_timeout_s: float = 1.0
    kv_layout: str = "layer"
    policy: str = "lru"
    limit: int | None = None
    synthetic_requests: int = 4_000
    break_even_paths: tuple[tuple[str, str, str | None], ...] = BREAK_EVEN_PATHS
    break_even_layouts: tuple[str, ...] = ("layer", "block")
    break_even_block_size: int = 16
    break_even_tokens: int = 32_768

    @classmethod
    def quick(cls) -> ServingStudyConfig:
        """The test suite's: the first 400 requests of each workload, a coarser break-even grid."""
        return cls(limit=400, synthetic_requests=400, break_even_tokens=8_192)

    def to_dict(self) -> dict:
        return {"serving_study_version": SERVING_STUDY_VERSION, **asdict(self)}

    def tiers(self, which: str) -> list[Tier]:
        """The lower tiers of a tier set (``device``, ``+DRAM``, ``+DRAM+SSD``), sized by the node."""
        dram = Tier(name="dram", capacity_gib=self.node.dram_gib, write=self.tier_write, link=self.dram_link)
        ssd = Tier(name="ssd", capacity_gib=self.node.ssd_gib, write=self.tier_write, medium=self.ssd_medium,
                   link=self.ssd_link)
        return {"device": [], "+DRAM": [dram], "+DRAM+SSD": [dram, ssd]}[which]


@dataclass(frozen=True)
class Case:
    """One simulation at a load: a tier set and the SimConfig tier options (``variant`` labels them)."""

    tiers: str
    variant: str = "baseline"
    load_or_recompute: bool = False
    tier_overlap: bool = False
    tier_prefetch: str = "off"

    @property
    def label(self) -> str:
        return self.tiers if self.variant == "baseline" else f"{self.tiers}, {self.variant}"


def cases() -> list[Case]:
    """Every simulation of one load (module docstring), in table order."""
    out = [Case(t) for t in TIER_SETS]
    out += [Case(t, "load-or-recompute", load_or_recompute=True) for t in TIER_SETS[1:]]
    out.append(Case("+DRAM+SSD", "overlap", tier_overlap=True))
    out += [Case("+DRAM+SSD", f"prefetch {p}", tier_prefetch=p) for p in PREFETCH]
    return out


def _base(config: ServingStudyConfig) -> dict:
    """The SimConfig fields every simulation shares: the node's model, hardware, blocks and device pool."""
    node = config.node
    return {"model": node.model, "hardware": node.hardware, "block_size": node.block_size, "policy": config.policy,
            "capacity_blocks": node.device_blocks(), "gpu_memory_utilization": node.gpu_memory_utilization}


def saturation(workload: Workload, config: ServingStudyConfig) -> dict:
    """The workload served device only with every arrival at 0: ``requests / makespan_s`` (requests/s)."""
    from kvlab.sim import simulate

    burst = dataclasses.replace(workload, arrival=np.zeros(len(workload)))
    s = simulate(burst, **_base(config)).summary
    return {"trace": workload.name, "requests": s["requests"], "makespan_s": s["makespan_s"],
            "saturation_rps": s["requests"] / s["makespan_s"], "trace_rps": _trace_rate(workload)}


def _trace_rate(workload: Workload) -> float:
    """The trace's own mean arrival rate (requests/s over its arrival span)."""
    span = float(np.max(workload.arrival) - np.min(workload.arrival)) if len(workload) > 1 else 0.0
    return len(workload) / span if span > 0 else float("nan")


def serve_workload(workload: Workload, config: ServingStudyConfig) -> tuple[dict, list[dict], list[dict],
                                                                            list[pd.DataFrame], float]:
    """Every case at every load on one workload: its saturation row, the ``runs`` and ``traffic`` rows, the
    per-request frames of the baseline cases and the seconds the simulations took."""
    from kvlab.sim import simulate

    t0 = time.perf_counter()
    sat = saturation(workload, config)
    runs, traffic, requests = [], [], []
    for load in config.loads:
        rate = load * sat["saturation_rps"]
        for case in cases():
            result = simulate(workload, **_base(config), rate=rate, tiers=config.tiers(case.tiers),
                              load_or_recompute=case.load_or_recompute, tier_overlap=case.tier_overlap,
                              tier_prefetch=case.tier_prefetch, kv_layout=config.kv_layout,
                              **({"prefetch_timeout_s": config.prefetch_timeout_s}
                                 if case.tier_prefetch == "timeout" else {}))  # SimConfig refuses it otherwise
            labels = {"trace": workload.name, "load": load, "rate_rps": rate, "configuration": case.label,
                      **asdict(case)}
            runs.append({**labels, **_run_row(result)})
            traffic += [{**labels, **row} for row in _traffic_rows(result)]
            if case.variant == "baseline":
                requests.append(_request_rows(result.requests, labels))
    return sat, runs, traffic, requests, time.perf_counter() - t0


def _request_rows(frame: pd.DataFrame, labels: dict) -> pd.DataFrame:
    """Per request of one simulation: prompt and hit tokens, TTFT and its split (NaN: never served)."""
    out = frame[["request_id", "prompt_tokens", "hit_tokens", "ttft_s", "queue_s"]].copy()
    for col in ("ttft_load_s", "ttft_compute_s"):
        out[col] = frame[col] if col in frame else (0.0 if col == "ttft_load_s" else frame["ttft_s"] - frame["queue_s"])
    for k in ("configuration", "load", "trace"):
        out.insert(0, k, labels[k])
    return out


def _run_row(result) -> dict:  # noqa: ANN001 - a kvlab.sim.SimResult
    s, req = result.summary, result.requests
    done = req[np.isfinite(req["ttft_s"].to_numpy(dtype=float))]
    tiered = "ttft_load_s" in done
    shares = {f"share_{t['name']}": t["hit_share"] for t in s.get("tiers", [])}
    decisions = done["load_decision"].value_counts() if tiered else pd.Series(dtype=int)
    return {
        "requests": s["requests"], "served": len(done),
        "ttft_mean_s": float(done["ttft_s"].mean()), "ttft_p50_s": float(done["ttft_s"].quantile(0.5)),
        "ttft_p90_s": float(done["ttft_s"].quantile(0.9)), "queue_mean_s": float(done["queue_s"].mean()),
        "load_mean_s": float(done["ttft_load_s"].mean()) if tiered else 0.0,
        "compute_mean_s": float(done["ttft_compute_s"].mean()) if tiered else float(
            (done["ttft_s"] - done["queue_s"]).mean()),
        "token_hit_rate": s["token_hit_rate"], "device_token_hit_rate": s.get("device_token_hit_rate",
                                                                               s["token_hit_rate"]),
        "share_dram": shares.get("share_dram", 0.0), "share_ssd": shares.get("share_ssd", 0.0),
        "loaded_bytes": float(s.get("loaded_bytes", 0.0)), "tier_stall_s": float(s.get("tier_stall_s", 0.0)),
        "recomputed_requests": int(decisions.get("recompute", 0) + decisions.get("partial", 0)),
        "makespan_s": s["makespan_s"],
    }


def _traffic_rows(result) -> list[dict]:  # noqa: ANN001 - a kvlab.sim.SimResult
    """Bytes per tier (written into it, read back to the device) and per link and medium (moved, both ways)."""
    rows = []
    for t in result.summary.get("tiers", []):
        rows += [{"kind": "tier", "name": t["name"], "direction": "written", "bytes": float(t["bytes_written"])},
                 {"kind": "tier", "name": t["name"], "direction": "read", "bytes": float(t["bytes_read"])}]
    ts = result.timeseries
    for col in ts.columns:
        for kind in ("link", "medium"):
            if col.startswith(f"{kind}_bytes_"):
                rows.append({"kind": kind, "name": col.removeprefix(f"{kind}_bytes_"), "direction": "moved",
                             "bytes": float(ts[col].sum())})
    return rows


def break_even(config: ServingStudyConfig) -> pd.DataFrame:
    """Load against recompute per path and layout (:data:`BREAK_EVEN_PATHS`), every whole number of blocks up to
    ``break_even_tokens``: columns ``path``, ``link``, ``medium``, ``kv_layout``,
    ``prefix_tokens``, ``load_s``, ``recompute_s``, ``calibrated`` (both presets measured)."""
    from kvlab.profiles import load_hardware, load_model
    from kvlab.sim.cost import CostModel
    from kvlab.tiers.timing import load_vs_recompute, preset

    node, bs = config.node, config.break_even_block_size
    cost = CostModel(load_model(node.model), load_hardware(node.hardware))
    grid = np.arange(bs, config.break_even_tokens + 1, bs)
    rows = []
    for label, link, medium in config.break_even_paths:
        tier = Tier(name="tier", capacity_blocks=1, link=link, medium=medium)
        calibrated = preset(link).calibrated and (medium is None or preset(medium).calibrated)
        for layout in config.break_even_layouts:
            r = load_vs_recompute(cost, [tier], 1, grid.tolist(), block_size=bs, kv_layout=layout)
            rows += [{"path": label, "link": link, "medium": medium, "kv_layout": layout, "prefix_tokens": p,
                      "load_s": ls, "recompute_s": rs, "calibrated": calibrated}
                     for p, ls, rs in zip(r["prefix_tokens"], r["load_s"], r["recompute_s"], strict=True)]
    return pd.DataFrame(rows)


def break_even_points(frame: pd.DataFrame) -> pd.DataFrame:
    """Per path and layout: the shortest prefix (tokens, whole blocks) where loading is faster than recomputing
    (None if none up to the longest is), and load / recompute seconds at the longest prefix."""
    rows = []
    for (path, layout), g in frame.groupby(["path", "kv_layout"], sort=False):
        faster = g[g["load_s"] < g["recompute_s"]]
        last = g.iloc[-1]
        rows.append({"path": path, "kv_layout": layout,
                     "break_even_tokens": int(faster["prefix_tokens"].iloc[0]) if len(faster) else None,
                     "prefix_tokens": int(last["prefix_tokens"]), "load_s": float(last["load_s"]),
                     "recompute_s": float(last["recompute_s"])})
    out = pd.DataFrame(rows)
    out["break_even_tokens"] = pd.Series([r["break_even_tokens"] for r in rows], dtype=object)
    return out


@dataclass
class ServingStudyResult:
    """The study's tables (module docstring) and its summary."""

    requests: pd.DataFrame
    runs: pd.DataFrame
    traffic: pd.DataFrame
    break_even: pd.DataFrame
    saturation: pd.DataFrame
    summary: dict


def _identity(config: ServingStudyConfig, workloads: list[Workload]) -> tuple[dict, dict]:
    """The run's identity over every workload (their content hashes together) and the manifest's trace entry."""
    idents = [w.identity() for w in workloads]
    joint = hashlib.sha256("".join(i["content_sha256"] for i in idents).encode()).hexdigest()
    trace = {"content_sha256": joint, "kind": "+".join(i["kind"] for i in idents), "trace_block_size": None,
             "traces": idents}
    return run_identity(config.to_dict(), trace), trace


def run_serving_study(out: str | Path, config: ServingStudyConfig | None = None, *,
                      workloads: list[Workload] | None = None, resume: bool = True,
                      log: bool = False) -> ServingStudyResult:
    """Run (or, with ``resume``, read back) the study into the run folder ``out``; ``log``: one line per
    workload."""
    config = config or ServingStudyConfig()
    workloads = workloads if workloads is not None else study_workloads(config)  # type: ignore[arg-type]
    identity, trace = _identity(config, workloads)
    out = Path(out)
    if not (resume and is_complete(out, identity)):
        sats, runs, traffic, requests, seconds = [], [], [], [], {}
        for w in workloads:
            sat, r, t, q, seconds[w.name] = serve_workload(w, config)
            sats.append(sat)
            runs += r
            traffic += t
            requests += q
            if log:
                print(f"{w.name}: {len(w):,} requests, saturation {sat['saturation_rps']:.3f} requests/s "
                      f"(trace's own rate {sat['trace_rps']:.3f}); {len(r)} simulations in {seconds[w.name]:.1f} s",
                      flush=True)
        tables = {"requests": pd.concat(requests, ignore_index=True), "runs": pd.DataFrame(runs),
                  "traffic": pd.DataFrame(traffic), "break_even": break_even(config),
                  "saturation": pd.DataFrame(sats)}
        summary = {"node": config.node.describe(), "config": config.to_dict(), "seconds": seconds,
                   "calibrated": False,
                   "note": "link and medium presets and the hardware profile's factors are uncalibrated"}
        write_results(out, tables, summary, build_manifest(config.to_dict(), trace=trace, driver="tiers-serving-study",
                                                           identity=identity))
    saved = read_results(out)
    return ServingStudyResult(**{k: saved.tables[k] for k in ("requests", "runs", "traffic", "break_even",
                                                              "saturation")},
                              summary=saved.summary)


def ttft_table(result: ServingStudyResult) -> pd.DataFrame:
    """The TTFT table: per workload, load and configuration, mean / p90 TTFT, the mean split (queueing, load,
    compute; seconds) and the hit rates (fractions of prompt tokens)."""
    r = result.runs
    return pd.DataFrame({
        "trace": r["trace"], "load": r["load"], "configuration": r["configuration"],
        "TTFT mean s": r["ttft_mean_s"], "TTFT p90 s": r["ttft_p90_s"], "queue s": r["queue_mean_s"],
        "load s": r["load_mean_s"], "compute s": r["compute_mean_s"], "hit rate": r["token_hit_rate"],
        "DRAM share": r["share_dram"], "SSD share": r["share_ssd"], "loaded GB": r["loaded_bytes"] / 1e9})


def serving_markdown(result: ServingStudyResult) -> str:
    """The TTFT table in markdown, one per workload, each under its saturation line."""
    table = ttft_table(result)
    parts = []
    for sat in result.saturation.itertuples(index=False):
        parts += [f"**{sat.trace}** ({sat.requests:,} requests; saturation {sat.saturation_rps:.3f} requests/s, "
                  f"the trace's own rate {sat.trace_rps:.3f})", "",
                  markdown_table(table[table["trace"] == sat.trace].drop(columns="trace").reset_index(drop=True)), ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    """``python -m kvlab.studies.serving_tiers [--quick] [--out DIR]``: run the study, print the TTFT tables."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="run folder (default: results/tiers_serving[_quick])")
    ap.add_argument("--quick", action="store_true", help="the test suite's configuration (400 requests each)")
    args = ap.parse_args(argv)
    config = ServingStudyConfig.quick() if args.quick else ServingStudyConfig()
    out = args.out or Path("results/tiers_serving" + ("_quick" if args.quick else ""))
    t0 = time.perf_counter()
    print(f"Mooncake conversation: {'all' if config.limit is None else f'the first {config.limit:,}'} requests; "
          f"synthetic chat: {config.synthetic_requests:,} requests (part 1: 10,000); arrivals rescaled to "
          f"{', '.join(f'{x:g}' for x in config.loads)} of each workload's measured saturation throughput", flush=True)
    result = run_serving_study(out, config, log=True)
    print(serving_markdown(result))
    print(markdown_table(break_even_points(result.break_even)))
    print(f"results in {out} ({time.perf_counter() - t0:.1f} s; presets and hardware factors uncalibrated)")


if __name__ == "__main__":
    main()
