"""Tables that say what they hold (issue 23, cases of class "result folders"): ``kvlab.results.load`` warns
(``ResultsWarning``) or, ``strict=True``, refuses (``ResultsError``) a damaged run, runs of several trace contents
or experiment definitions, and runs of another command in an experiment's folder, naming the runs; a resume
rebuilds a ``sweep.parquet`` that does not verify; a replay sweep is refused in an experiment's folder before any
work; ``read_results`` refuses columns that are not the metric table's even when the checksums match.

Fast: one 6-run experiment (Python replay backend, a 120-request Mooncake-format trace written here), copied
per test."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest
import yaml
from test_experiment import write_trace

import kvlab.results
from kvlab.cli import main
from kvlab.errors import ResultsError, ResultsLocationError
from kvlab.experiment import run_experiment
from kvlab.results import ResultsWarning, read_results
from kvlab.results.paths import file_entry
from kvlab.sweep import grid, run_sweep, table_problem
from kvlab.workload import load_trace

NAME = "kexp"
RUNS = 6


def write_experiment(path: Path, trace: Path, policies: tuple[str, ...] = ("lru", "fifo"),
                     capacities: tuple[int, ...] = (4, 16, 64)) -> Path:
    path.write_text(yaml.safe_dump({
        "name": NAME, "trace": {"path": str(trace)}, "cache": {"capacity_blocks": 8, "backend": "python"},
        "sweep": {"grid": {"cache.policy": list(policies), "cache.capacity_blocks": list(capacities)}}}))
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A results root holding experiment ``kexp`` (6 runs), its YAML and its trace beside it."""
    root = tmp_path_factory.mktemp("made")
    file = write_experiment(root / "kexp.yaml", write_trace(root / "trace.jsonl", n=120))
    run_experiment(file, root / "results", progress=False)
    return root


@pytest.fixture
def res(made: Path, tmp_path: Path) -> Path:
    """A private copy of the results root; returns the experiment's folder."""
    shutil.copytree(made / "results", tmp_path / "results")
    return tmp_path / "results" / NAME


def run_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in (folder / "runs").iterdir() if not p.name.startswith("."))


def load_warned(folder: Path) -> tuple[pd.DataFrame, list[str]]:
    """``load(folder)`` and the ResultsWarning messages it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = kvlab.results.load(folder)
    return table, [str(w.message) for w in caught if issubclass(w.category, ResultsWarning)]


def test_clean_folder_loads_without_warning(res: Path) -> None:
    table, messages = load_warned(res)
    assert len(table) == RUNS and messages == []
    assert len(kvlab.results.load(res, strict=True)) == RUNS


def test_truncated_run_is_named_not_silently_dropped(res: Path) -> None:
    victim = run_dirs(res)[2]
    file = victim / "requests.parquet"
    os.truncate(file, file.stat().st_size // 2)
    table, messages = load_warned(res)
    assert len(table) == RUNS - 1 and len(messages) == 1
    assert f"1 of {RUNS} runs damaged" in messages[0] and victim.name in messages[0]
    assert "requests.parquet" in messages[0] and "truncated" in messages[0] and "\n" not in messages[0]
    with pytest.raises(ResultsError, match=rf"1 of {RUNS} runs damaged.*{victim.name}"):
        kvlab.results.load(NAME, results=res.parent, strict=True)


def test_swapped_requests_between_two_runs_are_named(res: Path) -> None:
    a, b = run_dirs(res)[:2]
    tmp = res / "swap.parquet"
    os.rename(a / "requests.parquet", tmp)
    os.rename(b / "requests.parquet", a / "requests.parquet")
    os.rename(tmp, b / "requests.parquet")
    table, messages = load_warned(res)
    assert len(table) == RUNS - 2 and len(messages) == 1
    assert f"2 of {RUNS} runs damaged" in messages[0] and a.name in messages[0] and b.name in messages[0]
    assert "sha256 differs" in messages[0] or "bytes, but" in messages[0]


def test_swapped_run_folders_are_named(res: Path) -> None:
    a, b = run_dirs(res)[:2]
    tmp = res / "runs" / "swap"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    table, messages = load_warned(res)
    assert len(table) == RUNS - 2 and len(messages) == 1
    assert f"2 of {RUNS} runs damaged" in messages[0] and a.name in messages[0] and b.name in messages[0]
    assert "run_id" in messages[0]


def test_resume_rebuilds_a_truncated_sweep_table(res: Path, made: Path) -> None:
    table = res / "sweep.parquet"
    os.truncate(table, 100)
    assert "sweep.parquet" in (table_problem(res) or "")
    again = run_experiment(made / "kexp.yaml", res.parent, progress=False)  # every run complete: a resume
    assert len(again) == RUNS and table_problem(res) is None
    assert sorted(pd.read_parquet(table)["run_id"]) == sorted(again["run_id"])


def test_cli_run_resume_rebuilds_a_truncated_sweep_table(res: Path, made: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    os.truncate(res / "sweep.parquet", 100)
    assert main(["run", str(made / "kexp.yaml"), "--results", str(res.parent), "--no-figure", "--quiet"]) == 0
    assert "results written to" in capsys.readouterr().out
    assert table_problem(res) is None and len(pd.read_parquet(res / "sweep.parquet")) == RUNS


def test_trace_edited_in_place_between_two_runs_is_warned(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", n=120)
    file = write_experiment(tmp_path / "e.yaml", trace, policies=("lru",), capacities=(16, 64))
    first = run_experiment(file, tmp_path / "res", progress=False)
    trace.write_text("".join(trace.read_text().splitlines(keepends=True)[:60]))  # same name, new content
    done = subprocess.run([sys.executable, "-m", "kvlab.cli", "run", str(file), "--results", str(tmp_path / "res"),
                           "--no-figure", "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    second = [p.name for p in run_dirs(tmp_path / "res" / NAME) if p.name not in set(first["run_id"])]
    table, messages = load_warned(tmp_path / "res" / NAME)
    assert len(table) == 4 and len(messages) == 1
    assert "2 contents of trace" in messages[0] and str(trace) in messages[0]
    assert all(rid in messages[0] for rid in first["run_id"])
    assert len(second) == 2 and not any(rid in messages[0] for rid in second)
    with pytest.raises(ResultsError, match="2 contents of trace"):
        kvlab.results.load(NAME, results=tmp_path / "res", strict=True)


def test_trace_edited_in_place_is_read_again_in_the_same_process(tmp_path: Path) -> None:
    """kvlab.experiment.drivers caches traces per process: the cache key holds the file's size, mtime and inode,
    so a second run_experiment in one process (a notebook) after an in-place edit computes new runs."""
    trace = write_trace(tmp_path / "t.jsonl", n=120)
    file = write_experiment(tmp_path / "e.yaml", trace, policies=("lru",), capacities=(16, 64))
    first = run_experiment(file, tmp_path / "res", progress=False)
    trace.write_text("".join(trace.read_text().splitlines(keepends=True)[:60]))
    second = run_experiment(file, tmp_path / "res", progress=False)
    assert not set(first["run_id"]) & set(second["run_id"])
    assert (first["requests"] == 120).all() and (second["requests"] == 60).all()


def test_two_definitions_under_one_name_are_warned(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", n=120)
    a = write_experiment(tmp_path / "a.yaml", trace, policies=("lru",), capacities=(16,))
    b = write_experiment(tmp_path / "b.yaml", trace, policies=("fifo",), capacities=(16,))
    run_experiment(a, tmp_path / "res", progress=False)
    other = run_experiment(b, tmp_path / "res", progress=False, allow_redefine=True)
    table, messages = load_warned(tmp_path / "res" / NAME)
    assert sorted(table["cache.policy"]) == ["fifo", "lru"] and len(messages) == 1
    assert "2 experiment definitions" in messages[0]
    lru = table.loc[table["cache.policy"] == "lru", "run_id"].iloc[0]
    assert lru in messages[0] and other["run_id"].iloc[0] not in messages[0]  # b.yaml is the folder's current
    with pytest.raises(ResultsError, match="2 experiment definitions"):
        kvlab.results.load(NAME, results=tmp_path / "res", strict=True)


def test_replay_sweep_into_an_experiment_folder_is_refused(res: Path, made: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    before = sorted(str(p.relative_to(res)) for p in res.rglob("*"))
    rc = main(["replay", str(made / "trace.jsonl"), "--capacity-blocks", "100", "200", "--out", str(res)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("kvlab: error: ") and err.count("\n") == 1
    assert f"holds the results of experiment '{NAME}'" in err
    with pytest.raises(ResultsLocationError, match="holds the results of experiment"):
        run_sweep(load_trace(made / "trace.jsonl"), grid([100], engine="python"), res, progress=False)
    assert sorted(str(p.relative_to(res)) for p in res.rglob("*")) == before
    assert len(kvlab.results.load(res, strict=True)) == RUNS


def test_runs_of_another_command_in_an_experiment_folder_are_warned(res: Path, made: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    rows = run_sweep(load_trace(made / "trace.jsonl"), grid([100, 200], engine="python"), sweep, progress=False)
    for rid in rows["run_id"]:  # as an older kvlab let kvlab replay --out RESULTS/<experiment> write them
        shutil.copytree(sweep / "runs" / rid, res / "runs" / rid)
    table, messages = load_warned(res)
    assert len(table) == RUNS + 2 and len(messages) == 1
    assert "2 of 8 runs record no experiment" in messages[0] and all(r in messages[0] for r in rows["run_id"])


def _rewrite_requests(run: Path, frame: pd.DataFrame) -> None:
    """Replace a run's requests.parquet and set its manifest's size and sha256 to the new file's."""
    frame.to_parquet(run / "requests.parquet", index=False)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["files"]["requests.parquet"] = file_entry(run / "requests.parquet")
    (run / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def no_hang():
    """Fail (instead of blocking the suite) when the test takes over 60 s: a FIFO opened for reading blocks."""
    def hung(*_: object) -> None:
        raise AssertionError("blocked reading a FIFO")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def fifo_instead_of(file: Path) -> Path:
    file.unlink()
    os.mkfifo(file)
    return file


@pytest.mark.parametrize("name", ["manifest.json", "summary.json", "requests.parquet"])
def test_a_fifo_in_a_run_makes_it_damaged_never_blocks(res: Path, no_hang: None, name: str) -> None:
    victim = run_dirs(res)[1]
    fifo_instead_of(victim / name)
    table, messages = load_warned(res)
    assert len(table) == RUNS - 1 and len(messages) == 1
    assert victim.name in messages[0] and "FIFO" in messages[0] and "\n" not in messages[0]
    with pytest.raises(ResultsError, match=rf"{name}: is a FIFO \(named pipe\), not a regular file"):
        read_results(victim)
    assert not kvlab.results.is_complete(victim)


def test_resume_over_a_fifo_manifest_is_refused_naming_the_run(res: Path, made: Path, no_hang: None) -> None:
    """kvlab never replaces what it did not write: the run folder is refused (one line), the FIFO kept."""
    victim = run_dirs(res)[0]
    fifo_instead_of(victim / "manifest.json")
    with pytest.raises(ResultsLocationError, match=rf"{victim.name}: holds an unreadable manifest\.json.*FIFO") as got:
        run_experiment(made / "kexp.yaml", res.parent, progress=False)
    assert "\n" not in str(got.value)
    assert (victim / "manifest.json").is_fifo()


def test_a_fifo_as_the_folder_manifest_or_table_never_blocks(res: Path, no_hang: None) -> None:
    fifo_instead_of(res / "sweep.parquet")
    assert "sweep.parquet" in (table_problem(res) or "")
    with pytest.raises(ResultsError, match="is a FIFO"):
        kvlab.results.read_table(res / "sweep.parquet")
    fifo_instead_of(res / "manifest.json")
    assert len(load_warned(res)[0]) == RUNS


def test_read_results_refuses_columns_not_in_the_metric_table(res: Path) -> None:
    run = run_dirs(res)[0]
    good = read_results(run).requests
    assert "hit_tokens" in good
    _rewrite_requests(run, pd.DataFrame({"foo": [1, 2], "bar": ["x", "y"]}))
    with pytest.raises(ResultsError, match=r"requests\.parquet: column 'foo' is not a requests\.parquet column"):
        read_results(run)
    _rewrite_requests(run, good.assign(prompt_tokens=good["prompt_tokens"].astype(str)))
    with pytest.raises(ResultsError, match=r"requests\.parquet: column 'prompt_tokens' is (object|str).*not a "
                                           r"tokens column"):
        read_results(run)
    _rewrite_requests(run, good.drop(columns=["hit_tokens"]))
    with pytest.raises(ResultsError, match=r"requests\.parquet: lacks column 'hit_tokens'"):
        read_results(run)
    _rewrite_requests(run, good.assign(hit_tokens_dram=0))  # a tier column: the pattern entry hit_tokens_<tier>
    assert "hit_tokens_dram" in read_results(run).requests
