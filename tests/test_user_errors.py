"""Issue 10's examples of what a user can do wrong, one test each, against the target behaviour.

Every mistake ends in exit code 2 and ONE ``kvlab: error:`` line on stderr naming the flag, file or field
(no traceback); nothing of the user's is deleted, moved or overwritten; a resumed sweep gives the numbers
a fresh run gives; no command hangs or grows without bound. The last test runs a few cases of each class
of the adversarial catalogue (``benchmarks/robustness.py``) through its classifier.

Most tests call ``kvlab.cli.main`` in-process; the ones that could hang, exhaust memory or need a kill
run the real command line as a subprocess with a timeout and a 4 GiB address-space limit.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from kvlab.cli import main

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT = 60.0
MEM_LIMIT = 4 << 30


def _load_robustness():
    spec = importlib.util.spec_from_file_location("kvlab_robustness", REPO / "benchmarks" / "robustness.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


rb = _load_robustness()


# ------------------------------------------------------------------------------------------ helpers
def cli(capsys, *argv: object) -> tuple[int, str, str]:
    """Run ``kvlab ARGV`` in-process: (exit code, stdout, stderr). An exception escaping main() is a failure."""
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:  # a traceback the user would see
        pytest.fail(f"traceback instead of a clear error: {type(exc).__name__}: {exc}")
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def assert_clear_error(code: int, err: str, *names: str) -> str:
    """Exit 2, exactly one non-empty stderr line, starting ``kvlab: error:``, naming every one of ``names``
    (a flag also matches its field name: ``--block-size`` ~ ``block_size``)."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvlab: error:"), f"expected one 'kvlab: error:' line:\n{err}"
    assert code == 2, f"exit code {code}, expected 2: {lines[0]}"
    for name in names:
        assert rb._mentions(lines[0], name), f"the message does not name {name!r}: {lines[0]}"
    return lines[0]


def run_kvlab(*args: object, cwd: Path, timeout: float = SUBPROCESS_TIMEOUT) -> rb.Run:
    """The real command line in a subprocess (this checkout's kvlab), with a timeout and a memory limit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    popen = subprocess.Popen([sys.executable, "-c", rb._WRAPPER, str(MEM_LIMIT), *map(str, args)], cwd=cwd,
                             env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
    return rb.Proc([str(a) for a in args], popen, timeout).wait()


def assert_verdict(verdict: rb.Verdict, *allowed: str) -> None:
    run = verdict.run
    assert verdict.outcome in allowed, (
        f"{verdict.outcome}: {verdict.detail}\n" + (run.err[-1500:] if run is not None else ""))


def checksums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def same_numbers(got: pd.DataFrame, want: pd.DataFrame) -> None:
    msg = rb.same_table(got, want)
    assert msg is None, msg


@pytest.fixture
def conv(shared_file) -> Path:
    return shared_file("mooncake/conversation_trace.jsonl")


@pytest.fixture
def moon60(conv, tmp_path) -> Path:
    """The first 60 requests of the Mooncake conversation trace."""
    path = tmp_path / "inputs" / "moon60.jsonl"
    path.parent.mkdir()
    path.write_text("".join(conv.read_text().splitlines(keepends=True)[:60]))
    return path


REPLAY = ("--engine", "python", "--quiet")


# ------------------------------------------------------------------------------------------ output locations
def test_replay_into_foreign_folder_keeps_the_users_files(tmp_path, capsys, moon60):
    """``mkdir mydata; echo x > mydata/thesis.tex; kvlab replay ... --out mydata`` deleted thesis.tex."""
    mydata = tmp_path / "mydata"
    mydata.mkdir()
    (mydata / "thesis.tex").write_text("x\n")
    before = checksums(mydata)
    code, _, err = cli(capsys, "replay", moon60, "--capacity-blocks", "100", *REPLAY, "--out", mydata)
    assert_clear_error(code, err, str(mydata))
    assert checksums(mydata) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs", "mydata"]


def test_replay_into_a_sweep_folder_keeps_the_sweep(tmp_path, capsys, moon60):
    """A single replay pointed at a sweep folder wiped the sweep."""
    sweep = tmp_path / "S"
    code, _, err = cli(capsys, "replay", moon60, "--capacity-blocks", "50", "100", *REPLAY, "--out", sweep)
    assert code == 0, err
    before = checksums(sweep)
    code, _, err = cli(capsys, "replay", moon60, "--capacity-blocks", "200", *REPLAY, "--out", sweep)
    assert_clear_error(code, err, str(sweep))
    assert checksums(sweep) == before


def test_out_that_is_a_file_is_not_moved(tmp_path, capsys, moon60):
    """A file given as ``--out`` was moved to a hidden ``.NAME.old-PID``."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    code, _, err = cli(capsys, "replay", moon60, "--capacity-blocks", "100", *REPLAY, "--out", notes)
    assert_clear_error(code, err, str(notes))
    assert notes.read_text() == "my notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs", "notes.txt"]


@pytest.mark.parametrize("name", ["../../escape", "..", "ABSOLUTE"])
def test_trace_header_name_cannot_choose_a_folder_outside_out(tmp_path, capsys, name):
    """A trace header's ``name`` chose the folder ``kvlab sweep`` writes to, absolute paths and ``..`` included:
    the sweep either refuses the name (naming it) or writes only inside ``--out``."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("my thesis\n")
    header = {**rb.NATIVE_HEADER, "name": str(victim) if name == "ABSOLUTE" else name}
    trace = tmp_path / "trace.jsonl"
    trace.write_text(rb.native_text(header))
    out = tmp_path / "a" / "b" / "S"
    out.parent.mkdir(parents=True)
    before = {p for p in tmp_path.rglob("*")}
    code, _, err = cli(capsys, "sweep", trace, "--capacity-blocks", "64", *REPLAY, "--out", out)
    assert (victim / "thesis.tex").read_text() == "my thesis\n"
    escaped = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                     if p not in before and p != out and out not in p.parents)
    assert not escaped, f"the sweep wrote outside --out: {escaped}"
    if code != 0:
        assert_clear_error(code, err, "name")
    else:
        assert len(pd.read_parquet(out / "sweep.parquet")) == 1


# ------------------------------------------------------------------------------------------ resume
def _replay_sweep(capsys, trace: Path, out: Path, *extra: object) -> pd.DataFrame:
    code, _, err = cli(capsys, "replay", trace, "--capacity-blocks", "100", "200", *REPLAY, *extra, "--out", out)
    assert code == 0, err
    return pd.read_parquet(out / "sweep.parquet")


def test_resume_with_another_limit_gives_the_new_numbers(tmp_path, capsys, conv):
    """``--limit 50 --block-size 512 --capacity-blocks 100 200 --out S`` then ``--limit 2000`` printed the
    first run's numbers."""
    _replay_sweep(capsys, conv, tmp_path / "S", "--limit", "50", "--block-size", "512")
    got = _replay_sweep(capsys, conv, tmp_path / "S", "--limit", "2000", "--block-size", "512")
    fresh = _replay_sweep(capsys, conv, tmp_path / "fresh", "--limit", "2000", "--block-size", "512")
    assert list(fresh["requests"]) == [2000, 2000]
    same_numbers(got, fresh)


def test_resume_with_another_trace_gives_its_numbers(tmp_path, capsys, conv, shared_file):
    """The same as above with another trace into the same folder."""
    synth = shared_file("mooncake/synthetic_trace.jsonl")
    _replay_sweep(capsys, conv, tmp_path / "S", "--limit", "50", "--block-size", "512")
    got = _replay_sweep(capsys, synth, tmp_path / "S", "--limit", "50", "--block-size", "512")
    fresh = _replay_sweep(capsys, synth, tmp_path / "fresh", "--limit", "50", "--block-size", "512")
    same_numbers(got, fresh)


def test_resume_without_block_size_reads_finished_runs_back(tmp_path, capsys, moon60):
    """Without ``--block-size`` nothing ever resumed: the second identical command must replay nothing."""
    first = _replay_sweep(capsys, moon60, tmp_path / "S")
    runs = rb._run_files(tmp_path / "S")
    assert runs, "no per-run requests.parquet under S"
    again = _replay_sweep(capsys, moon60, tmp_path / "S")
    assert rb._run_files(tmp_path / "S") == runs, "finished runs were replayed again instead of read back"
    same_numbers(again, first)


# ------------------------------------------------------------------------------------------ parameters
def test_simulate_rate_nan_is_refused(tmp_path, moon60):
    """``kvlab simulate trace.jsonl --rate nan`` looped forever."""
    run = run_kvlab("simulate", moon60, "--limit", "20", "--quiet", "--rate", "nan", cwd=tmp_path)
    assert_verdict(rb.judge_error(run, ["--rate"], range_hint=True), "clear error")
    assert run.rc == 2


def test_slru_billion_segments_stays_bounded(tmp_path, moon60):
    """``--policy slru --policy-param segments=1000000000`` grew to 24 GB: refused (naming the parameter) or
    run correctly within 4 GiB."""
    run = run_kvlab("replay", moon60, "--capacity-blocks", "100", "--policy", "slru", "--policy-param",
                    "segments=1000000000", "--quiet", "--out", tmp_path / "R", cwd=tmp_path)
    assert_verdict(rb.judge_either(run, ["segments"], lambda: rb.sane_summary(
        json.loads((tmp_path / "R" / "summary.json").read_text()), 60)), "clear error", "correct result")


def test_trillion_block_capacity_stays_bounded(tmp_path, moon60):
    """``--capacity-blocks 1000000000000`` exhausted memory: refused (naming the flag) or run within 4 GiB as
    the infinite cache it is (hit rate = ideal hit rate, no evictions)."""
    run = run_kvlab("replay", moon60, "--capacity-blocks", "1000000000000", "--quiet", "--out", tmp_path / "R",
                    cwd=tmp_path)

    def check() -> str | None:
        s = json.loads((tmp_path / "R" / "summary.json").read_text())
        if s["evictions"] or abs(s["token_hit_rate"] - s["ideal_hit_rate"]) > 1e-12:
            return f"not an infinite cache: {s['evictions']} evictions, hit rate {s['token_hit_rate']}"
        return rb.sane_summary(s, 60)

    assert_verdict(rb.judge_either(run, ["--capacity-blocks"], check), "clear error", "correct result")


COMMANDS = {
    "replay": ["replay", "{trace}", "--capacity-blocks", "100", *REPLAY],
    "sweep": ["sweep", "{trace}", "--capacity-blocks", "100", *REPLAY, "--out", "{tmp}/S"],
    "simulate": ["simulate", "{trace}", "--quiet"],
    "trace stats": ["trace", "stats", "{trace}"],
}


def _argv(command: str, trace: Path, tmp: Path, *extra: str) -> list[str]:
    return [a.format(trace=trace, tmp=tmp) for a in COMMANDS[command]] + list(extra)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_block_size_zero_is_refused(tmp_path, capsys, moon60, command):
    """``--block-size 0`` silently ran at the default block size while the manifest recorded 0."""
    code, _, err = cli(capsys, *_argv(command, moon60, tmp_path, "--block-size", "0"))
    assert_clear_error(code, err, "--block-size")
    assert not (tmp_path / "S").exists()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_limit_zero_is_refused(tmp_path, capsys, moon60, command):
    """``--limit 0`` replayed everything."""
    code, _, err = cli(capsys, *_argv(command, moon60, tmp_path, "--limit", "0"))
    assert_clear_error(code, err, "--limit")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_negative_limit_is_refused(tmp_path, capsys, moon60, command):
    """``--limit -5`` dropped the last five requests."""
    code, _, err = cli(capsys, *_argv(command, moon60, tmp_path, "--limit", "-5"))
    assert_clear_error(code, err, "--limit")


# ------------------------------------------------------------------------------------------ kill, concurrency
SWEEP30 = ["--policy", "lru", "fifo", "lfu", "--capacity-blocks", "50", "100", "200", "400", "800", "--mode", "vllm",
           "ideal", *REPLAY]


def test_killed_sweep_rerun_keeps_the_complete_table(tmp_path, capsys, conv):
    """Killing a sweep at a random moment replaced a complete 30-row sweep.parquet with a partial table.
    Here the rerun (``--no-resume``) is killed the moment any of its tables changes on disk; every table
    must still be the complete one (or an equally complete new one), and a resume must match."""
    trace = tmp_path / "moon300.jsonl"
    trace.write_text("".join(conv.read_text().splitlines(keepends=True)[:300]))
    out = tmp_path / "S"
    code, _, err = cli(capsys, "sweep", trace, *SWEEP30, "--out", out)
    assert code == 0, err
    complete = {p: pd.read_parquet(p) for p in out.rglob("sweep.parquet")}
    assert complete and all(len(t) == 30 for t in complete.values())
    stamps = rb._tables(out)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.cli", "sweep", str(trace), *SWEEP30, "--no-resume",
                             "--out", str(out)], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline and rb._tables(out) == stamps:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    err = proc.communicate()[1].decode(errors="replace")
    assert "Traceback" not in err, err
    for path, table in complete.items():
        assert path.is_file(), f"{path.relative_to(out)} is gone after the kill"
        same_numbers(pd.read_parquet(path), table)
    code, _, err = cli(capsys, "sweep", trace, *SWEEP30, "--out", out)
    assert code == 0, err
    same_numbers(pd.read_parquet(out / "sweep.parquet"), complete[out / "sweep.parquet"])


def test_two_sweeps_on_one_folder(tmp_path, capsys, moon60):
    """Two sweeps on one folder: one died on the shared temporary file. Both must finish (or one refuse
    with a clear message), and the folder must hold a fresh run's numbers."""
    args = ["sweep", moon60, "--policy", "lru", "fifo", "lfu", "--capacity-blocks", "30", "50", "70", "100", "150",
            "200", "300", "400", *REPLAY]
    code, _, err = cli(capsys, *args, "--out", tmp_path / "fresh")
    assert code == 0, err
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-m", "kvlab.cli", *map(str, args), "--out", str(tmp_path / "S")],
                              cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for _ in range(2)]
    results = []
    for p in procs:
        try:
            results.append((p.wait(SUBPROCESS_TIMEOUT), p.stderr.read().decode(errors="replace")))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a sweep hung")
    for rc, err in results:
        assert "Traceback" not in err, err
        if rc != 0:
            assert rc == 2 and err.strip().splitlines()[-1].startswith("kvlab: error:"), err
    assert any(rc == 0 for rc, _ in results)
    same_numbers(pd.read_parquet(tmp_path / "S" / "sweep.parquet"), pd.read_parquet(tmp_path / "fresh" /
                                                                                     "sweep.parquet"))


# ------------------------------------------------------------------------------------------ rejected requests
def test_rejected_requests_in_every_table_printout_and_figure(tmp_path, capsys, moon60):
    """The demo rejected 1,005 of 2,000 requests at 64 blocks and only one parquet column said so: rejected
    requests must appear in every summary table, printout and figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.plots import plot_hit_rate_vs_capacity

    code, out, err = cli(capsys, "replay", moon60, "--capacity-blocks", "5", "100", *REPLAY, "--out",
                         tmp_path / "S")
    assert code == 0, err
    table = pd.read_parquet(tmp_path / "S" / "sweep.parquet")
    assert table["rejected_requests"].iloc[0] > 0
    assert "reject" in out.replace(str(tmp_path), "").lower(), f"the printout does not show rejections:\n{out}"
    code, out, err = cli(capsys, "replay", moon60, "--capacity-blocks", "5", *REPLAY)
    assert code == 0, err
    assert "reject" in out.replace(str(tmp_path), "").lower(), f"the printout does not show rejections:\n{out}"
    fig, ax = plt.subplots()
    try:
        plot_hit_rate_vs_capacity(table, ax=ax)
        texts = [t.get_text() for t in ax.texts] + [t.get_text() for t in ax.get_legend().get_texts()]
    finally:
        plt.close(fig)
    assert any("reject" in t for t in texts), texts


def test_demo_summary_has_rejected_requests(tmp_path, capsys):
    """The demo's summary.csv, like its sweep.parquet, says how many requests each run rejected."""
    code, out, err = cli(capsys, "demo", "--quick", "--quiet", "--out", tmp_path / "D")
    assert code == 0, err
    header = (tmp_path / "D" / "summary.csv").read_text().splitlines()[0]
    assert "rejected" in header, header
    table = pd.read_parquet(tmp_path / "D" / "sweep.parquet")
    if (table["rejected_requests"] > 0).any():
        assert "reject" in out.replace(str(tmp_path), "").lower(), out


# ------------------------------------------------------------------------------------------ the catalogue
SUBSET = [
    "trace.mooncake.truncated",  # malformed trace
    "trace.permission-denied",
    "replay.limit.0",  # bad parameter
    "replay.policy-param.lru.bogus-1",
    "out.replay-existing-file",  # output location
    "name.dotdot",
    "sigint.single-replay",  # interruption
    "two-sweeps.same.0",  # concurrency
    "corrupt.summary-garbled",  # corrupt result
    "res.trace-int64-overflow",  # resource exhaustion
]


def test_catalogue_subset_has_no_severe_failures(shared_traces):
    """A case or two per class of benchmarks/robustness.py: none may end in a traceback, a silent wrong
    result, a hang, data loss or a crash."""
    cases = rb.select(ids=SUBSET)
    assert {c.cls for c in cases} == set(rb.CLASSES) - set(rb.SURFACE_CLASSES)  # issue 23's: test_new_surfaces
    results = rb.run_cases(cases, jobs=2, opts=rb.Options(pythonpath=str(REPO), traces=shared_traces))
    bad = [f"{r.case.id}: {r.outcome}: {r.verdict.detail}" for r in results
           if r.outcome in (*rb.SEVERE, "crash/oom", "harness error")]
    assert not bad, "\n".join(bad)
