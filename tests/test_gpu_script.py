"""benchmarks/gpu_engine.py runs end to end on the CPU with a tiny model, as it will on a GPU machine:
from the source tree (PYTHONPATH, no install), in a fresh process, writing its JSON to $OUT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_script_runs_tiny_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_engine.py"), "--tiny", "--device", "cpu"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MFU" in proc.stdout and "oracle" in proc.stdout
    out = json.loads((tmp_path / "gpu_engine.json").read_text())
    assert out["shape"] == "tiny-llama" and out["environment"]["device"] == "cpu"
    (sweep,) = out["sweeps"]
    table = sweep["table"]
    assert [row["hit_tokens"] for row in table] == [0, 64, 128, 192, 224]  # h = 0 .. .9 of 256 tokens, 16-token blocks
    assert all(row["ttft_s"] > 0 and 0 < row["mfu"] < 1 and row["hf_copy_ttft_s"] > 0 for row in table)
    assert table[-1]["flop_ideal"] < table[-1]["inverse_miss"] == 8.0
    verify = out["verify"]
    assert verify["verify_failures"] == 0 and verify["sweep_passed"] and sum(verify["hit_blocks"]) > 0
