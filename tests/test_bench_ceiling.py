"""The 1/(1-h) ceiling check of the engine benchmark's summary, on constructed timings (no model is run)."""

from __future__ import annotations

import pandas as pd
import pytest

from kvlab.engine.bench import FlopModel, ceiling_warnings, format_table, summarize_sweep

FLOPS = FlopModel(num_layers=4, num_heads=8, head_dim=64, hidden_size=512, vocab_size=32000, linear_params=12_058_624)
P = 2048


def _row(frac: float, hit: int, pair: float, rep: int, wall: float, cpu: float | None = None) -> dict:
    """One engine row as :func:`run_sweep` writes it (phases: all in the forward)."""
    return {"method": "engine", "fraction": frac, "repeat": rep, "prompt_tokens": P, "hit_tokens": hit,
            "computed_tokens": P - hit, "pair": pair, "prefill_s": wall, "cpu_s": wall if cpu is None else cpu,
            "hash_s": 0.0, "lookup_s": 0.0, "gather_s": 0.0, "forward_s": wall, "scatter_s": 0.0,
            "bookkeeping_s": 0.0}


def _rows(uncached: list[float], cached: list[float], *, refs: list[float] | None = None,
          cpu_uncached: float = 1.0) -> pd.DataFrame:
    """h = 0 and h = 0.5 over len(cached) rounds: h = 0 takes ``uncached[r]`` wall seconds, the reference
    measured before each cached request ``refs[r]`` (default: the same), the cached one ``cached[r]``;
    CPU time: ``cpu_uncached`` uncached, half of it cached (the ideal of linear layers)."""
    refs = uncached if refs is None else refs
    rows = []
    for r, (u, ref, c) in enumerate(zip(uncached, refs, cached, strict=True)):
        rows += [_row(0.0, 0, 0.0, r, u, cpu_uncached), _row(0.0, 0, 0.5, r, ref, cpu_uncached),
                 _row(0.5, 1024, 0.5, r, c, cpu_uncached / 2)]
    return pd.DataFrame(rows)


def test_speedup_below_ceiling_is_not_flagged():
    table = summarize_sweep(_rows([1.0, 1.1, 1.05], [0.6, 0.62, 0.61]), FLOPS)
    assert table["inverse_miss"].tolist() == [1.0, 2.0]
    assert not table["above_ceiling"].any()
    assert ceiling_warnings(table) == []
    assert "ABOVE" not in format_table(table)


def test_best_of_n_above_ceiling_is_flagged():
    # every uncached run slowed (other jobs), one cached run in a quiet moment: 1.5 / 0.55 = 2.73 > 2
    table = summarize_sweep(_rows([1.6, 1.7, 1.5], [0.9, 0.55, 0.8]), FLOPS)
    half = table.set_index("fraction").loc[0.5]
    assert half["speedup"] == pytest.approx(1.5 / 0.55)
    assert half["above_ceiling"] and not table.set_index("fraction").loc[0.0, "above_ceiling"]
    assert half["speedup_cpu"] == pytest.approx(2.0)  # CPU time: at the ceiling, not above it
    (line,) = ceiling_warnings(table)
    assert "h = 0.50" in line and "2.727" in line and "1/(1-h) = 2.00" in line
    assert "ABOVE" in format_table(table)


def test_paired_ratio_uses_the_reference_measured_next_to_it():
    # h = 0 runs slow, references fast: the best uncached time is the fastest of both, and each round's
    # ratio divides the reference measured right before the cached request, not the round's h = 0 run
    table = summarize_sweep(_rows([3.0, 3.0, 3.0], [0.55, 0.6, 0.65], refs=[1.0, 1.1, 1.2]), FLOPS)
    half = table.set_index("fraction").loc[0.5]
    assert half["speedup"] == pytest.approx(1.0 / 0.55)
    assert half["speedup_paired"] == pytest.approx(1.1 / 0.6)
    assert table.set_index("fraction").loc[0.0, "ttft_s"] == pytest.approx(1.0)
    assert table.set_index("fraction").loc[0.0, "speedup_paired"] == pytest.approx(1.0)
    assert not table["above_ceiling"].any()


def test_paired_ratio_above_ceiling_is_flagged():
    # the best-of-N ratio stays below 2, but within rounds the references were slowed: median 2.5
    table = summarize_sweep(_rows([1.0, 1.0, 1.0], [0.6, 0.6, 0.6], refs=[1.5, 1.5, 1.2]), FLOPS)
    half = table.set_index("fraction").loc[0.5]
    assert half["speedup"] < 2.0 < half["speedup_paired"]
    assert half["above_ceiling"]
    assert len(ceiling_warnings(table)) == 1
