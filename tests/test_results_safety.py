"""Result folders, run identity and sweep safety (issue 10): kvlab never deletes or moves what it did not
write, replaces its own results atomically, identifies runs by everything that changes their numbers, and
names the file and the problem when a result is damaged."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
import threading
from pathlib import Path

import pandas as pd
import pytest

import kvlab.results.paths as paths_mod
import kvlab.sweep as sweep_mod
from kvlab.errors import KvlabError, ResultsError, ResultsLocationError
from kvlab.replay import ReplayConfig, replay, resolve_config
from kvlab.results import (
    SEMANTICS_VERSION,
    build_manifest,
    check_output_location,
    is_complete,
    read_results,
    run_id,
    run_identity,
    safe_name,
    write_results,
)
from kvlab.results.paths import TEMP_RE, clean_stale, temp_prefix
from kvlab.sweep import grid, read_sweep, run_sweep, run_sweeps
from kvlab.workload.generate import synthetic_chat


@pytest.fixture(scope="module")
def chat():
    return synthetic_chat(60, seed=0)


def _write_run(out: Path, value: int = 1) -> Path:
    frame = pd.DataFrame({"x": [value, value + 1]})
    manifest = build_manifest({"value": value}, driver="test")
    return write_results(out, {"requests": frame}, {"value": value}, manifest)


def _entries(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def _python_grid(capacities=(8, 32), **kw) -> list[ReplayConfig]:
    return grid(capacities, policies=["lru"], engine="python", **kw)


# ----------------------------------------------------------------------------- refused locations
def test_folder_with_foreign_files_is_refused_and_untouched(tmp_path):
    mydata = tmp_path / "mydata"
    mydata.mkdir()
    (mydata / "thesis.tex").write_text("x\n")
    with pytest.raises(ResultsLocationError, match="not empty and holds no kvlab result") as info:
        _write_run(mydata)
    assert str(mydata) in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, KvlabError)
    assert _entries(mydata) == ["thesis.tex"] and (mydata / "thesis.tex").read_text() == "x\n"
    assert _entries(tmp_path) == ["mydata"]


def test_file_as_out_is_refused_not_moved(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    for kind in ("run", "sweep"):
        with pytest.raises(ResultsLocationError, match="is a file"):
            check_output_location(f, kind)
    with pytest.raises(ResultsLocationError, match="is a file"):
        _write_run(f)
    assert f.read_text() == "keep me" and _entries(tmp_path) == ["notes.txt"]


def test_symlink_and_paths_below_a_file_are_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ResultsLocationError, match="symbolic link"):
        check_output_location(tmp_path / "link")
    (tmp_path / "file").write_text("")
    with pytest.raises(ResultsLocationError, match="is a file, not a folder"):
        check_output_location(tmp_path / "file" / "sub" / "out")


def test_unwritable_location_is_refused_without_creating_anything(tmp_path):
    with pytest.raises(ResultsLocationError, match="cannot write"):
        check_output_location("/proc/kvlab-no-such/out")
    locked_dir = tmp_path / "ro"
    locked_dir.mkdir()
    locked_dir.chmod(0o500)
    try:
        probe = locked_dir / "p"
        try:
            probe.write_text("")
            probe.unlink()
            writable = True  # root ignores permission bits
        except PermissionError:
            writable = False
        if not writable:
            with pytest.raises(ResultsLocationError, match="cannot write"):
                check_output_location(locked_dir / "out")
        assert _entries(locked_dir) == []
    finally:
        locked_dir.chmod(0o700)


def test_check_creates_nothing(tmp_path):
    out = check_output_location(tmp_path / "a" / "b" / "out", "run")
    assert out.is_absolute() and _entries(tmp_path) == []
    check_output_location(tmp_path, "sweep")  # empty folder: accepted
    assert _entries(tmp_path) == []


def test_sweep_and_run_folders_are_not_interchangeable(tmp_path, chat):
    sweep_dir = tmp_path / "S"
    run_sweep(chat, _python_grid(), sweep_dir, progress=False)
    before = {p: p.stat().st_mtime_ns for p in sweep_dir.rglob("*")}
    with pytest.raises(ResultsLocationError, match="holds a kvlab sweep, not a run"):
        replay(chat, capacity_blocks=8, block_size=16).save(sweep_dir)
    with pytest.raises(ResultsLocationError, match="holds a kvlab sweep, not a sweeps"):
        run_sweeps([chat], _python_grid(), sweep_dir, progress=False)
    assert {p: p.stat().st_mtime_ns for p in sweep_dir.rglob("*")} == before
    run_dir = _write_run(tmp_path / "R")
    with pytest.raises(ResultsLocationError, match="holds a kvlab run, not a sweep"):
        run_sweep(chat, _python_grid(), run_dir, progress=False)
    assert is_complete(run_dir)


def test_sweep_refuses_foreign_folder_before_any_replay(tmp_path, chat, monkeypatch):
    (tmp_path / "data.csv").write_text("1,2\n")
    monkeypatch.setattr(sweep_mod, "replay", lambda *a, **k: pytest.fail("replayed before refusing"))
    with pytest.raises(ResultsLocationError, match="not empty"):
        run_sweep(chat, _python_grid(), tmp_path, progress=False)
    assert _entries(tmp_path) == ["data.csv"]


def test_damaged_sweep_manifest_is_named(tmp_path, chat):
    out = tmp_path / "S"
    run_sweep(chat, _python_grid((8,)), out, progress=False)
    (out / "manifest.json").write_text('{"manifest_version": 1, "kin')
    with pytest.raises(ResultsLocationError, match=r"unreadable manifest\.json \(JSONDecodeError"):
        run_sweep(chat, _python_grid((8,)), out, progress=False)
    (out / "manifest.json").write_text('{"mine": 1}')  # a user's own manifest.json: not kvlab's
    with pytest.raises(ResultsLocationError, match="holds no kvlab result"):
        check_output_location(out, "sweep")


def test_another_writers_temporary_does_not_make_a_folder_foreign(tmp_path):
    (tmp_path / f"{temp_prefix('manifest.json')}x1y2").write_text("")  # a concurrent sweep starting up
    (tmp_path / ".kvlab-probe.abc").write_text("")
    assert check_output_location(tmp_path, "sweep") == tmp_path


def test_run_folder_with_foreign_file_is_refused(tmp_path):
    out = _write_run(tmp_path / "run")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ResultsLocationError, match=r"files kvlab did not write \(notes.txt\)"):
        _write_run(out, 5)
    assert (out / "notes.txt").read_text() == "mine"
    assert read_results(out).summary == {"value": 1}


# ----------------------------------------------------------------------------- atomic replacement
def test_replacement_exchanges_atomically_here(tmp_path, monkeypatch):
    calls = []
    real = paths_mod.exchange
    monkeypatch.setattr(paths_mod, "exchange", lambda a, b: (calls.append((a, b)), real(a, b)))
    out = _write_run(tmp_path / "run", 1)
    assert calls == []  # created by a plain rename
    _write_run(out, 2)
    assert len(calls) == 1, "renameat2(RENAME_EXCHANGE) should be used on this file system"
    assert read_results(out).summary == {"value": 2}
    assert _entries(tmp_path) == ["run"]  # the old copy deleted, no temporaries left


def test_fallback_when_exchange_is_refused(tmp_path, monkeypatch):
    def refuse(a, b):
        raise OSError(errno.EINVAL, "no exchange here")

    monkeypatch.setattr(paths_mod, "exchange", refuse)
    out = _write_run(tmp_path / "run", 1)
    _write_run(out, 2)
    assert read_results(out).summary == {"value": 2}
    assert _entries(tmp_path) == ["run"]


def test_no_instant_without_a_complete_run(tmp_path):
    out = _write_run(tmp_path / "run", 0)
    stop = threading.Event()
    seen: list[str] = []

    def reader():
        while not stop.is_set():
            try:
                seen.append(str(read_results(out).summary["value"]))
            except Exception as exc:  # noqa: BLE001 - any failure to read is the bug looked for
                seen.append(f"error {exc}")

    t = threading.Thread(target=reader)
    t.start()
    try:
        for v in range(1, 25):
            _write_run(out, v)
    finally:
        stop.set()
        t.join()
    errors = [s for s in seen if s.startswith("error")]
    assert not errors, errors[:3]
    assert len(seen) > 5
    assert _entries(tmp_path) == ["run"]


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    out = _write_run(tmp_path / "run", 1)
    monkeypatch.setattr(pd.DataFrame, "to_parquet", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        _write_run(out, 2)
    assert read_results(out).summary == {"value": 1} and _entries(tmp_path) == ["run"]


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_permissions_follow_the_umask(tmp_path, chat, mask):
    old = os.umask(mask)
    try:
        run = _write_run(tmp_path / "run")
        sweep_dir = tmp_path / "sweep"
        run_sweep(chat, _python_grid((8,)), sweep_dir, progress=False)
    finally:
        os.umask(old)
    dirs = [run, sweep_dir, sweep_dir / "runs", *(sweep_dir / "runs").iterdir(), sweep_dir / ".locks"]
    files = [p for d in dirs for p in d.iterdir() if p.is_file()]
    assert files and all(stat.S_IMODE(d.stat().st_mode) == 0o777 & ~mask for d in dirs)
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask for f in files)


# ----------------------------------------------------------------------------- identity
def test_identity_covers_trace_content_limit_block_size_and_params(chat):
    trace = chat.identity()
    base = resolve_config(chat, ReplayConfig(capacity_blocks=100))
    ident = run_identity(base.to_dict(), trace)
    assert ident["semantics_version"] == SEMANTICS_VERSION
    assert set(ident["trace"]) == {"content_sha256", "kind", "trace_block_size"}
    rid = run_id(ident)
    assert len(rid) >= 16 and rid == run_id(json.loads(json.dumps(ident)))
    # defaults filled in: giving the default block size or policy parameters explicitly is the same run
    explicit = resolve_config(chat, ReplayConfig(capacity_blocks=100, block_size=16))
    assert run_id(run_identity(explicit.to_dict(), trace)) == rid
    s3 = resolve_config(chat, ReplayConfig(capacity_blocks=100, policy="s3fifo"))
    s3_explicit = resolve_config(chat, ReplayConfig(capacity_blocks=100, policy="s3fifo",
                                                    policy_params={"small_ratio": 0.1}))
    assert run_id(run_identity(s3.to_dict(), trace)) == run_id(run_identity(s3_explicit.to_dict(), trace))
    # anything that changes numbers changes the id
    other = [
        run_identity(base.to_dict(), chat.head(50).identity()),
        run_identity(base.to_dict(), synthetic_chat(60, seed=1).identity()),
        run_identity(resolve_config(chat, ReplayConfig(capacity_blocks=100, block_size=32)).to_dict(), trace),
        run_identity(resolve_config(chat, ReplayConfig(capacity_blocks=100, policy="s3fifo",
                                                       policy_params={"small_ratio": 0.2})).to_dict(), trace),
        {**ident, "semantics_version": SEMANTICS_VERSION + 1},
    ]
    ids = {run_id(i) for i in other}
    assert rid not in ids and len(ids) == len(other)
    # a renamed trace file is the same trace
    renamed = dataclasses.replace(chat, name="renamed")
    assert run_id(run_identity(base.to_dict(), renamed.identity())) == rid
    with pytest.raises(ValueError, match="content_sha256"):
        run_identity(base.to_dict(), {"sha256": "x"})


def test_sweep_resumes_with_or_without_block_size(tmp_path, chat, monkeypatch):
    first = run_sweep(chat, _python_grid(), tmp_path / "S", progress=False)
    monkeypatch.setattr(sweep_mod, "replay", lambda *a, **k: pytest.fail("a complete run was replayed again"))
    again = run_sweep(chat, _python_grid(block_size=16), tmp_path / "S", progress=False)
    pd.testing.assert_frame_equal(first, again)


def test_another_limit_or_trace_is_computed_and_the_table_grows(tmp_path, chat):
    out = tmp_path / "S"
    small = run_sweep(chat.head(20), _python_grid(), out, progress=False)
    full = run_sweep(chat, _python_grid(), out, progress=False)
    other = run_sweep(synthetic_chat(60, seed=3), _python_grid(), out, progress=False)
    assert list(small["requests"]) == [20, 20] and list(full["requests"]) == [60, 60]
    assert full["token_hit_rate"].tolist() == [replay(chat, c).summary["token_hit_rate"] for c in _python_grid()]
    assert set(small["run_id"]).isdisjoint(full["run_id"]) and set(other["run_id"]).isdisjoint(full["run_id"])
    table = read_sweep(out)
    assert len(table) == 6 and set(table["run_id"]) == {*small["run_id"], *full["run_id"], *other["run_id"]}
    assert table["trace_sha256"].nunique() == 3


def test_build_manifest_records_identity_and_files(tmp_path, chat):
    res = replay(chat, capacity_blocks=8, block_size=16)
    config = resolve_config(chat, res.config).to_dict()
    manifest = build_manifest(config, trace={**res.trace, **chat.identity()}, seed=0, driver="replay")
    out = write_results(tmp_path / "run", {"requests": res.requests}, res.summary, manifest)
    m = json.loads((out / "manifest.json").read_text())
    assert m["run_id"] == run_id(run_identity(config, chat.identity())) and m["semantics_version"] == SEMANTICS_VERSION
    assert set(m["files"]) == {"requests.parquet", "summary.json"}
    assert m["files"]["summary.json"]["bytes"] == (out / "summary.json").stat().st_size
    assert is_complete(out, m["identity"]) and is_complete(out, m["run_id"]) and not is_complete(out, "0" * 20)


# ----------------------------------------------------------------------------- damaged results
def _damaged_run(tmp_path: Path) -> Path:
    return write_results(tmp_path / "run", {"requests": pd.DataFrame({"x": range(1000)})}, {"v": 1},
                         build_manifest({}, driver="test"))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p: (p / "requests.parquet").unlink(), r"requests\.parquet: missing"),
        (lambda p: (p / "requests.parquet").write_bytes((p / "requests.parquet").read_bytes()[:-50]),
         r"requests\.parquet: \d+ bytes, but manifest\.json records \d+ \(truncated"),
        (lambda p: (p / "summary.json").write_text((p / "summary.json").read_text().replace("1", "2")),
         r"summary\.json: sha256 differs"),
        (lambda p: (p / "manifest.json").write_text((p / "manifest.json").read_text()[:40]),
         r"manifest\.json: not valid JSON \(.* at line \d+"),
        (lambda p: (p / "manifest.json").unlink(), r"not a kvlab results folder \(no manifest\.json\)"),
    ],
)
def test_damaged_run_names_the_file_and_the_problem(tmp_path, damage, match):
    out = _damaged_run(tmp_path)
    damage(out)
    with pytest.raises(ResultsError, match=match) as info:
        read_results(out)
    assert "\n" not in str(info.value)
    assert not is_complete(out)


def test_unlisted_tables_are_checked_by_parquet(tmp_path):
    out = _damaged_run(tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["files"]  # a manifest from before checksums
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "requests.parquet").write_bytes((out / "requests.parquet").read_bytes()[:-50])
    with pytest.raises(ResultsError, match=r"requests\.parquet: not a readable parquet table"):
        read_results(out)


def test_damaged_sweep_table_names_the_file(tmp_path, chat):
    out = tmp_path / "S"
    run_sweep(chat, _python_grid(), out, progress=False)
    (out / "sweep.parquet").write_bytes((out / "sweep.parquet").read_bytes()[:100])
    with pytest.raises(ResultsError, match=r"sweep\.parquet: not a readable parquet"):
        read_sweep(out)
    run_sweep(chat, _python_grid(), out, progress=False)  # a resumed sweep rebuilds it from the runs
    assert len(read_sweep(out)) == 2


def test_corrupt_run_is_recomputed_by_a_resumed_sweep(tmp_path, chat):
    out = tmp_path / "S"
    first = run_sweep(chat, _python_grid(), out, progress=False)
    victim = out / "runs" / first["run_id"][0] / "requests.parquet"
    victim.write_bytes(victim.read_bytes()[:-10])
    again = run_sweep(chat, _python_grid(), out, progress=False)
    cols = [c for c in first.columns if c not in sweep_mod.TIMING_COLUMNS]
    pd.testing.assert_frame_equal(first[cols], again[cols])
    assert all(is_complete(p) for p in (out / "runs").iterdir())


# ----------------------------------------------------------------------------- names and leftovers
@pytest.mark.parametrize("text", ["../../etc/passwd", "", ".", "..", ".hidden", "-rf", "a/b\\c", "x" * 300,
                                  "naïve trace", "con:1", "a\x00b", "runs\n"])
def test_safe_name(text):
    name = safe_name(text)
    assert name and len(name) <= 96 and ".." not in name and not name.startswith((".", "-"))
    assert all(c.isascii() and (c.isalnum() or c in "._-") for c in name)
    assert name != text  # each of these needed changing, so it carries a hash suffix


def test_safe_name_keeps_safe_names_and_separates_inputs():
    assert safe_name("conversation_trace-1.jsonl") == "conversation_trace-1.jsonl"
    assert safe_name("a b") != safe_name("a_b") == "a_b"
    assert safe_name("a/b") != safe_name("a?b")


def test_trace_names_become_safe_distinct_folders(tmp_path, chat):
    evil = dataclasses.replace(chat, name="../../escape")
    runs_named = dataclasses.replace(synthetic_chat(30, seed=5), name="runs")
    twin = dataclasses.replace(synthetic_chat(30, seed=6), name="../../escape")  # same name, other content
    table = run_sweeps([evil, runs_named, twin], _python_grid((8,)), tmp_path / "out", progress=False)
    assert _entries(tmp_path) == ["out"]
    subs = sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(subs) == 3 and "runs" not in subs and all(safe_name(s) == s for s in subs)
    combined = pd.read_parquet(tmp_path / "out" / "sweep.parquet")
    assert len(table) == 3 and sorted(combined["run_id"]) == sorted(table["run_id"])
    assert (tmp_path / "out" / "sweep.csv").exists()


def test_stale_temporaries_of_dead_writers_are_removed_others_kept(tmp_path):
    dead_pid = 2**22 + 12345  # above the default pid_max: never a live process
    prefix = temp_prefix("run").replace(f".{os.getpid()}.", f".{dead_pid}.")
    stale = tmp_path / f"{prefix}abc"
    stale.mkdir()
    (stale / "requests.parquet").write_bytes(b"partial")
    alive = tmp_path / f"{temp_prefix('run').replace(f'.{os.getpid()}.', '.1.')}abc"
    alive.mkdir()
    foreign = tmp_path / f"{prefix}def"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("x")
    user_hidden = tmp_path / ".run.old-123"
    user_hidden.mkdir()
    assert TEMP_RE.match(stale.name) and TEMP_RE.match(alive.name)
    assert clean_stale(tmp_path) == [stale]
    assert sorted(_entries(tmp_path)) == sorted([alive.name, foreign.name, user_hidden.name])
    assert (foreign / "thesis.tex").read_text() == "x"
