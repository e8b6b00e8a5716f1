"""The prompt-layout study (issue 15): what a layout costs a prefix cache, per workload family.

For each family (:mod:`kvlab.workload.families`, generated once per config) and each of its layouts
(:func:`kvlab.layout.registry.make_layout`), every request is laid out and rendered once
(:func:`kvlab.layout.apply.layout_workload`) and served by the simulator (:func:`kvlab.sim.simulator.simulate`:
Llama-3-8B on the h100 profile by default, LRU, vLLM counting, requests' known outputs cached) at each cache size.
Per family x layout x cache size: token hit rate, reused tokens, TTFT (mean, p50, p90; seconds of simulated
time), the segment kind holding each request's first miss, and the non-prefix reuse bound
(:func:`kvlab.layout.reuse.nonprefix_bound`). The headline per family is the gap between its best and worst
layout (:func:`gaps`). A family may be a researcher's own requests (``family: messages``, a messages file:
:mod:`kvlab.workload.messages`; ``kvlab layout-study --workload FILE``). Separately, the block-boundary sweep of
seed 004 (:func:`kvlab.layout.reuse.boundary_sweep`; none with ``boundary: null``) and, where a checkpoint is
configured, the likelihood of reference answers under each layout
(:mod:`kvlab.layout.answers`; skipped with its reason otherwise).

Results (kvlab.results layout, reused while the identity matches): ``OUT/<family>/`` with tables ``requests``
(one row per request x layout x cache size), ``runs`` (one row per layout x cache size) and ``first_miss``
(requests per segment kind: ``what="first_miss"``, the kind holding the first recomputed token, block granular;
``what="break"``, the kind holding the first token no earlier request had, :func:`kvlab.layout.reuse.break_tokens`);
``OUT/boundary/`` with ``requests`` (the sweep). ``OUT`` is an owned output folder (:mod:`kvlab.results.owned`:
kvlab's listing marks it; a symbolic link, a file or a folder holding anything but kvlab's results is refused
before any work, :func:`check_out`); no family may be named ``boundary`` or share another's folder
(:data:`kvlab.layout.config.RESERVED_NAMES`). The tokenizer identity
(name, tokenizer and template sha256) is part of every run's identity (its config) and of its manifest's ``trace``:
another tokenizer or template is another run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from kvlab.arguments import require_instance
from kvlab.layout.apply import RenderCache, layout_workload
from kvlab.layout.base import Layout
from kvlab.layout.config import LayoutStudyConfig, family_folder
from kvlab.layout.reuse import boundary_sweep, break_tokens, nonprefix_bound
from kvlab.results import (
    build_manifest,
    check_output_location,
    folder_kind,
    is_complete,
    read_results,
    run_identity,
    write_results,
)
from kvlab.results.owned import check_folder, prepare_folder, read_listing
from kvlab.results.paths import TEMP_RE
from kvlab.workload.segments import SEGMENT_KINDS
from kvlab.workload.tokenizer import TextTokenizer, load_tokenizer

#: bumped when the study's numbers change for the same config (stale result folders are recomputed)
STUDY_VERSION = 3


@dataclass
class LayoutStudyResult:
    """Every family's tables together (module docstring), the boundary sweep, the gaps and the answers section."""

    runs: pd.DataFrame
    requests: pd.DataFrame
    first_miss: pd.DataFrame
    boundary: pd.DataFrame
    gaps: pd.DataFrame
    summaries: dict[str, dict]
    answers: dict
    config: LayoutStudyConfig


def requests_sha256(requests: list) -> str:
    """sha256 of generated requests (messages, arrival, lengths, labels, responses): the family's content."""
    h = hashlib.sha256()
    for r in requests:
        h.update(repr((r.messages, r.arrival, r.output_tokens, r.session, r.turn, r.tenant, r.category,
                       r.response)).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _trace(name: str, sha: str, n: int, tokenizer: TextTokenizer) -> dict:
    return {"name": name, "content_sha256": sha, "kind": "tokens", "trace_block_size": None, "requests": n,
            "tokenizer": tokenizer.identity()}


def run_study(out: str | Path, config: LayoutStudyConfig | None = None, *, resume: bool = True,
              progress: bool = False) -> LayoutStudyResult:
    """Run (or, with ``resume``, read back) the study into ``out`` (module docstring)."""
    require_instance(config, LayoutStudyConfig, "config", optional=True)  # a path: LayoutStudyConfig.load(path)
    config = config or LayoutStudyConfig()
    check_out(out, config)  # a bad location, a bad tokenizer, then a bad family (a messages file's bad line),
    tokenizer = load_tokenizer(config.tokenizer)  # each refused before the folder is created
    generated = {family: config.generate(family) for family in config.families}
    out = prepare_out(out, config)
    parts: dict[str, list[pd.DataFrame]] = {"runs": [], "requests": [], "first_miss": []}
    summaries: dict[str, dict] = {}
    for family, reqs in generated.items():
        trace = _trace(family, requests_sha256(reqs), len(reqs), tokenizer)
        cfg = {"study_version": STUDY_VERSION, **config.family_identity(family), "tokenizer": tokenizer.identity()}
        identity = run_identity(cfg, trace)
        folder = out / family_folder(family)
        if not (resume and is_complete(folder, identity)):
            tables, summary = study_family(family, reqs, config, tokenizer, progress=progress)
            write_results(folder, tables, summary, build_manifest(cfg, trace=trace, seed=config.seed,
                                                                  driver="layout-study", identity=identity))
        saved = read_results(folder)
        for name in parts:
            parts[name].append(saved.tables[name])
        summaries[family] = saved.summary
    boundary = (pd.DataFrame() if config.boundary is None
                else boundary_results(out / "boundary", config, tokenizer, resume=resume))
    runs = pd.concat(parts["runs"], ignore_index=True)
    from kvlab.layout.answers import answers_section

    answers = answers_section(config, generated)
    return LayoutStudyResult(runs=runs, requests=pd.concat(parts["requests"], ignore_index=True),
                             first_miss=pd.concat(parts["first_miss"], ignore_index=True), boundary=boundary,
                             gaps=gaps(runs), summaries=summaries, answers=answers, config=config)


def check_out(out: str | Path, config: LayoutStudyConfig) -> Path:
    """Refuse ``out`` (``--out``) before any work (docs/layout.md, "Owned outputs"); creates nothing, returns it
    absolute. Accepted: absent, empty, a folder kvlab's listing marks as its own
    (:func:`kvlab.results.owned.check_folder`), or, from before listings, a folder holding only kvlab result
    folders; each family's and the boundary sweep's folder must be absent, empty or a kvlab run result
    (:func:`kvlab.results.check_output_location`). Refused with ResultsLocationError: a symbolic link, a file, a
    folder holding anything else (a user's thesis.tex)."""
    out = Path(os.path.abspath(os.fspath(out)))
    if not _results_only(out):
        check_folder(out, flag="--out")
    for folder in [*map(family_folder, config.families), "boundary"]:
        check_output_location(out / folder, "run")
    return out


def prepare_out(out: str | Path, config: LayoutStudyConfig) -> Path:
    """:func:`check_out`, then create ``out`` as an owned output folder (with kvlab's listing); a folder from
    before listings that holds only kvlab results is used as it is."""
    out = check_out(out, config)
    return out if _results_only(out) else prepare_folder(out, flag="--out")


def _results_only(out: Path) -> bool:
    """Whether ``out`` is a folder without kvlab's listing whose entries are all kvlab result folders (a study
    written before listings existed)."""
    if out.is_symlink() or not out.is_dir() or read_listing(out) is not None:
        return False
    entries = [e for e in os.listdir(out) if not (TEMP_RE.match(e) or e.startswith(".kvlab-probe."))]
    return bool(entries) and all((out / e).is_dir() and not (out / e).is_symlink() and folder_kind(out / e)
                                 for e in entries)


def study_family(family: str, reqs: list, config: LayoutStudyConfig, tokenizer: TextTokenizer, *,
                 progress: bool = False) -> tuple[dict[str, pd.DataFrame], dict]:
    """Every layout x cache size of one family: the tables and summary :func:`run_study` writes."""
    from kvlab.sim.simulator import simulate

    t0 = time.perf_counter()
    cache = RenderCache(tokenizer)
    bs = config.block_size
    runs, requests, misses = [], [], []
    layouts = config.layouts(family)
    for layout in tqdm(layouts, disable=not progress, desc=f"layout study {family}", unit="layout"):
        w = layout_workload(reqs, layout, tokenizer, seed=config.seed, clock_start=config.clock_start_s,
                            name=f"{family}:{layout.label}", cache=cache)
        brk = break_tokens(w)  # where each prompt departs from everything before it (token granular)
        brk_seg = w.segments.first_miss(brk)
        for cap in config.cache_blocks:
            sim = simulate(w, model=config.model, hardware=config.hardware, capacity_blocks=cap, block_size=bs,
                           time_scale=config.time_scale, seed=config.seed, policy=config.policy)
            frame = sim.requests
            hit = frame["hit_tokens"].to_numpy()
            bound = nonprefix_bound(w, frame["hit_blocks"].to_numpy(), bs)
            first = w.segments.first_miss(hit)
            labels = {"family": family, "layout": layout.label, "group": _group(layout),
                      "cache_blocks": int(sim.summary["capacity_blocks"]), "cache": _cache_label(cap)}
            req = pd.DataFrame({**labels, "request": np.arange(len(w)), "session": w.session, "turn": w.turn,
                                "arrival_s": frame["arrival"], "prompt_tokens": frame["prompt_tokens"],
                                "hit_tokens": hit, "nonprefix_bound_tokens": bound, "first_miss": first,
                                "break_tokens": brk, "break_segment": brk_seg, "ttft_s": frame["ttft_s"]})
            requests.append(req)
            runs.append({**labels, **_run_row(req, sim.summary), "workload_sha256": w.content_sha256,
                         "tokenizer_sha256": tokenizer.sha256, "template_sha256": tokenizer.template_sha256})
            for what, kinds in (("first_miss", first), ("break", brk_seg)):
                counts = kinds.value_counts().reindex(list(SEGMENT_KINDS), fill_value=0)
                misses += [{**labels, "what": what, "kind": k, "requests": int(c), "share": c / len(w)}
                           for k, c in counts.items()]
    runs_f = pd.DataFrame(runs)
    summary = {"family": family, "requests": len(reqs), "layouts": [lay.label for lay in layouts],
               "layout_steps": {lay.label: lay.identity() for lay in layouts},
               "renders": cache.renders, "render_reuses": cache.reused, "tokenizer": tokenizer.identity(),
               "model": config.model, "hardware": config.hardware, "block_size": bs,
               "gaps": gaps(runs_f).to_dict("records"), "seconds": time.perf_counter() - t0}
    return {"requests": pd.concat(requests, ignore_index=True), "runs": runs_f,
            "first_miss": pd.DataFrame(misses)}, summary


def _group(layout: Layout) -> str:
    return "+".join(s.transform.group for s in layout.steps) or "as generated"


def _cache_label(cap: int | None) -> str:
    return "device pool" if cap is None else f"{cap:,} blocks"


def _run_row(req: pd.DataFrame, s: dict) -> dict:
    prompt = int(req["prompt_tokens"].sum())
    bound = int(req["nonprefix_bound_tokens"].sum())
    return {"requests": len(req), "prompt_tokens": prompt, "reused_tokens": int(req["hit_tokens"].sum()),
            "token_hit_rate": s["token_hit_rate"], "ideal_hit_rate": s["ideal_hit_rate"],
            "nonprefix_bound_tokens": bound, "nonprefix_bound_rate": bound / prompt if prompt else 0.0,
            "ttft_mean_s": s["ttft_mean_s"], "ttft_p50_s": s["ttft_p50_s"], "ttft_p90_s": s["ttft_p90_s"],
            "preemptions": s["preemptions"], "rejected_requests": s["rejected_requests"], "evictions": s["evictions"],
            "kv_bytes_per_block": s["kv_bytes_per_block"]}


def gaps(runs: pd.DataFrame) -> pd.DataFrame:
    """Per family and cache size, the best and worst layout: by token hit rate (highest, lowest; ``hit_gap`` =
    their difference, a fraction of prompt tokens) and by mean TTFT (lowest, highest; ``ttft_gap_s`` their
    difference in seconds, ``ttft_ratio`` worst / best; NaN where the cache served no request: a cache smaller
    than a request rejects it, ``runs.rejected_requests``)."""
    rows = []
    for (family, cache), part in runs.groupby(["family", "cache"], sort=False):
        hb, hw = part.loc[part["token_hit_rate"].idxmax()], part.loc[part["token_hit_rate"].idxmin()]
        served = part.dropna(subset=["ttft_mean_s"])  # a cache too small for every request serves none
        if served.empty:
            tb = tw = pd.Series({"layout": None, "ttft_mean_s": np.nan})
        else:
            tb, tw = served.loc[served["ttft_mean_s"].idxmin()], served.loc[served["ttft_mean_s"].idxmax()]
        rows.append({"family": family, "cache": cache, "cache_blocks": int(part["cache_blocks"].iloc[0]),
                     "layouts": len(part), "best_hit_layout": hb["layout"], "best_hit_rate": hb["token_hit_rate"],
                     "worst_hit_layout": hw["layout"], "worst_hit_rate": hw["token_hit_rate"],
                     "hit_gap": hb["token_hit_rate"] - hw["token_hit_rate"],
                     "best_ttft_layout": tb["layout"], "best_ttft_mean_s": tb["ttft_mean_s"],
                     "worst_ttft_layout": tw["layout"], "worst_ttft_mean_s": tw["ttft_mean_s"],
                     "ttft_gap_s": tw["ttft_mean_s"] - tb["ttft_mean_s"],
                     "ttft_ratio": tw["ttft_mean_s"] / tb["ttft_mean_s"] if tb["ttft_mean_s"] else np.nan})
    return pd.DataFrame(rows)


def boundary_results(folder: Path, config: LayoutStudyConfig, tokenizer: TextTokenizer, *,
                     resume: bool = True) -> pd.DataFrame:
    """The seed-004 sweep (:func:`kvlab.layout.reuse.boundary_sweep`) on real text, saved under ``folder``."""
    b = config.boundary
    text = config.boundary_text(tokenizer)
    sha = hashlib.sha256(json.dumps([text, b.question]).encode()).hexdigest()
    cfg = {"study_version": STUDY_VERSION, "boundary": b.to_dict(), "policy": "lru", "mode": "vllm",
           "tokenizer": tokenizer.identity()}
    trace = _trace("boundary", sha, b.requests, tokenizer)
    identity = run_identity(cfg, trace)
    if not (resume and is_complete(folder, identity)):
        t0 = time.perf_counter()
        frame = boundary_sweep(tokenizer, text, b.positions(), b.block_sizes, requests=b.requests,
                               question=b.question)
        summary = {"stable_tokens": b.prompt_tokens, "block_sizes": b.block_sizes, "positions": len(b.positions()),
                   "exact": bool((frame["hit_tokens"] == frame["kept_tokens"]).all()),
                   "seconds": time.perf_counter() - t0, "tokenizer": tokenizer.identity()}
        write_results(folder, {"requests": frame}, summary,
                      build_manifest(cfg, trace=trace, seed=config.seed, driver="layout-study", identity=identity))
    return read_results(folder).tables["requests"]
