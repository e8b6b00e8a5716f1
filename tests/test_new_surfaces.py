"""Issue 23: every case of ``../shared/cases/new-surfaces-2026-12-05.tsv`` and the issue's further examples, one
test each, judged by the adversarial catalogue's classifier (``benchmarks/robustness.py``; the cases are in
``benchmarks/robustness_surfaces.py``, their descriptions start with ``TSV#NN`` for the file's rows).

Each case runs the real command line (or a ``python -c`` snippet for the Python API) as a subprocess with a
timeout and a 4 GiB address-space limit, sentinel files where data could be lost, and must end in a **clear
error** (one ``kvlab: error:`` line naming the flag, field or file; from Python a kvlab ``ConfigError`` /
``ResultsError`` / ``ResultsLocationError``) or a **correct result** (the case's own check). The cases read
slices of ``../shared/traces``: skipped when it is absent, a failure under ``CI=true``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_user_errors import REPO, rb

pytestmark = pytest.mark.slow

TSV = REPO.parent / "shared" / "cases" / "new-surfaces-2026-12-05.tsv"
TSV_ROWS = 47  # the data rows of TSV (its first line is the header)
SURFACE_CASES = {c.id: c for c in rb.CASES if c.fn.__module__ == rb.surfaces.__name__}


@pytest.fixture(scope="module")
def runner(shared_traces: Path, tmp_path_factory: pytest.TempPathFactory):
    """One catalogue run for the module: the inputs and the shared experiment are written once."""
    root = tmp_path_factory.mktemp("surfaces")
    return rb.Runner(root, rb.Options(pythonpath=str(REPO), traces=shared_traces))


def test_every_row_of_the_cases_file_is_a_case():
    rows = TSV_ROWS
    if TSV.is_file():
        rows = sum(1 for ln in TSV.read_text().splitlines()[1:] if ln.strip())
    assert sorted(rb.surfaces.tsv_numbers(SURFACE_CASES.values())) == list(range(1, rows + 1))
    assert {c.cls for c in SURFACE_CASES.values()} >= set(rb.SURFACE_CLASSES)


@pytest.mark.parametrize("case_id", list(SURFACE_CASES))
def test_case_ends_in_a_clear_error_or_a_correct_result(runner, case_id: str):
    result = rb.run_case(runner, SURFACE_CASES[case_id])
    run = result.verdict.run
    assert result.outcome in rb.GOOD, (
        f"{case_id}: {result.outcome}: {result.verdict.detail}\n" + (run.err[-1500:] if run is not None else ""))
