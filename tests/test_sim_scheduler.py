"""The scheduler and the simulator: admission limits, chunked prefill, decode lengths, preemption, hits at
admission, concurrency between simultaneous arrivals, output-block reuse, pinning, determinism, results."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from kvlab.cache.manager import KVCacheManager
from kvlab.cli import main
from kvlab.hashing import BlockHasher
from kvlab.policies import make_cache
from kvlab.profiles import load_model
from kvlab.results import read_results
from kvlab.sim import Request, Scheduler, SimClock, SimConfig, WallClock, scaled_arrivals, simulate
from kvlab.sim.simulator import route_requests
from kvlab.workload import from_lists, save_jsonl, synthetic_chat, zipf_blocks

HASHER = BlockHasher("xxh3_64")
BS = 4


def req(i: int, prompt: list[int], out_len: int, arrival: float = 0.0, outputs: list[int] | None = None) -> Request:
    """A request whose keys cover the prompt and (token traces with answers) its known output tokens."""
    keys = HASHER.token_keys(list(prompt) + list(outputs or []), BS)
    return Request(request_id=i, prompt_tokens=len(prompt), keys=keys, row=i, arrival=arrival, output_length=out_len)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


class FixedExecutor:
    """Every step takes ``seconds``; records ``(request_id, num_new_tokens, cached_context)`` per step."""

    def __init__(self, seconds: float = 1.0) -> None:
        self.seconds = seconds
        self.batches: list[list[tuple[int, int, int]]] = []

    def execute(self, batch) -> float:
        self.batches.append([(r.request_id, n, c) for r, n, c in batch])
        return self.seconds


def serve(requests: list[Request], capacity: int = 1000, *, cache_at: str = "schedule", executor=None,
          **kw) -> tuple[Scheduler, FixedExecutor]:
    executor = executor or FixedExecutor()
    manager = KVCacheManager(make_cache(capacity, "lru", block_size=BS), cache_at=cache_at)
    scheduler = Scheduler(manager, executor, SimClock(), **kw)
    scheduler.run(requests)
    return scheduler, executor


# ---------------------------------------------------------------------- admission, chunking, decode
def test_fcfs_admission_respects_max_num_seqs():
    rs = [req(i, toks(100 * i, 8), 3) for i in range(4)]
    _, ex = serve(rs, max_num_seqs=2)
    assert [e[0] for e in ex.batches[0]] == [0, 1]
    assert [r.admitted_s for r in rs] == [0.0, 0.0, 3.0, 3.0]  # r0, r1 finish after 3 steps
    assert all(len(b) <= 2 for b in ex.batches)


def test_token_budget_chunks_the_next_waiting_request():
    rs = [req(0, toks(0, 8), 2), req(1, toks(100, 8), 2)]
    _, ex = serve(rs, max_num_batched_tokens=10)
    assert ex.batches[0] == [(0, 8, 0), (1, 2, 0)]
    assert ex.batches[1] == [(0, 1, 8), (1, 6, 2)]  # running first: r0 decodes, r1 continues its prefill
    assert ex.batches[2] == [(1, 1, 8)]


def test_chunked_prefill_splits_a_long_prompt():
    r = req(0, toks(0, 100), 2)
    _, ex = serve([r], max_num_batched_tokens=32)
    assert ex.batches == [[(0, 32, 0)], [(0, 32, 32)], [(0, 32, 64)], [(0, 4, 96)], [(0, 1, 100)]]
    assert (r.first_token_s, r.finished_s) == (4.0, 5.0)
    assert (r.computed_tokens, r.prefill_tokens, r.computed_prompt_tokens) == (101, 100, 100)


def test_decode_lengths_are_honoured():
    rs = [req(i, toks(50 * i, 6), out, arrival=0.5 * i) for i, out in enumerate([1, 2, 5, 17])]
    serve(rs)
    for r in rs:
        assert r.num_output_tokens == r.output_length
        assert r.finished_s - r.first_token_s == pytest.approx(r.output_length - 1)
        assert r.computed_tokens == r.prompt_tokens + r.output_length - 1


def test_free_blocks_gate_admission():
    rs = [req(0, toks(0, 12), 2), req(1, toks(100, 8), 2)]
    scheduler, _ = serve(rs, capacity=4)  # r0 needs 3 blocks then 4; r1 needs 2
    assert rs[1].admitted_s == 2.0 and scheduler.preemptions == 0


def test_request_that_can_never_fit_is_rejected():
    rs = [req(0, toks(0, 12), 2), req(1, toks(100, 4), 2)]
    scheduler, _ = serve(rs, capacity=3)  # r0 needs ceil(13 / 4) = 4 blocks
    assert rs[0].status.name == "REJECTED" and rs[0].admissions == 0
    assert rs[1].status.name == "FINISHED" and scheduler.rejected == 1


# ---------------------------------------------------------------------- preemption
@pytest.mark.parametrize("known_outputs", [False, True])
def test_preemption_of_the_newest_with_readmission_hits_apart(known_outputs):
    a_out, b_out = toks(500, 9), toks(600, 9)
    a = req(0, toks(0, 8), 9, outputs=a_out if known_outputs else None)
    b = req(1, toks(100, 8), 9, outputs=b_out if known_outputs else None)
    scheduler, ex = serve([a, b], capacity=6)  # each needs 4 blocks alone; together 8 > 6
    assert (a.preemptions, b.preemptions) == (0, 1)  # the newest is preempted, the oldest never
    assert scheduler.preemptions == 1
    assert b.hit_blocks == 0  # first admission: nothing cached
    assert b.readmission_hit_blocks >= 2  # its own prompt blocks, still cached when it came back
    assert b.num_output_tokens == 9 and a.finished_s < b.finished_s
    # step 6: a needs a 4th block, b (newest) is preempted and not scheduled; no admission in that step
    assert ex.batches[5] == [(0, 1, 12)]
    # the re-admission recomputes prompt + sampled tokens beyond the hits
    readmit = next(e for step in ex.batches[6:] for e in step if e[0] == 1)
    assert readmit[2] == 4 * b.readmission_hit_blocks and readmit[1] == 8 + 5 - readmit[2]


def test_preemption_columns_in_results():
    w = zipf_blocks(300, seed=3, rate=200.0, max_output=400, block_size=16)
    r = simulate(w, capacity_blocks=60, max_num_seqs=64, hardware="a100-80gb")
    f = r.requests
    assert f["preemptions"].sum() > 0 and r.summary["preemptions"] == f["preemptions"].sum()
    pre = f[f["preemptions"] > 0]
    assert pre["readmission_hit_tokens"].sum() > 0
    assert (f["hit_tokens"] <= f["prompt_tokens"]).all()
    assert r.summary["readmission_hit_tokens"] == f["readmission_hit_tokens"].sum()
    assert r.summary["reused_tokens"] == f["hit_tokens"].sum()  # first admissions only
    assert r.summary["recomputed_tokens"] > 0


# ---------------------------------------------------------------------- hits and concurrency
def test_hits_are_measured_at_admission_with_the_last_token_cap():
    base = toks(0, 12)
    rs = [req(0, base, 1), req(1, base + [7, 7, 7, 7], 1, arrival=10.0), req(2, base, 1, arrival=20.0)]
    serve(rs)
    assert [r.hit_blocks for r in rs] == [0, 3, 2]  # identical prompt: (12 - 1) // 4 = 2 blocks


@pytest.mark.parametrize(("cache_at", "unchunked_hits", "chunked_hits"), [("compute", 0, 2), ("schedule", 4, 4)])
def test_simultaneous_arrivals_sharing_a_prefix(cache_at, unchunked_hits, chunked_hits):
    prefix = toks(0, 16)
    rs = [req(0, prefix + [900, 901], 1), req(1, prefix + [800, 801], 1)]
    _, ex = serve(rs, cache_at=cache_at)
    assert ex.batches[0] == [(0, 18, 0), (1, 18 - 4 * unchunked_hits, 4 * unchunked_hits)]
    # "compute": r1 misses blocks r0 computes in the same step; "schedule" (vLLM v1): a block is findable
    # from the step that computes it, so r1 shares r0's forward pass
    assert rs[1].hit_blocks == unchunked_hits
    rs = [req(0, prefix + [900, 901], 1), req(1, prefix + [800, 801], 1)]
    _, ex = serve(rs, cache_at=cache_at, max_num_batched_tokens=10)
    # step 1: r0 computes 10 tokens (blocks 0-1); step 2: r0 the other 8, r1 admitted with 2 tokens of budget
    assert ex.batches[0] == [(0, 10, 0)] and ex.batches[1][0] == (0, 8, 10)
    assert rs[1].hit_blocks == chunked_hits
    assert rs[1].admitted_s == 1.0


def _turns(kind: str) -> tuple:
    p1, answer, user = toks(0, 8), toks(100, 8), toks(200, 4)
    if kind == "tokens":
        w = from_lists([p1, p1 + answer + user], arrival=[0.0, 100.0], output_length=[8, 2],
                       output_offsets=np.array([0, 8, 10]), output_values=np.array(answer + [300, 301]))
    else:  # a hash trace: block ids, no output ids
        w = from_lists([[1, 2], [1, 2, 3, 4, 5]], kind="blocks", block_size=BS, arrival=[0.0, 100.0],
                       output_length=[8, 2])
    return w


@pytest.mark.parametrize("cache_at", ["schedule", "compute"])
def test_output_tokens_are_keyed_and_reused_by_the_next_turn(cache_at):
    r = simulate(_turns("tokens"), capacity_blocks=64, block_size=BS, cache_at=cache_at).requests
    # turn 1 computed 8 + 8 - 1 tokens: 3 full blocks, the third half prompt half answer
    assert r["hit_blocks"].tolist() == [0, 3] and r["hit_tokens"].tolist() == [0, 12]
    assert r["ideal_hit_tokens"].tolist() == [0, 12]
    h = simulate(_turns("blocks"), capacity_blocks=64, cache_at=cache_at).requests
    assert h["hit_blocks"].tolist() == [0, 2]  # hash traces: output blocks are never keyed


def test_pinned_blocks_are_never_evicted():
    class Checking(FixedExecutor):
        def __init__(self) -> None:
            super().__init__(0.01)
            self.checked = 0

        def execute(self, batch) -> float:
            pinned = set()
            for r, n, c in batch:
                assert len(r.blocks) * BS >= c + n  # slots for every scheduled token
                for j, block in enumerate(r.blocks):
                    assert block.ref_cnt >= 1
                    if j < r.num_keyed_blocks:
                        assert block.key == r.keys[j]  # an evicted block would have lost its key
                    pinned.add(block.block_id)
                self.checked += 1
            assert len(pinned) <= 40
            return super().execute(batch)

    rng = np.random.default_rng(0)
    stems = [rng.integers(0, 50, size=24).tolist() for _ in range(5)]
    rs = [req(i, stems[i % 5][: int(rng.integers(4, 24))] + toks(1000 + 40 * i, int(rng.integers(1, 12))),
              int(rng.integers(1, 30)), arrival=0.05 * i) for i in range(200)]
    ex = Checking()
    scheduler, _ = serve(rs, capacity=40, executor=ex, max_num_seqs=12)
    assert ex.checked > 1000 and scheduler.preemptions > 0 and scheduler.cache.stats.evictions > 0
    assert all(r.status.name == "FINISHED" for r in rs)
    assert scheduler.cache.num_running_blocks == 0


# ---------------------------------------------------------------------- whole simulations
SMALL = dict(capacity_blocks=500, max_num_seqs=32, max_num_batched_tokens=2048)


@pytest.mark.parametrize(("make", "kw"), [
    (lambda: synthetic_chat(150, seed=4), dict(SMALL)),
    (lambda: synthetic_chat(150, seed=4), dict(SMALL, cache_at="compute", model="mistral-7b")),
    (lambda: zipf_blocks(300, seed=5, rate=100.0, block_size=16), dict(capacity_blocks=80, max_num_seqs=24)),
])
def test_deterministic_and_fast_forward_is_exact(make, kw):
    w = make()
    a, b = simulate(w, **kw), simulate(w, **kw)
    c = simulate(w, fast_forward=False, **kw)
    pd.testing.assert_frame_equal(a.requests, b.requests)
    pd.testing.assert_frame_equal(a.requests, c.requests)
    assert a.summary["iterations"] < c.summary["iterations"] == c.summary["steps"] == a.summary["steps"]
    # the same numbers (busy times are sums taken in another order: equal to rounding)
    assert a.summary.keys() == c.summary.keys()
    for key, value in a.summary.items():
        if key in ("sim_seconds", "iterations"):
            continue
        if isinstance(value, float):
            assert value == pytest.approx(c.summary[key], rel=1e-12, nan_ok=True), key
        else:
            assert value == c.summary[key], key
    ts_a, ts_c = a.timeseries, c.timeseries
    assert ts_a["num_steps"].sum() == len(ts_c) and ts_a["duration_s"].sum() == pytest.approx(
        ts_c["duration_s"].sum())
    for col in ("prefill_tokens", "decode_tokens", "evictions", "preemptions", "admissions", "finished"):
        assert ts_a[col].sum() == ts_c[col].sum(), col
    assert ((ts_a["batch_tokens"] * ts_a["num_steps"]) == ts_a["prefill_tokens"] + ts_a["decode_tokens"]).all()


def test_simulate_takes_a_config_like_replay():
    """``simulate(w, SimConfig(...))`` is ``simulate(w, **fields)``; keyword arguments override a config's fields."""
    w = synthetic_chat(120, seed=9)
    fields = dict(SMALL, model="mistral-7b", hardware="a100-80gb", policy="fifo", cache_at="compute", instances=2)
    by_fields, by_config = simulate(w, **fields), simulate(w, SimConfig(**fields))
    assert list(by_config.requests.columns) == list(by_fields.requests.columns)
    pd.testing.assert_frame_equal(by_config.requests, by_fields.requests)
    pd.testing.assert_frame_equal(by_config.timeseries, by_fields.timeseries)
    assert by_config.config == by_fields.config
    assert {k: v for k, v in by_config.summary.items() if k != "sim_seconds"} == {
        k: v for k, v in by_fields.summary.items() if k != "sim_seconds"}
    overridden = simulate(w, SimConfig(**dict(fields, policy="lru", instances=1)), policy="fifo", instances=2)
    pd.testing.assert_frame_equal(overridden.requests, by_fields.requests)
    assert overridden.config == by_fields.config
    profile = simulate(w, SimConfig(**fields), model=load_model("mistral-7b"))  # used as given, recorded by name
    pd.testing.assert_frame_equal(profile.requests, by_fields.requests)
    assert profile.config.model == "mistral-7b"


def test_simulate_writes_results_with_the_replay_names(tmp_path):
    w = synthetic_chat(120, seed=6)
    result = simulate(w, model="llama-3-8b", hardware="h100", policy="lru", capacity_blocks=400)
    run = read_results(result.save(tmp_path / "sim"))
    assert set(run.tables) == {"requests", "timeseries"}
    assert run.manifest["driver"] == "simulator"
    assert run.manifest["config"]["hardware_profile"]["calibrated"] is False
    s = run.summary
    assert s["calibration"] == "uncalibrated" and s["cost_model"] == "llama-3-8b@h100/uncalibrated"
    for name in ("token_hit_rate", "block_hit_rate", "request_hit_rate", "ideal_hit_rate", "reused_tokens",
                 "evictions", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "prefill_throughput",
                 "effective_prefill_throughput", "saved_prefill_flops", "tier_hits_hbm", "tier_bytes_hbm",
                 "kv_memory_peak_running_blocks", "kv_memory_mean_running_blocks"):
        assert name in s, name
    f = run.requests
    for col in ("request_id", "arrival", "prompt_tokens", "hit_tokens", "hit_blocks", "ttft_s", "tpot_s",
                "admitted_s", "first_token_s", "finished_s", "preemptions", "readmission_hit_tokens",
                "computed_prompt_tokens", "tenant", "turn"):
        assert col in f, col
    assert (f["ttft_s"] > 0).all() and (f["first_token_s"] <= f["finished_s"]).all()
    assert s["effective_prefill_throughput"] >= s["prefill_throughput"] > 0
    ts = run.tables["timeseries"]
    assert ts["time_s"].is_monotonic_increasing and (ts["kv_running_blocks"] <= 400).all()
    assert ts["tier_hits_hbm"].sum() == s["tier_hits_hbm"]
    assert json.dumps(s)  # plain JSON


def test_time_scale_and_rate():
    w = zipf_blocks(200, seed=7, rate=20.0)
    arrival, scale = scaled_arrivals(w, time_scale=2.0)
    assert scale == 2.0 and np.allclose(arrival, 2 * w.arrival)
    arrival, scale = scaled_arrivals(w, rate=5.0)
    assert (len(w) - 1) / (arrival[-1] - arrival[0]) == pytest.approx(5.0)
    slow = simulate(w, rate=5.0, capacity_blocks=200, hardware="l40s")
    fast = simulate(w, time_scale=0.05, capacity_blocks=200, hardware="l40s")
    assert slow.summary["rate"] == pytest.approx(5.0)
    assert fast.summary["ttft_p90_s"] > slow.summary["ttft_p90_s"]


def test_instances_and_routing():
    w = synthetic_chat(200, seed=8)
    r = simulate(w, instances=3, router="prefix", **SMALL)
    f = r.requests
    assert sorted(f["instance"].unique()) == [0, 1, 2] and r.summary["instances"] == 3
    turns = f[f["turn"] > 1]
    parent_instance = f["instance"].to_numpy()[w.parent[turns.index]]
    assert (turns["instance"].to_numpy() == parent_instance).mean() > 0.9  # conversations stay together
    rr = route_requests([0] * 10, list(range(11)), [1] * 10, 3, "round_robin")
    assert rr.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert set(r.timeseries["instance"]) == {0, 1, 2}


def test_wall_clock_runs_the_same_scheduler():
    rs = [req(i, toks(10 * i, 6), 3, arrival=0.002 * i) for i in range(5)]
    manager = KVCacheManager(make_cache(100, "lru", block_size=BS))
    scheduler = Scheduler(manager, FixedExecutor(0.0), WallClock())
    assert not scheduler.fast_forward
    scheduler.run(rs)
    assert all(r.status.name == "FINISHED" and r.first_token_s >= r.arrival for r in rs)
    assert not math.isnan(rs[-1].finished_s)


def test_cli_simulate(tmp_path, capsys):
    trace = save_jsonl(synthetic_chat(80, seed=9), tmp_path / "chat.jsonl")
    out = tmp_path / "sim"
    assert main(["simulate", str(trace), "--format", "jsonl", "--model", "llama-3-8b", "--hardware", "h100",
                 "--policy", "lru", "--capacity-blocks", "300", "--out", str(out), "--quiet"]) == 0
    assert "ttft_p50_s" in capsys.readouterr().out
    run = read_results(out)
    assert len(run.requests) == 80 and run.summary["capacity_blocks"] == 300
    assert main(["simulate", str(trace), "--format", "jsonl", "--model", "no-such-model", "--quiet"]) == 2


@pytest.mark.shared
def test_mooncake_slice_on_h100(shared_file):
    from kvlab.workload import load_trace

    w = load_trace(str(shared_file("mooncake/conversation_trace.jsonl"))).head(400)
    r = simulate(w, model="llama-3-8b", hardware="h100", time_scale=4.0)
    s = r.summary
    assert s["capacity_blocks"] == 894 and s["block_size"] == 512  # 0.9 x 80 GB beside 16 GB of weights
    assert s["requests"] == 400 and s["rejected_requests"] == 0
    assert 0 < s["token_hit_rate"] <= s["ideal_hit_rate"] + 1e-12
    assert 0 < s["ttft_p50_s"] < 30
