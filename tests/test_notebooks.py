"""Every notebook is stored without outputs or volatile metadata, executes top to bottom on a fresh kernel in
quick mode (KVLAB_QUICK=1, as ``kvlab figures --quick`` runs it) and writes byte-equal figure data when run again
(figures whose caption says ``"timing": true``, i.e. measured wall times, excluded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvlab.figures import build_index, data_digests, run_notebook, stripped_problems

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    problems = stripped_problems(path)
    assert not problems, f"{path.name}: clear outputs and volatile metadata before committing (make strip): {problems}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_and_its_data_repeats(path, shared_traces, monkeypatch, tmp_path):
    """Run 1 is the execution test; run 2 (only where the notebook wrote non-timing data) must write the same
    parquet bytes. The kernels run in a temporary folder, so nothing lands in the repository."""
    monkeypatch.setenv("KVLAB_TRACE_DIRS", str(shared_traces) + os.pathsep + os.environ.get("KVLAB_TRACE_DIRS", ""))
    digests = []
    for run in ("first", "second"):
        out = tmp_path / run
        run_notebook(path, out, quick=True, cwd=tmp_path, timeout=600)
        digests.append(data_digests(build_index(out, quick=True)))
        if not digests[0]:
            break
    if len(digests) == 2:
        changed = sorted(k for k in digests[0].keys() | digests[1].keys() if digests[0].get(k) != digests[1].get(k))
        assert not changed, (f"{path.name}: figure data differs between two runs: {changed} (mark measured wall "
                             "times with caption timing=True)")
