"""benchmarks/gpu_check.sh runs every GPU check section end to end on the CPU with tiny shapes, as it will on
a GPU machine: from the source tree (PYTHONPATH set by the script, no install), in a fresh process, writing
its JSON report to $OUT after every section; a section stopped by its budget, or the whole run stopped by
SIGTERM, leaves the finished sections' JSON intact."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
SECTIONS = ["environment", "copy", "model", "verify", "pool", "prefill", "ttft"]


def _env(out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script sets it
    return {**env, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_HARD_TIMEOUT": "0"}


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(["bash", str(SCRIPT), "--tiny", "--device", "cpu", *args], cwd=tmp_path,
                          env=_env(tmp_path / "out"), capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    return proc, report


def test_gpu_check_runs_every_section_tiny_on_cpu(tmp_path):
    proc, rep = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert rep["kind"] == "kvlab.gpu_check" and rep["complete"] and rep["shape"] == "tiny-llama"
    sec = rep["sections"]
    assert list(sec) == SECTIONS and all(s["status"] == "ok" for s in sec.values())
    assert all(s["elapsed_s"] >= 0 and s["budget_s"] > 0 for s in sec.values())  # recorded; no time decides a pass

    env = sec["environment"]
    assert env["device"] == "cpu" and env["torch"] and env["transformers"] and env["peak_flops"] > 0
    assert env["device_memory"]["total_bytes"] > 0

    copy = sec["copy"]
    assert copy["host_to_host"] and copy["pinned"].startswith("not available")  # CPU: host->host, no pinning
    assert {(r["size"], r["direction"]) for r in copy["rows"]} == {
        (s, d) for s in ("block_16", "block_512", "64MiB") for d in ("h2d", "d2h")}
    per_token = 2 * 4 * 2 * 32 * 2  # tiny-llama: 2 x 4 layers x 2 KV heads x 32 dims x 2 bytes (bf16)
    sizes = {r["size"]: r["bytes"] for r in copy["rows"]}
    assert sizes == {"block_16": 16 * per_token, "block_512": 512 * per_token, "64MiB": 64 << 20}
    assert all(r["gbps"] > 0 and r["gbps_median"] > 0 and r["iters"] >= 3 for r in copy["rows"])

    assert sec["model"]["parameters"] > 0 and sec["model"]["flop_model"]["num_layers"] == 4

    verify = sec["verify"]
    assert verify["passed"] and verify["verify_failures"] == 0 and verify["verified_requests"] == 8
    assert sum(verify["hit_blocks"]) > 0 and verify["verify_argmax_agreement"] == 1.0
    assert 0 <= verify["verify_max_logit_abs"] <= min(verify["logit_allowed"])

    pool = sec["pool"]
    b16, b512 = pool["block_sizes"]["16"], pool["block_sizes"]["512"]
    assert b16["bytes_per_block"] == 16 * per_token and b512["bytes_per_block"] == 512 * per_token
    assert b16["blocks"] > 0 and b16["bytes"] == b16["blocks"] * b16["bytes_per_block"] <= pool["pool_bytes"]
    assert pool["pool_bytes"] <= 0.9 * pool["total_bytes"]
    assert 0 < pool["allocated_bytes"] <= 64 << 20 and pool["allocated_blocks"] * b16["bytes_per_block"] == \
        pool["allocated_bytes"]

    pre = sec["prefill"]
    rows = pre["rows"]
    batched = pre["batched"] != "not available"
    expected_batches = [1, 8, 32] if batched else [1]
    assert pre["batches"] == expected_batches and pre["requested_batches"] == [1, 8, 32]
    assert sorted((r["fraction"], r["batch"]) for r in rows) == sorted(
        (h, b) for h in (0.0, 0.5, 0.9) for b in expected_batches)
    assert all("error" not in r for r in rows)
    assert all(r["tokens_per_s"] > 0 and r["tflops"] > 0 and 0 < r["mfu"] < 1 for r in rows)
    assert {r["hit_tokens"] for r in rows} == {0, 128, 224}  # h of 256 tokens in whole 16-token blocks
    for r in rows:
        assert r["computed_tokens"] == r["batch"] * (256 - r["hit_tokens"])
        if r["batch"] > 1:
            assert r["sequential_s"] > 0 and r["vs_sequential_argmax_agreement"] == 1.0
            assert r["vs_sequential_max_logit_abs"] <= r["vs_sequential_allowed"]

    ttft = sec["ttft"]
    assert ttft["verify_passed"]
    (sweep,) = ttft["sweeps"]
    table = sweep["table"]
    assert [row["hit_tokens"] for row in table] == [0, 64, 128, 192, 224]
    assert all(row["ttft_s"] > 0 and 0 < row["mfu"] < 1 and row["tokens_per_s"] > 0 for row in table)
    assert "## ttft" in proc.stdout and "MFU" in proc.stdout


def test_section_timeout_keeps_earlier_sections(tmp_path):
    """A section over its budget is recorded as a timeout; the sections before it keep their results and the
    ones after it still run."""
    proc, rep = _run(tmp_path, "--sections", "environment,copy,model,prefill,ttft", "--section-timeout",
                     "prefill=0.2", "--batches", "1", "8", "--hits", "0", "0.5", "--no-hf")
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    sec = rep["sections"]
    assert list(sec) == ["environment", "copy", "model", "prefill", "ttft"]
    assert sec["prefill"]["status"] == "timeout" and "budget" in sec["prefill"]["error"]
    assert sec["prefill"]["budget_s"] == 0.2 and "rows" not in sec["prefill"]
    for name in ("environment", "copy", "model", "ttft"):
        assert sec[name]["status"] == "ok", (name, sec[name])
    assert len(sec["copy"]["rows"]) == 6 and all(r["gbps"] > 0 for r in sec["copy"]["rows"])
    assert [row["hit_tokens"] for row in sec["ttft"]["sweeps"][0]["table"]] == [0, 128]
    assert rep["complete"]


def test_sigterm_keeps_finished_sections(tmp_path):
    """An external kill (``timeout`` sends SIGTERM) mid-run: the report on disk is valid JSON at every moment,
    finished sections are intact, the interrupted one is marked killed, and the run is not complete."""
    out = tmp_path / "out"
    path = out / "gpu_check.json"
    proc = subprocess.Popen(["bash", str(SCRIPT), "--tiny", "--device", "cpu"], cwd=tmp_path, env=_env(out),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if path.exists():
                rep = json.loads(path.read_text())  # never a half-written file (temp file + rename)
                if rep["sections"].get("model", {}).get("status") == "ok":
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("the model section never finished")
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stdout[-4000:]
    rep = json.loads(path.read_text())
    sec = rep["sections"]
    statuses = {s: v["status"] for s, v in sec.items()}
    assert not rep["complete"], statuses
    assert [statuses[s] for s in ("environment", "copy", "model")] == ["ok"] * 3, statuses
    assert len(sec["copy"]["rows"]) == 6 and sec["model"]["parameters"] > 0
    # the section running at SIGTERM is marked killed (none when the signal fell between two sections)
    killed = [s for s, v in statuses.items() if v == "killed"]
    assert killed in ([], [list(sec)[-1]]), statuses
    assert all(v == "ok" for s, v in statuses.items() if s not in killed), statuses
    assert "killed (signal 15)" in stdout


def test_prefill_without_batched_module_runs_batch_one_only(monkeypatch):
    """With no ``kvlab.engine.batched`` at run time (an older tree) the prefill section says so and measures
    batch 1 only: no numbers for batch 8 / 32."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ on sys.path
    spec = importlib.util.spec_from_file_location("kvlab_gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kvlab_gpu_check", gc)  # dataclasses look their module up
    spec.loader.exec_module(gc)
    assert gc.resolve_batched().available  # this tree has it
    monkeypatch.setitem(sys.modules, "kvlab.engine.batched", None)  # import now fails: ModuleNotFoundError
    assert gc.resolve_batched().status == "not available"
    args = gc.parse_args(["--tiny", "--device", "cpu", "--repeats", "1", "--warmup", "0", "--prefill-tokens", "64"])
    ctx = gc.Context(args, torch.device("cpu"), torch.bfloat16, "tiny-llama", None, peak=1e11, peak_source="test")
    gc.section_model(ctx)
    out = gc.section_prefill(ctx)
    assert out["batched"] == "not available" and "not measured" in out["note"] and "status" not in out
    assert out["batches"] == [1] and out["requested_batches"] == [1, 8, 32]
    assert [(r["fraction"], r["batch"], r["method"]) for r in out["rows"]] == [
        (h, 1, "forward_tokens") for h in (0.0, 0.5, 0.9)]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in out["rows"])
