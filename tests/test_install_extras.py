"""A replay-only user installs kvlab without torch: the core dependencies leave out the engine's and
the notebooks' packages, and replay, simulate and the demo run with those packages unimportable."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "datasets", "jupyterlab")


def test_core_dependencies_leave_out_engine_and_notebooks():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert not any(name in core for name in HEAVY)
    extras = project["optional-dependencies"]
    assert any(d.startswith("torch==") for d in extras["engine"])
    assert any(d.startswith("jupyterlab") for d in extras["notebooks"])
    assert "kvlab[engine,notebooks]" in extras["dev"]


def test_replay_simulate_and_demo_run_without_torch(tmp_path):
    code = f"""
import sys
for name in {HEAVY!r}:
    sys.modules[name] = None  # import fails like an absent package
from kvlab.cli import main
from kvlab.workload.generate import synthetic_chat
from kvlab.workload.native import save_jsonl
save_jsonl(synthetic_chat(40, seed=0), {str(tmp_path / 't.jsonl')!r})
codes = [
    main(['replay', {str(tmp_path / 't.jsonl')!r}, '--capacity-blocks', '400', '--quiet']),
    main(['simulate', {str(tmp_path / 't.jsonl')!r}, '--quiet']),
    main(['demo', '--quick', '--out', {str(tmp_path / 'demo')!r}, '--quiet']),
]
assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None], 'torch was imported'
sys.exit(max(codes))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "demo" / "sweep.parquet").exists()
