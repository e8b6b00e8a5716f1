"""The adversarial catalogue of issue 10: what a new user can do wrong, and what kvlab does about it.

Every case sets up its own temporary folder (sentinel files of the "user" with checksums where data
loss is possible), runs the real command line as a subprocess (``python -m kvlab.cli ...``, with a
per-command timeout and an address-space limit) and classifies the outcome automatically:

* **clear error**: exit status != 0, no ``Traceback`` on stderr, the last non-empty stderr line starts
  with ``kvlab: error:`` and (where the case says so) names the flag, field, file or line, and for
  ranges gives a hint of the allowed range;
* **correct result**: exit status 0 and the case's own check of the output passes (resume cases: the
  numbers equal a fresh run's; valid but unusual inputs: sane results);
* failures: **unclear error** (non-zero exit without a one-line ``kvlab: error:`` naming what is wrong,
  e.g. argparse's usage block), **refused valid input** (a clear error for an input that is valid),
  **traceback**, **silent wrong** (exit 0 but the check fails, or a bad input accepted), **hang** (the
  timeout), **data loss** (a sentinel changed or missing, or a complete earlier result replaced by a
  partial or wrong one) and **crash/oom** (MemoryError, a signal, or the address-space limit).

Classes: malformed trace, bad parameter, output location, interruption, concurrency, corrupt result,
resource exhaustion (issue 10), and issue 23's surfaces, registered from ``robustness_surfaces.py``: experiment
file, tier spec, simulator flags, layout study, text/tokenizer, figures, results tables, Python API. The
acceptance criterion is zero in every failure column for all of them.

Run::

    python benchmarks/robustness.py                    # every case, table + failures
    python benchmarks/robustness.py --only interruption --jobs 2 --json /tmp/robust.json
    python benchmarks/robustness.py --list
    python benchmarks/robustness.py --new --json /tmp/surfaces.json    # issue 23's classes only
    python benchmarks/robustness.py --pythonpath /tmp/kvlab-snapshot   # test another copy of kvlab

Inputs are small slices of ``../shared/traces`` (``--traces``) written into the run's temporary folder;
nothing outside that folder is written (``KVLAB_CACHE`` points into it, network access goes to a closed
local proxy port so that ``kvlab download`` fails fast instead of fetching).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACES = REPO.parent / "shared" / "traces"



def _load_surfaces():
    """benchmarks/robustness_surfaces.py (issue 23's classes and cases), loaded by path: this file also runs as
    a script and is loaded by path from the tests, so it is not a package import."""
    spec = importlib.util.spec_from_file_location("kvlab_robustness_surfaces",
                                                  Path(__file__).resolve().with_name("robustness_surfaces.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


surfaces = _load_surfaces()
SURFACE_CLASSES: tuple[str, ...] = surfaces.CLASSES
CLASSES = (
    "malformed trace",
    "bad parameter",
    "output location",
    "interruption",
    "concurrency",
    "corrupt result",
    "resource exhaustion",
    *SURFACE_CLASSES,
)
OUTCOMES = (
    "clear error",
    "correct result",
    "unclear error",
    "refused valid input",
    "traceback",
    "silent wrong",
    "hang",
    "data loss",
    "crash/oom",
    "harness error",
)
GOOD = ("clear error", "correct result")
#: the issue's "last four columns": must be zero for everything a user can cause
SEVERE = ("traceback", "silent wrong", "hang", "data loss")

DEFAULT_TIMEOUT = 30.0
DEFAULT_MEM_GIB = 4.0
ERROR_PREFIX = "kvlab: error:"
RANGE_HINT = re.compile(
    r"(>=|<=|>|<|≥|≤|at least|at most|between|positive|non-negative|range|finite|one of|must be|multiple of)",
    re.IGNORECASE,
)
#: summary metrics compared between a resumed/interrupted run and a fresh one (timings excluded)
METRICS = ("requests", "prompt_tokens", "reused_tokens", "token_hit_rate", "block_hit_rate", "request_hit_rate",
           "evictions", "rejected_requests", "ideal_hit_rate")
ROW_KEYS = ("trace", "policy", "capacity_blocks", "mode")


# ------------------------------------------------------------------------------------------ running
@dataclass
class Run:
    """One finished (or killed) command."""

    argv: list[str]
    rc: int | None
    out: str
    err: str
    seconds: float
    timed_out: bool = False
    killed_by_us: bool = False

    @property
    def lines(self) -> list[str]:
        return [ln for ln in self.err.replace("\r", "\n").splitlines() if ln.strip()]

    @property
    def last_line(self) -> str:
        lines = self.lines
        return lines[-1].strip() if lines else ""

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.err

    @property
    def out_of_memory(self) -> bool:
        return any(s in self.err for s in ("MemoryError", "std::bad_alloc", "Cannot allocate memory",
                                           "Unable to allocate", "out of memory"))

    @property
    def crashed(self) -> bool:
        """Killed by a signal we did not send (SIGKILL from the kernel, SIGSEGV, SIGABRT...)."""
        return self.rc is not None and self.rc < 0 and not self.killed_by_us

    def record(self) -> dict:
        return {"argv": self.argv, "rc": self.rc, "seconds": round(self.seconds, 2), "timed_out": self.timed_out,
                "stderr_tail": self.err[-2000:], "stdout_tail": self.out[-600:]}


@dataclass
class Verdict:
    outcome: str
    detail: str = ""
    run: Run | None = None


_WRAPPER = (
    "import os, resource, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_DFL)  # a harness started in the background may ignore it\n"
    "lim = int(sys.argv[1])\n"
    "if lim > 0:\n"
    "    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'kvlab.cli', *sys.argv[2:]])\n"
)


class Proc:
    """A started command (for interruption and concurrency cases)."""

    def __init__(self, argv: list[str], popen: subprocess.Popen, timeout: float) -> None:
        self.argv, self.popen, self.timeout = argv, popen, timeout
        self.t0 = time.monotonic()
        self.killed_by_us = False
        self._out: list[bytes] = []
        self._err: list[bytes] = []
        self._threads = [threading.Thread(target=self._drain, args=(popen.stdout, self._out), daemon=True),
                         threading.Thread(target=self._drain, args=(popen.stderr, self._err), daemon=True)]
        for t in self._threads:
            t.start()

    @staticmethod
    def _drain(stream, sink: list[bytes]) -> None:
        for chunk in iter(lambda: stream.read1(65536), b""):
            sink.append(chunk)

    def send(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.killed_by_us = True
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float | None = None) -> Run:
        timeout = self.timeout if timeout is None else timeout
        timed_out = False
        try:
            self.popen.wait(timeout=max(0.1, timeout - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)  # the process group this Proc created
            self.popen.wait()
        for t in self._threads:
            t.join(5)
        return Run(self.argv, self.popen.returncode, b"".join(self._out).decode(errors="replace"),
                   b"".join(self._err).decode(errors="replace"), time.monotonic() - self.t0, timed_out,
                   self.killed_by_us)


@dataclass
class Options:
    timeout: float = DEFAULT_TIMEOUT
    mem_bytes: int = int(DEFAULT_MEM_GIB * (1 << 30))
    pythonpath: str | None = None
    traces: Path = DEFAULT_TRACES
    seed: int = 0


class Runner:
    """Shared state of one catalogue run: the temp root, the prepared inputs, cached reference runs."""

    def __init__(self, root: Path, opts: Options) -> None:
        self.root, self.opts = root, opts
        self.inputs = root / "inputs"
        self.refs: dict[str, tuple[Run, Path]] = {}
        self._ref_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self.env = dict(os.environ)
        if opts.pythonpath:
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [opts.pythonpath, self.env.get("PYTHONPATH")]))
        self.env.update({
            "KVLAB_TRACE_DIRS": str(opts.traces),
            "KVLAB_CACHE": str(root / "kvlab-cache"),
            "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
            "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
            "no_proxy": "", "NO_PROXY": "",
            "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        })
        self.env.pop("KVLAB_DEBUG", None)
        prepare_inputs(self.inputs, opts.traces)

    def command(self, args: Sequence[str], drop_dac: bool = False) -> list[str]:
        cmd = [sys.executable, "-c", _WRAPPER, str(self.opts.mem_bytes), *map(str, args)]
        if drop_dac:  # root ignores file permissions; drop the capabilities that let it
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                raise HarnessSkip("needs setpriv (util-linux) to test permission errors as root")
            caps = "-dac_override,-dac_read_search"
            cmd = [setpriv, "--bounding-set", caps, "--inh-caps", caps, *cmd]
        return cmd

    def start(self, args: Sequence[str], *, cwd: Path, timeout: float | None = None, drop_dac: bool = False,
              env: dict | None = None) -> Proc:
        argv = [str(a) for a in args]
        popen = subprocess.Popen(self.command(argv, drop_dac), cwd=cwd, env={**self.env, **(env or {})},
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)
        return Proc(argv, popen, timeout or self.opts.timeout)

    def reference(self, key: str, args: Sequence[str]) -> tuple[Run, Path]:
        """A clean run of ``args + ['--out', REF]`` in a fresh folder, computed once per catalogue run."""
        with self._lock:
            lock = self._ref_locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self.refs:
                folder = self.root / "refs" / key
                folder.parent.mkdir(parents=True, exist_ok=True)
                run = self.start([*args, "--out", folder], cwd=self.root).wait()
                self.refs[key] = (run, folder)
            return self.refs[key]


class HarnessSkip(Exception):
    """A case cannot run on this machine (a missing tool)."""


class CaseFailed(Exception):
    """Raised inside a case to end it with a verdict (e.g. a setup step that itself failed)."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.detail)
        self.verdict = verdict


def sha256_path(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Ctx:
    """What a case function gets: its own folder, the inputs, runners and sentinel bookkeeping."""

    def __init__(self, runner: Runner, case: Case) -> None:
        self.runner, self.case = runner, case
        self.root = runner.root / "cases" / case.id
        self.root.mkdir(parents=True)
        self.runs: list[Run] = []
        self._sentinels: dict[Path, str | None] = {}
        inp = runner.inputs
        self.vars: dict[str, str] = {
            "tmp": str(self.root), "moon": str(inp / "moon.jsonl"), "moonb": str(inp / "moonb.jsonl"),
            "moon300": str(inp / "moon300.jsonl"), "ali": str(inp / "ali.jsonl"), "nat": str(inp / "nat.jsonl"),
            "natpq": str(inp / "natpq.parquet"), "conv": str(runner.opts.traces / "mooncake/conversation_trace.jsonl"),
            "synth": str(runner.opts.traces / "mooncake/synthetic_trace.jsonl"),
        }
        self.seed = runner.opts.seed

    # paths and files
    def fmt(self, text: str) -> str:
        return str(text).format_map(self.vars)

    def path(self, rel: str) -> Path:
        p = Path(self.fmt(rel))
        return p if p.is_absolute() else self.root / p

    def write(self, rel: str, data: str | bytes) -> Path:
        p = self.path(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            p.write_bytes(data)
        else:
            p.write_text(data)
        return p

    def protect(self, target: str | Path) -> None:
        """Record every file under ``target`` (or the file) with its checksum: it must survive unchanged."""
        p = target if isinstance(target, Path) else self.path(target)
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else []
        for f in files:
            self._sentinels[f] = sha256_path(f)

    def sentinel(self, rel: str, data: str = "user data, not kvlab's\n") -> Path:
        p = self.write(rel, data)
        self.protect(p)
        return p

    def check_sentinels(self) -> str | None:
        for f, digest in self._sentinels.items():
            if not f.is_file():
                return f"{f.relative_to(self.runner.root)} is gone"
            if sha256_path(f) != digest:
                return f"{f.relative_to(self.runner.root)} was modified"
        return None

    def listing(self, under: Path | None = None) -> set[Path]:
        base = under or self.root
        return {p for p in base.rglob("*")}

    # commands
    def start(self, *args: object, cwd: str | Path | None = None, timeout: float | None = None,
              drop_dac: bool = False, env: dict | None = None) -> Proc:
        cwd_p = self.path(str(cwd)) if cwd is not None else self.root
        return self.runner.start([self.fmt(str(a)) for a in args], cwd=cwd_p, timeout=timeout, drop_dac=drop_dac,
                                 env=env)

    def finish(self, proc: Proc, timeout: float | None = None) -> Run:
        run = proc.wait(timeout)
        self.runs.append(run)
        return run

    def run(self, *args: object, **kw: object) -> Run:
        return self.finish(self.start(*args, **kw))

    def reference(self, key: str, *args: object) -> tuple[Run, Path]:
        """A cached clean run (``--out`` is appended); a failing reference ends the case with its outcome."""
        run, folder = self.runner.reference(key, [self.fmt(str(a)) for a in args])
        if run.rc != 0 or run.timed_out:
            self.runs.append(run)
            raise CaseFailed(failure_of(run, f"the clean reference run ({key}) failed"))
        return run, folder


# ------------------------------------------------------------------------------------------ judging
def _mentions(message: str, name: str) -> bool:
    """``name`` appears in ``message``; a flag ``--time-scale`` also matches ``time_scale``/``time-scale``."""
    low = message.lower()
    if name.lower() in low:
        return True
    if name.startswith("--"):
        bare = name[2:].lower()
        return bare in low or bare.replace("-", "_") in low
    return False


def failure_of(run: Run, context: str = "") -> Verdict:
    """The failure class of a run that did not end as expected (or None-like 'clear error' placeholder)."""
    pre = f"{context}: " if context else ""
    if run.timed_out:
        return Verdict("hang", f"{pre}no exit after {run.seconds:.0f} s", run)
    if run.out_of_memory:
        return Verdict("crash/oom", f"{pre}{run.last_line}", run)
    if run.crashed:
        return Verdict("crash/oom", f"{pre}killed by signal {-run.rc}", run)
    if run.traceback:
        return Verdict("traceback", f"{pre}{run.last_line}", run)
    if run.rc == 0:
        return Verdict("silent wrong", f"{pre}exit 0", run)
    if not run.last_line.startswith(ERROR_PREFIX):
        return Verdict("unclear error", f"{pre}{run.last_line or '(empty stderr)'}", run)
    return Verdict("refused valid input", f"{pre}{run.last_line}", run)


def judge_error(run: Run, names: Iterable[str] = (), range_hint: bool = False) -> Verdict:
    """Expected: a clear one-line error naming ``names`` (each a flag, field, file or line)."""
    if run.timed_out or run.out_of_memory or run.crashed or run.traceback:
        return failure_of(run)
    if run.rc == 0:
        return Verdict("silent wrong", "bad input accepted (exit 0)", run)
    last = run.last_line
    if not last.startswith(ERROR_PREFIX) or any(ln.startswith("usage:") for ln in run.lines):
        return Verdict("unclear error", last or "(empty stderr)", run)
    missing = [n for n in names if not _mentions(last, n)]
    if missing:
        return Verdict("unclear error", f"does not name {', '.join(map(repr, missing))}: {last}", run)
    if range_hint and not RANGE_HINT.search(last):
        return Verdict("unclear error", f"no allowed range given: {last}", run)
    return Verdict("clear error", last, run)


def judge_ok(run: Run, check: Callable[[], str | None] | None = None) -> Verdict:
    """Expected: exit 0 and ``check()`` returning None (else its message is the 'silent wrong' detail)."""
    if run.timed_out or run.out_of_memory or run.crashed or run.traceback:
        return failure_of(run)
    if run.rc != 0:
        v = failure_of(run)
        return v if v.outcome != "refused valid input" else Verdict("refused valid input", run.last_line, run)
    if check is not None:
        try:
            msg = check()
        except Exception as exc:  # the output is not what a correct run writes
            msg = f"output unreadable: {type(exc).__name__}: {exc}"
        if msg:
            return Verdict("silent wrong", msg, run)
    return Verdict("correct result", "", run)


def judge_either(run: Run, names: Iterable[str] = (), check: Callable[[], str | None] | None = None,
                 range_hint: bool = False) -> Verdict:
    """Either a clear error or a correct result is fine (valid-but-extreme inputs)."""
    return judge_ok(run, check) if run.rc == 0 and not run.timed_out else judge_error(run, names, range_hint)


def judge_interrupted(run: Run) -> Verdict | None:
    """A SIGINT'ed command: no traceback, one clean ``kvlab:`` line (or it had already finished)."""
    if run.timed_out:
        return Verdict("hang", "no exit after SIGINT", run)
    if run.out_of_memory or run.crashed:
        return failure_of(run)
    if run.traceback:
        return Verdict("traceback", f"after SIGINT: {run.last_line}", run)
    if run.rc != 0 and not run.last_line.startswith("kvlab:"):
        return Verdict("unclear error", f"after SIGINT: {run.last_line or '(empty stderr)'}", run)
    return None


# ------------------------------------------------------------------------------------------ output checks
def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def read_table(path: Path):
    import pandas as pd

    return pd.read_parquet(path)


def sane_summary(s: dict, requests: int | None = None) -> str | None:
    if not isinstance(s, dict):
        return f"summary is a {type(s).__name__}"
    if requests is not None and s.get("requests") != requests:
        return f"requests {s.get('requests')}, expected {requests}"
    hit, ideal = s.get("token_hit_rate"), s.get("ideal_hit_rate")
    for name, v in (("token_hit_rate", hit), ("ideal_hit_rate", ideal)):
        if v is not None and not (isinstance(v, int | float) and 0.0 <= v <= 1.0 + 1e-12):
            return f"{name} = {v!r} outside [0, 1]"
    if hit is not None and ideal is not None and hit > ideal + 1e-9:
        return f"token_hit_rate {hit} > ideal_hit_rate {ideal}"
    for name in ("makespan_s", "ttft_p50_s", "ttft_p99_s"):
        v = s.get(name)
        if v is not None and not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            return f"{name} = {v!r}"
    pt = s.get("prompt_tokens")
    if pt is not None and pt < 0:
        return f"prompt_tokens {pt} < 0 (overflow?)"
    return None


def sane_table(t, rows: int | None = None, requests: int | None = None) -> str | None:
    if rows is not None and len(t) != rows:
        return f"{len(t)} rows, expected {rows}"
    for rec in t.to_dict("records"):
        msg = sane_summary(rec, requests)
        if msg:
            return msg
    return None


def same_table(got, want, *, ignore_trace: bool = False) -> str | None:
    """None if ``got`` has the same runs with the same numbers as ``want`` (timings ignored). Where both
    tables have a ``run_id`` column, ``got`` may list further runs (of earlier commands into its folder)."""
    import numpy as np

    if "run_id" in got and "run_id" in want:  # a folder's table lists every complete run in it: compare those
        ids = set(want["run_id"])
        missing = ids - set(got["run_id"])
        if missing:
            return f"{len(missing)} of a fresh run's {len(ids)} runs are missing from the table"
        got = got[got["run_id"].isin(ids)]
    if len(got) != len(want):
        return f"{len(got)} rows, a fresh run has {len(want)}"
    keys = [k for k in ROW_KEYS if k in got and k in want and not (ignore_trace and k == "trace")]
    g = got.sort_values(keys).reset_index(drop=True) if keys else got.reset_index(drop=True)
    w = want.sort_values(keys).reset_index(drop=True) if keys else want.reset_index(drop=True)
    for k in keys:
        if list(g[k].astype(str)) != list(w[k].astype(str)):
            return f"column {k}: {list(g[k])} vs a fresh run's {list(w[k])}"
    for m in METRICS:
        if m in g and m in w:
            a, b = g[m].to_numpy(dtype=float), w[m].to_numpy(dtype=float)
            if not np.allclose(a, b, rtol=1e-9, atol=1e-12, equal_nan=True):
                return f"{m} {a.tolist()} but a fresh run gives {b.tolist()}"
    return None


def summary_check(ctx: Ctx, out: str, requests: int | None = None) -> Callable[[], str | None]:
    def check() -> str | None:
        p = ctx.path(out) / "summary.json"
        if not p.is_file():
            return f"no {p.relative_to(ctx.root)}"
        return sane_summary(read_json(p), requests)

    return check


def sweep_check(ctx: Ctx, out: str, rows: int | None = None, requests: int | None = None):
    def check() -> str | None:
        p = ctx.path(out) / "sweep.parquet"
        if not p.is_file():
            return f"no {p.relative_to(ctx.root)}"
        return sane_table(read_table(p), rows, requests)

    return check


def stats_check(run_getter: Callable[[], Run], requests: int) -> Callable[[], str | None]:
    def check() -> str | None:
        m = re.search(r"^requests\s+([\d,]+)\s*$", run_getter().out, re.MULTILINE)
        if not m:
            return "no 'requests' line in the printout"
        n = int(m.group(1).replace(",", ""))
        return None if n == requests else f"requests {n}, expected {requests}"

    return check


# ------------------------------------------------------------------------------------------ inputs
def _jl(obj: object) -> str:
    return json.dumps(obj, separators=(", ", ": "))


def native_records(n: int = 80, seed: int = 0) -> list[dict]:
    """A small multi-turn token trace: a shared system prompt, sessions that grow turn by turn."""
    rng = random.Random(seed)
    system = [rng.randrange(1000, 30000) for _ in range(64)]
    sessions: dict[int, list[int]] = {}
    t, recs = 0.0, []
    for _ in range(n):
        s = rng.randrange(10)
        hist = sessions.setdefault(s, list(system))
        hist.extend(rng.randrange(1000, 30000) for _ in range(rng.randrange(8, 60)))
        t += rng.expovariate(4.0)
        recs.append({"arrival": round(t, 4), "output_length": rng.randrange(1, 64), "tokens": list(hist)})
        hist.extend(rng.randrange(1000, 30000) for _ in range(10))
    return recs


NATIVE_HEADER = {"kvlab_trace": 1, "kind": "tokens", "name": "nat"}


def native_text(header: dict | None = NATIVE_HEADER, records: list[dict] | None = None) -> str:
    lines = ([_jl(header)] if header is not None else []) + [_jl(r) for r in (records or native_records())]
    return "\n".join(lines) + "\n"


def write_parquet(path: Path, columns: dict, metadata: dict | None = None, types: dict | None = None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = {k: pa.array(v, type=(types or {}).get(k)) for k, v in columns.items()}
    table = pa.table(arrays)
    if metadata:
        table = table.replace_schema_metadata({k.encode(): v.encode() for k, v in metadata.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def native_columns(n: int = 80) -> dict:
    recs = native_records(n)
    return {"arrival": [r["arrival"] for r in recs], "output_length": [r["output_length"] for r in recs],
            "tokens": [r["tokens"] for r in recs]}


def prepare_inputs(inputs: Path, traces: Path) -> None:
    conv = traces / "mooncake" / "conversation_trace.jsonl"
    ali = traces / "alibaba" / "sample_traceA_multiturn_20.jsonl"
    for p in (conv, ali, traces / "mooncake" / "synthetic_trace.jsonl"):
        if not p.is_file():
            raise SystemExit(f"robustness: needs {p} (use --traces DIR)")
    inputs.mkdir(parents=True)
    lines = conv.read_text().splitlines(keepends=True)
    (inputs / "moon.jsonl").write_text("".join(lines[:60]))
    (inputs / "moonb.jsonl").write_text("".join(lines[60:120]))
    (inputs / "moon300.jsonl").write_text("".join(lines[:300]))
    shutil.copyfile(ali, inputs / "ali.jsonl")
    (inputs / "nat.jsonl").write_text(native_text())
    write_parquet(inputs / "natpq.parquet", native_columns())


def moon_lines(ctx: Ctx) -> list[str]:
    return Path(ctx.vars["moon"]).read_text().splitlines()


def ali_lines(ctx: Ctx) -> list[str]:
    return Path(ctx.vars["ali"]).read_text().splitlines()


def nat_lines(ctx: Ctx) -> list[str]:
    return Path(ctx.vars["nat"]).read_text().splitlines()


# ------------------------------------------------------------------------------------------ registry
@dataclass
class Case:
    cls: str
    id: str
    desc: str
    fn: Callable[[Ctx], Verdict]
    weight: float = 1.0  # rough cost in command runs (scheduling: heaviest first)


@dataclass
class Result:
    case: Case
    verdict: Verdict
    seconds: float
    runs: list[Run] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        return self.verdict.outcome

    def record(self) -> dict:
        run = self.verdict.run
        return {"id": self.case.id, "class": self.case.cls, "desc": self.case.desc, "outcome": self.outcome,
                "detail": self.verdict.detail, "seconds": round(self.seconds, 2),
                "last_line": run.last_line if run else "", "stderr_tail": run.err[-2000:] if run else "",
                "runs": [r.record() for r in self.runs]}


CASES: list[Case] = []


def register(cls: str, cid: str, desc: str, fn: Callable[[Ctx], Verdict], weight: float = 1.0) -> None:
    assert cls in CLASSES, cls
    assert all(c.id != cid for c in CASES), f"duplicate case id {cid}"
    CASES.append(Case(cls, cid, desc, fn, weight))


def case(cls: str, cid: str, desc: str, weight: float = 1.0):
    def deco(fn: Callable[[Ctx], Verdict]) -> Callable[[Ctx], Verdict]:
        register(cls, cid, desc, fn, weight)
        return fn

    return deco


def simple(cls: str, cid: str, desc: str, args: Sequence[str], *, accept: str = "error",
           names: Sequence[str] = (), range_hint: bool = False, setup: Callable[[Ctx], dict | None] | None = None,
           check: Callable[[Ctx, Run], str | None] | None = None, protect: Sequence[str] = (),
           cwd: str | None = None, drop_dac: bool = False, timeout: float | None = None, weight: float = 1.0,
           no_output: str | None = None) -> None:
    """One command; ``accept`` is 'error' (must be a clear error), 'ok' (must pass ``check``) or 'either'.

    ``no_output``: a path that must not exist after a clear error (nothing half-written)."""

    def fn(ctx: Ctx) -> Verdict:
        if setup is not None:
            ctx.vars.update(setup(ctx) or {})
        for p in protect:
            ctx.protect(p)
        run = ctx.run(*args, cwd=cwd, drop_dac=drop_dac, timeout=timeout)
        names_f = [ctx.fmt(n) for n in names]
        chk = (lambda: check(ctx, run)) if check is not None else None
        if accept == "error":
            v = judge_error(run, names_f, range_hint)
        elif accept == "ok":
            v = judge_ok(run, chk)
        else:
            v = judge_either(run, names_f, chk, range_hint)
        if no_output and v.outcome == "clear error" and ctx.path(no_output).exists():
            v = Verdict("silent wrong", f"refused, but left {ctx.fmt(no_output)} behind", run)
        return v

    register(cls, cid, desc, fn, weight)


# ================================================================================================
# malformed traces
# ================================================================================================
MT = "malformed trace"
STATS = ["trace", "stats"]


def _replace_line(lines: list[str], idx: int, text: str | None) -> str:
    out = list(lines)
    if text is None:
        del out[idx]
    else:
        out[idx] = text
    return "\n".join(out) + "\n"


def _moon_rec(ctx: Ctx, i: int) -> dict:
    return json.loads(moon_lines(ctx)[i])


def bad_trace(cid: str, desc: str, make: Callable[[Ctx], str | bytes], names: Sequence[str], *,
              fname: str = "t.jsonl", command: Sequence[str] = STATS, extra: Sequence[str] = (),
              accept: str = "error", check: Callable[[Ctx, Run], str | None] | None = None, **kw) -> None:
    def setup(ctx: Ctx) -> dict:
        ctx.write(fname, make(ctx))
        return {"t": str(ctx.path(fname))}

    simple(MT, cid, desc, [*command, "{t}", *extra], accept=accept, names=names, setup=setup, check=check, **kw)


def _moon_edit(i: int, **changes: object) -> Callable[[Ctx], str]:
    def make(ctx: Ctx) -> str:
        rec = _moon_rec(ctx, i)
        for k, v in changes.items():
            if v is _DROP:
                rec.pop(k, None)
            else:
                rec[k] = v
        return _replace_line(moon_lines(ctx), i, json.dumps(rec))

    return make


_DROP = object()


def _register_mooncake() -> None:
    bad_trace("trace.mooncake.empty", "mooncake: empty file (0 bytes)", lambda c: "", ["t.jsonl"], accept="either",
              check=lambda c, r: stats_check(lambda: r, 0)())
    bad_trace("trace.mooncake.whitespace", "mooncake: only blank lines", lambda c: "\n\n  \n", ["t.jsonl"],
              accept="either", check=lambda c, r: stats_check(lambda: r, 0)())
    bad_trace("trace.mooncake.garbage", "binary garbage", lambda c: random.Random(1).randbytes(4000), ["t.jsonl"])
    bad_trace("trace.mooncake.truncated", "last line cut in the middle (download interrupted)",
              lambda c: "\n".join(moon_lines(c))[:-37], ["t.jsonl", ":60"])
    bad_trace("trace.mooncake.truncated-replay", "truncated trace given to replay",
              lambda c: "\n".join(moon_lines(c))[:-37], ["t.jsonl", ":60"],
              command=["replay"], extra=["--capacity-blocks", "100", "--engine", "python", "--quiet"])
    bad_trace("trace.mooncake.str-length", "input_length is a string", _moon_edit(2, input_length="6758"),
              ["t.jsonl", ":3", "input_length"])
    bad_trace("trace.mooncake.float-length", "output_length is 12.5", _moon_edit(2, output_length=12.5),
              ["t.jsonl", ":3", "output_length"])
    bad_trace("trace.mooncake.missing-hash-ids", "hash_ids missing", _moon_edit(4, hash_ids=_DROP),
              ["t.jsonl", ":5", "hash_ids"])
    bad_trace("trace.mooncake.missing-timestamp", "timestamp missing", _moon_edit(4, timestamp=_DROP),
              ["t.jsonl", ":5", "timestamp"])
    bad_trace("trace.mooncake.negative-length", "input_length -5", _moon_edit(3, input_length=-5),
              ["t.jsonl", ":4", "input_length"])
    bad_trace("trace.mooncake.negative-id", "a negative block id", _moon_edit(3, hash_ids=[-1] + [1] * 14),
              ["t.jsonl", ":4", "hash_ids"])
    bad_trace("trace.mooncake.nan-timestamp", "timestamp NaN (Python's json accepts the literal)",
              lambda c: _replace_line(moon_lines(c), 2, moon_lines(c)[2].replace('"timestamp": 0', '"timestamp": NaN')),
              ["t.jsonl", ":3", "timestamp"])
    bad_trace("trace.mooncake.bool-timestamp", "timestamp true", _moon_edit(2, timestamp=True),
              ["t.jsonl", ":3", "timestamp"])
    bad_trace("trace.mooncake.backwards", "timestamps go backwards", _moon_edit(30, timestamp=0),
              ["t.jsonl", ":31", "timestamp"])
    bad_trace("trace.mooncake.count-mismatch", "hash_ids count does not match input_length",
              _moon_edit(5, input_length=100), ["t.jsonl", ":6", "hash_ids"])
    bad_trace("trace.mooncake.claims-1e15", "input_length 10^15 with a few ids", _moon_edit(5, input_length=10**15),
              ["t.jsonl", ":6"])
    bad_trace("trace.mooncake.int-overflow", "a block id beyond int64", _moon_edit(5, hash_ids=[2**70] * 15),
              ["t.jsonl", ":6", "hash_ids"])
    bad_trace("trace.mooncake.huge-literal", "a 5000-digit integer literal",
              lambda c: _replace_line(moon_lines(c), 5, '{"timestamp": ' + "9" * 5000 + ', "input_length": 1, '
                                      '"output_length": 1, "hash_ids": [1]}'), ["t.jsonl", ":6"])
    bad_trace("trace.mooncake.hash-ids-string", "hash_ids is a string", _moon_edit(5, hash_ids="0,1,2"),
              ["t.jsonl", ":6", "hash_ids"])
    bad_trace("trace.mooncake.array-line", "a line that is a JSON array", lambda c: _replace_line(moon_lines(c), 7,
              "[1, 2, 3]"), ["t.jsonl", ":8"])
    bad_trace("trace.mooncake.deep-nesting", "a line nested 100,000 deep",
              lambda c: _replace_line(moon_lines(c), 7, "[" * 100_000 + "]" * 100_000), ["t.jsonl", ":8"])
    bad_trace("trace.mooncake.latin1", "a non-UTF-8 byte", lambda c: ("\n".join(moon_lines(c)[:9]) + "\n").encode()
              + b'{"timestamp": 99999, "note": "caf\xe9"}\n', ["t.jsonl", ":10"])
    bad_trace("trace.mooncake.bom", "UTF-8 byte-order mark (valid file saved by a Windows editor)",
              lambda c: "\ufeff" + "\n".join(moon_lines(c)) + "\n", ["t.jsonl", ":1"], accept="either",
              check=lambda c, r: stats_check(lambda: r, 60)())
    bad_trace("trace.mooncake.crlf", "CRLF line endings (valid)", lambda c: "\r\n".join(moon_lines(c)) + "\r\n", [],
              accept="ok", check=lambda c, r: stats_check(lambda: r, 60)())
    bad_trace("trace.mooncake.blank-lines", "blank lines between records (valid)",
              lambda c: "\n\n".join(moon_lines(c)) + "\n\n\n", [], accept="ok",
              check=lambda c, r: stats_check(lambda: r, 60)())
    bad_trace("trace.mooncake.extra-key", "an unknown extra key (mooncake ignores them)",
              _moon_edit(3, note="hello"), [], accept="ok", check=lambda c, r: stats_check(lambda: r, 60)())
    bad_trace("trace.mooncake.zero-length", "a 0-token prompt (valid, unusual)",
              _moon_edit(3, input_length=0, hash_ids=[]), [], accept="ok",
              command=["replay"], extra=["--capacity-blocks", "100", "--engine", "python", "--quiet", "--out",
                                         "{tmp}/R"], check=lambda c, r: summary_check(c, "R", 60)())
    bad_trace("trace.mooncake.same-timestamps", "every request at t = 0 (valid)",
              lambda c: "\n".join(json.dumps({**json.loads(x), "timestamp": 0}) for x in moon_lines(c)) + "\n", [],
              accept="ok", command=["simulate"], extra=["--limit", "20", "--quiet", "--out", "{tmp}/R"],
              check=lambda c, r: summary_check(c, "R", 20)())
    simple(MT, "trace.sweep-second-missing", "sweep of a good trace and a missing one: refused before any run",
           ["sweep", "{moon}", "{tmp}/nope.jsonl", "--capacity-blocks", "100", "--engine", "python", "--quiet",
            "--out", "{tmp}/S"], names=["nope.jsonl"], no_output="{tmp}/S")
    bad_trace("trace.sweep-second-malformed", "sweep of a good trace and a truncated one: refused before any run",
              lambda c: "\n".join(moon_lines(c))[:-37], ["t.jsonl", ":60"], command=["sweep", "{moon}"],
              extra=["--capacity-blocks", "100", "--engine", "python", "--quiet", "--out", "{tmp}/S"],
              no_output="{tmp}/S")
    simple(MT, "trace.missing-file", "the trace path does not exist", [*STATS, "{tmp}/nope.jsonl"],
           names=["nope.jsonl"])
    simple(MT, "trace.directory", "a directory given as the trace", [*STATS, "{tmp}"], names=["{tmp}"])
    simple(MT, "trace.unknown-name", "a misspelt registry name", [*STATS, "mooncake_conversatoin"],
           names=["mooncake_conversatoin"])
    simple(MT, "trace.dev-null", "/dev/null as the trace", [*STATS, "/dev/null"], names=["/dev/null"])

    def fifo(ctx: Ctx) -> dict:
        os.mkfifo(ctx.path("pipe.jsonl"))
        return {}

    simple(MT, "trace.fifo", "a named pipe as the trace (must not block)", [*STATS, "{tmp}/pipe.jsonl", "--format",
           "mooncake"], names=["pipe.jsonl"], setup=fifo)

    def unreadable(ctx: Ctx) -> dict:
        p = ctx.write("secret.jsonl", "\n".join(moon_lines(ctx)) + "\n")
        p.chmod(0)
        return {}

    simple(MT, "trace.permission-denied", "an unreadable trace file (mode 000, capabilities dropped)",
           [*STATS, "{tmp}/secret.jsonl"], names=["secret.jsonl"], setup=unreadable, drop_dac=True)
    simple(MT, "trace.permission-denied-replay", "an unreadable trace given to replay",
           ["replay", "{tmp}/secret.jsonl", "--capacity-blocks", "100", "--quiet"], names=["secret.jsonl"],
           setup=unreadable, drop_dac=True)


def _ali_edit(i: int, **changes: object) -> Callable[[Ctx], str]:
    def make(ctx: Ctx) -> str:
        lines = ali_lines(ctx)
        rec = json.loads(lines[i])
        for k, v in changes.items():
            if v is _DROP:
                rec.pop(k, None)
            else:
                rec[k] = v
        return _replace_line(lines, i, json.dumps(rec))

    return make


def _ali_ids(ctx: Ctx, i: int) -> tuple[int, int]:
    rec = json.loads(ali_lines(ctx)[i])
    return rec["chat_id"], rec["parent_chat_id"]


def _register_alibaba() -> None:
    fmt = ["--format", "alibaba"]
    bad_trace("trace.alibaba.missing-chat-id", "chat_id missing", _ali_edit(2, chat_id=_DROP),
              ["t.jsonl", ":3", "chat_id"], extra=fmt)
    bad_trace("trace.alibaba.duplicate-chat-id", "two records with one chat_id",
              lambda c: _ali_edit(4, chat_id=_ali_ids(c, 2)[0])(c), ["t.jsonl", "chat_id"], extra=fmt)
    bad_trace("trace.alibaba.self-parent", "a chat that is its own parent",
              lambda c: _ali_edit(4, parent_chat_id=_ali_ids(c, 4)[0])(c), ["t.jsonl", "parent_chat_id"], extra=fmt)

    def cycle(ctx: Ctx) -> str:
        lines = ali_lines(ctx)
        a, b = json.loads(lines[3]), json.loads(lines[5])
        a["parent_chat_id"], b["parent_chat_id"] = b["chat_id"], a["chat_id"]
        lines[3], lines[5] = json.dumps(a), json.dumps(b)
        return "\n".join(lines) + "\n"

    bad_trace("trace.alibaba.parent-cycle", "two chats that are each other's parent", cycle, ["t.jsonl"], extra=fmt)
    bad_trace("trace.alibaba.backwards", "timestamps go backwards (unsorted file)", _ali_edit(6, timestamp=0.0),
              ["t.jsonl", ":7", "timestamp"], extra=fmt)
    bad_trace("trace.alibaba.type-int", "type is a number", _ali_edit(3, type=5), ["t.jsonl", ":4", "type"],
              extra=fmt)
    bad_trace("trace.alibaba.turn-string", "turn is a string", _ali_edit(3, turn="1"), ["t.jsonl", ":4", "turn"],
              extra=fmt)
    bad_trace("trace.alibaba.count-mismatch", "hash_ids count does not match input_length",
              _ali_edit(3, input_length=5), ["t.jsonl", ":4", "hash_ids"], extra=fmt)
    bad_trace("trace.alibaba.inf-timestamp", "timestamp Infinity",
              lambda c: _replace_line(ali_lines(c), 3, re.sub(r'"timestamp": [0-9.]+', '"timestamp": Infinity',
                                                              ali_lines(c)[3])), ["t.jsonl", ":4", "timestamp"],
              extra=fmt)
    bad_trace("trace.alibaba.empty", "empty file with --format alibaba", lambda c: "", ["t.jsonl"], extra=fmt,
              accept="either", check=lambda c, r: stats_check(lambda: r, 0)())
    bad_trace("trace.alibaba.mooncake-as-alibaba", "a mooncake file read with --format alibaba",
              lambda c: "\n".join(moon_lines(c)) + "\n", ["t.jsonl", ":1", "chat_id"], extra=fmt)
    bad_trace("trace.alibaba.replay-truncated", "truncated alibaba trace given to replay",
              lambda c: "\n".join(ali_lines(c))[:-20], ["t.jsonl", ":20"], command=["replay"],
              extra=[*fmt, "--capacity-blocks", "100", "--quiet", "--engine", "python"])


def _nat_edit(i: int, **changes: object) -> Callable[[Ctx], str]:
    def make(ctx: Ctx) -> str:
        lines = nat_lines(ctx)
        rec = json.loads(lines[i])
        for k, v in changes.items():
            if v is _DROP:
                rec.pop(k, None)
            else:
                rec[k] = v
        return _replace_line(lines, i, json.dumps(rec))

    return make


def _register_native() -> None:
    bad_trace("trace.jsonl.header-only", "a native header and no requests", lambda c: native_text(records=[])[:0]
              + _jl(NATIVE_HEADER) + "\n", ["t.jsonl"], accept="either", check=lambda c, r: stats_check(lambda: r, 0)())
    bad_trace("trace.jsonl.version-2", "header kvlab_trace 2", _nat_edit(0, kvlab_trace=2),
              ["t.jsonl", ":1", "kvlab_trace"])
    bad_trace("trace.jsonl.kind-foo", "header kind 'foo'", _nat_edit(0, kind="foo"), ["t.jsonl", ":1", "kind"])
    bad_trace("trace.jsonl.name-int", "header name is a number", _nat_edit(0, name=5), ["t.jsonl", ":1", "name"])
    bad_trace("trace.jsonl.two-prompts", "a record with both tokens and hash_ids", _nat_edit(3, hash_ids=[1, 2]),
              ["t.jsonl", ":4"])
    bad_trace("trace.jsonl.typo-key", "a misspelt key 'arival'", _nat_edit(3, arival=1.0), ["t.jsonl", ":4", "arival"])
    bad_trace("trace.jsonl.arrival-string", "arrival is a string", _nat_edit(3, arrival="1.0"),
              ["t.jsonl", ":4", "arrival"])
    bad_trace("trace.jsonl.arrival-inf", "arrival Infinity",
              lambda c: _replace_line(nat_lines(c), 3, re.sub(r'"arrival": [0-9.e-]+', '"arrival": Infinity',
                                                              nat_lines(c)[3])), ["t.jsonl", ":4", "arrival"])
    bad_trace("trace.jsonl.arrival-backwards", "arrivals go backwards", _nat_edit(10, arrival=0.0),
              ["t.jsonl", ":11", "arrival"])
    bad_trace("trace.jsonl.negative-token", "a negative token id", _nat_edit(3, tokens=[5, -3, 7]),
              ["t.jsonl", ":4", "tokens"])
    bad_trace("trace.jsonl.text-no-tokenizer", "a text prompt (no tokenizer on the command line)",
              _nat_edit(3, tokens=_DROP, text="hello world"), ["t.jsonl", ":4", "text"])
    bad_trace("trace.jsonl.hash-ids-no-length", "hash_ids without input_length",
              lambda c: native_text({"kvlab_trace": 1, "kind": "blocks", "block_size": 16},
                                    [{"arrival": 0.0, "output_length": 1, "hash_ids": [1, 2]}]),
              ["t.jsonl", ":2", "input_length"])
    bad_trace("trace.jsonl.blocks-no-block-size", "a blocks header without block_size",
              lambda c: native_text({"kvlab_trace": 1, "kind": "blocks"},
                                    [{"arrival": 0.0, "output_length": 1, "hash_ids": [1], "input_length": 16}]),
              ["t.jsonl", ":1", "block_size"])
    bad_trace("trace.jsonl.block-size-conflict", "a record's block_size disagrees with the header",
              lambda c: native_text({"kvlab_trace": 1, "kind": "blocks", "block_size": 16},
                                    [{"arrival": 0.0, "output_length": 1, "hash_ids": [1], "input_length": 16,
                                      "block_size": 32}]), ["t.jsonl", ":2", "block_size"])
    bad_trace("trace.jsonl.header-late", "the header on line 3", lambda c: "\n".join(
              nat_lines(c)[1:3] + [nat_lines(c)[0]] + nat_lines(c)[3:]) + "\n", ["t.jsonl", ":3"])
    bad_trace("trace.jsonl.some-request-ids", "request_id on some records only", _nat_edit(3, request_id=7),
              ["t.jsonl", "request_id"])
    bad_trace("trace.jsonl.length-mismatch", "input_length disagrees with the token count",
              _nat_edit(3, input_length=3), ["t.jsonl", ":4", "input_length"])
    bad_trace("trace.jsonl.zero-output", "output_length 0 everywhere (valid)", lambda c: native_text(records=[
              {**r, "output_length": 0} for r in native_records()]), [], accept="ok", command=["simulate"],
              extra=["--quiet", "--out", "{tmp}/R"], check=lambda c, r: summary_check(c, "R", 80)())
    bad_trace("trace.jsonl.no-header", "a token file without header (valid)",
              lambda c: native_text(header=None), [], accept="ok", command=["replay"],
              extra=["--capacity-blocks", "64", "--quiet", "--engine", "python", "--out", "{tmp}/R"],
              check=lambda c, r: summary_check(c, "R", 80)())
    bad_trace("trace.jsonl.negative-arrival", "arrivals starting at -5 s", lambda c: native_text(records=[
              {**r, "arrival": r["arrival"] - 5.0} for r in native_records()]), ["t.jsonl", "arrival"],
              accept="either", check=lambda c, r: stats_check(lambda: r, 80)())
    bad_trace("trace.jsonl.replay-garbled", "a garbled native line given to sweep",
              lambda c: _replace_line(nat_lines(c), 5, '{"arrival": 1.0, "output_length": 3, "tokens": [1, 2,'),
              ["t.jsonl", ":6"], command=["sweep"], extra=["--capacity-blocks", "64", "--quiet", "--out", "{tmp}/S"],
              no_output="{tmp}/S")


def _pq(make_cols: Callable[[], dict], metadata: dict | None = None, types: dict | None = None):
    def make(ctx: Ctx) -> bytes:
        p = write_parquet(ctx.path("build.parquet"), make_cols(), metadata, types)
        data = p.read_bytes()
        p.unlink()
        return data

    return make


def _cols(**changes: object) -> Callable[[], dict]:
    def make() -> dict:
        cols = native_columns()
        for k, v in changes.items():
            if v is _DROP:
                cols.pop(k)
            elif callable(v):
                cols[k] = v(cols)
            else:
                cols[k] = v
        return cols

    return make


def _register_parquet() -> None:
    import pyarrow as pa

    kw = {"fname": "t.parquet"}
    bad_trace("trace.parquet.empty", "an empty .parquet file", lambda c: b"", ["t.parquet"], **kw)
    bad_trace("trace.parquet.garbage", "garbage between PAR1 magics",
              lambda c: b"PAR1" + random.Random(2).randbytes(3000) + b"PAR1", ["t.parquet"], **kw)
    bad_trace("trace.parquet.truncated", "a parquet file cut in half",
              lambda c: Path(c.vars["natpq"]).read_bytes()[: len(Path(c.vars["natpq"]).read_bytes()) // 2],
              ["t.parquet"], **kw)
    bad_trace("trace.parquet.arrival-string", "arrival stored as strings",
              _pq(_cols(arrival=lambda c: [str(x) for x in c["arrival"]])), ["t.parquet", "arrival"], **kw)
    bad_trace("trace.parquet.missing-arrival", "no arrival column", _pq(_cols(arrival=_DROP)),
              ["t.parquet", "arrival"], **kw)
    bad_trace("trace.parquet.nan-arrival", "a NaN arrival",
              _pq(_cols(arrival=lambda c: [float("nan")] + c["arrival"][1:])), ["t.parquet", "arrival"], **kw)
    bad_trace("trace.parquet.unknown-column", "an unknown column 'foo'",
              _pq(_cols(foo=lambda c: [1] * len(c["arrival"]))), ["t.parquet", "foo"], **kw)
    bad_trace("trace.parquet.null-token", "a null inside a token list",
              _pq(_cols(tokens=lambda c: [[1, None, 3]] + c["tokens"][1:])), ["t.parquet", "tokens"], **kw)
    bad_trace("trace.parquet.hash-ids-no-block-size", "a hash_ids file from another tool, no block size",
              _pq(lambda: {"arrival": [0.0, 1.0], "output_length": [1, 1], "input_length": [32, 32],
                           "hash_ids": [[1, 2], [1, 3]]}), ["t.parquet", "block_size"], **kw)
    bad_trace("trace.parquet.backwards", "arrivals go backwards",
              _pq(_cols(arrival=lambda c: c["arrival"][:5] + [0.0] + c["arrival"][6:])), ["t.parquet", "arrival"],
              **kw)
    bad_trace("trace.parquet.negative-output", "a negative output_length",
              _pq(_cols(output_length=lambda c: [-1] + c["output_length"][1:])), ["t.parquet", "output_length"],
              **kw)
    bad_trace("trace.parquet.bad-metadata", "schema metadata 'kvlab' that is not JSON",
              _pq(_cols(), metadata={"kvlab": "{not json"}), ["t.parquet", "kvlab"], **kw)
    bad_trace("trace.parquet.int32-output", "output_length stored as int32 (valid)",
              _pq(_cols(), types={"output_length": pa.int32()}), [], accept="either",
              check=lambda c, r: stats_check(lambda: r, 80)(), **kw)
    bad_trace("trace.parquet.pandas-index", "a pandas index column __index_level_0__ (valid)",
              _pq(_cols(__index_level_0__=lambda c: list(range(len(c["arrival"]))))), [], accept="ok",
              check=lambda c, r: stats_check(lambda: r, 80)(), **kw)
    simple(MT, "trace.format.parquet-on-jsonl", "--format parquet on a JSONL file",
           [*STATS, "{nat}", "--format", "parquet"], names=["nat.jsonl"])
    simple(MT, "trace.format.mooncake-on-native", "--format mooncake on a native JSONL file",
           [*STATS, "{nat}", "--format", "mooncake"], names=["nat.jsonl", ":1"])
    simple(MT, "trace.format.jsonl-on-parquet", "--format jsonl on a parquet file",
           [*STATS, "{natpq}", "--format", "jsonl"], names=["natpq.parquet"])
    simple(MT, "trace.format.mooncake-on-parquet", "a parquet file renamed .jsonl, read as mooncake",
           [*STATS, "{tmp}/p.jsonl", "--format", "mooncake"], names=["p.jsonl"],
           setup=lambda c: {"_": shutil.copyfile(c.vars["natpq"], c.path("p.jsonl"))})


# ================================================================================================
# bad parameters
# ================================================================================================
BP = "bad parameter"
REPLAY1 = ["replay", "{moon}", "--engine", "python", "--quiet"]
CAP = ["--capacity-blocks", "100"]
SIM = ["simulate", "{moon}", "--limit", "20", "--quiet"]
SWEEP1 = ["sweep", "{moon}", "--engine", "python", "--quiet", "--out", "{tmp}/S"]

# (flag, value, accept): "E" must be a clear error with a range hint, "e" a clear error, "ok"/"either"
REPLAY_VALUES = [
    ("--limit", "0", "E"), ("--limit", "-5", "E"), ("--limit", "nan", "e"), ("--limit", "abc", "e"),
    ("--limit", "2.5", "e"), ("--limit", str(10**18), "ok"),
    ("--block-size", "0", "E"), ("--block-size", "-512", "E"), ("--block-size", "abc", "e"),
    ("--block-size", "100", "E"), ("--block-size", "1024", "either"), ("--block-size", "inf", "e"),
    ("--capacity-blocks", "0", "E"), ("--capacity-blocks", "-1", "E"), ("--capacity-blocks", "nan", "e"),
    ("--capacity-blocks", "abc", "e"), ("--capacity-blocks", "1.5", "e"), ("--capacity-blocks", "1e3", "e"),
    ("--root-seed", "-1", "either"), ("--root-seed", "abc", "e"), ("--root-seed", str(2**70), "either"),
    ("--seed", "abc", "e"), ("--seed", "-7", "either"),
    ("--hash", "md5", "e"), ("--hash", "", "e"), ("--format", "csv", "e"), ("--mode", "foo", "e"),
    ("--engine", "gpu", "e"), ("--policy", "lruu", "e"), ("--policy", "", "e"),
]

SIM_VALUES = [
    ("--limit", "0", "E"), ("--limit", "-5", "E"),
    ("--block-size", "0", "E"), ("--block-size", "-512", "E"), ("--block-size", "100", "E"),
    ("--capacity-blocks", "0", "E"), ("--capacity-blocks", "-1", "E"),
    ("--gpu-memory-utilization", "0", "E"), ("--gpu-memory-utilization", "1.5", "E"),
    ("--gpu-memory-utilization", "nan", "E"),
    ("--max-num-seqs", "0", "E"), ("--max-num-batched-tokens", "0", "E"),
    ("--rate", "0", "E"), ("--rate", "-1", "E"), ("--rate", "nan", "E"), ("--rate", "inf", "either"),
    ("--time-scale", "-1", "E"), ("--time-scale", "nan", "E"), ("--time-scale", "inf", "E"),
    ("--time-scale", "0", "either"),
    ("--instances", "0", "E"), ("--tensor-parallel", "0", "E"),
    ("--model", "no-such-model", "e"), ("--hardware", "no-such-gpu", "e"), ("--dtype", "float13", "e"),
    ("--kv-dtype", "int3", "e"), ("--policy", "lruu", "e"), ("--router", "random", "e"),
    ("--cache-at", "never", "e"), ("--root-seed", "abc", "e"), ("--max-num-seqs", "abc", "e"),
]

STATS_VALUES = [
    ("--limit", "0", "E"), ("--limit", "-1", "E"), ("--limit", "abc", "e"),
    ("--block-size", "0", "E"), ("--block-size", "-1", "E"), ("--block-size", "100", "E"),
    ("--block-size", "1024", "either"), ("--hash", "foo", "e"),
]

CAL_VALUES = [
    ("--capacity-blocks", "0", "E"), ("--repeats", "0", "E"), ("--block-size", "0", "E"), ("--threads", "0", "E"),
    ("--device", "quantum", "e"), ("--engine-model", "no-such-shape", "e"), ("--base-hardware", "nope", "e"),
    ("--dtype", "float13", "e"),
]

POLICY_PARAMS = [
    # (policy, param, expected name in the message)
    ("slru", "segments", "--policy-param"),  # no '='
    ("slru", "=4", "--policy-param"),
    ("lru", "bogus=1", "bogus"),
    ("slru", "segments=0", "segments"),
    ("slru", "segments=-2", "segments"),
    ("slru", "segments=abc", "segments"),
    ("slru", "segments=1.5", "segments"),
    ("slru", "segments=[]", "segments"),
    ("slru", "segments=[0.5,-1]", "segments"),
    ("2q", "ain_ratio=2", "ain_ratio"),
    ("2q", "ain_ratio=NaN", "ain_ratio"),
    ("s3fifo", "small_ratio=-0.1", "small_ratio"),
    ("s3fifo", "small_ratio=1.5", "small_ratio"),
    ("wtinylfu", "protected_ratio=2", "protected_ratio"),
    ("ttl", "ttl_s=-1", "ttl_s"),
    ("ttl", "ttl_s=NaN", "ttl_s"),
    ("lfu-halflife", "half_life=0", "half_life"),
    ("lfu-halflife", "clock=sundial", "clock"),
    ("clock", "bits=0", "bits"),
    ("clock", "bits=-1", "bits"),
    ("workload-aware", "window=0", "window"),
    ("prefix-aware", "inner=nope", "nope"),
    ("gdsf", "attention_ratio=-1", "attention_ratio"),
    ("trtllm-priority", "priorities=5", "priorities"),
]


def _slug(text: str) -> str:
    neg = "neg" if text.startswith("-") and not text.startswith("--") else ""
    text = text.replace("[]", "empty-list")
    return neg + (re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "empty")


def _flag_case(prefix: str, base: Sequence[str], flag: str, value: str, accept: str, *, ok_out: bool,
               requests: int, extra_tail: Sequence[str] = (), check_kind: str = "summary", **kw) -> None:
    cid = f"{prefix}.{_slug(flag)}.{_slug(value)}"
    tail = ["--out", "{tmp}/R"] if ok_out and accept in ("ok", "either") else []
    args = [*base, flag, value, *extra_tail, *tail]
    if check_kind == "summary":
        def check(c: Ctx, r: Run) -> str | None:
            return summary_check(c, "R", requests)()
    elif check_kind == "stats":
        def check(c: Ctx, r: Run) -> str | None:
            return stats_check(lambda: r, requests)()
    else:
        check = None
    simple(BP, cid, f"{prefix} {flag} {value!r}", args, accept={"E": "error", "e": "error"}.get(accept, accept),
           names=[flag], range_hint=accept == "E", check=check, **kw)


def _register_bad_parameters() -> None:
    for flag, value, acc in REPLAY_VALUES:
        base = REPLAY1 if flag == "--capacity-blocks" else [*REPLAY1, *CAP]
        req = 60
        _flag_case("replay", base, flag, value, acc, ok_out=True, requests=req)
    simple(BP, "replay.capacity-blocks.one-zero-among-many", "replay --capacity-blocks 100 0 200",
           [*REPLAY1, "--capacity-blocks", "100", "0", "200", "--out", "{tmp}/S"], names=["--capacity-blocks"],
           range_hint=True, no_output="{tmp}/S/sweep.parquet")
    simple(BP, "replay.engine-compiled-no-kernel", "--engine compiled with a policy that has no kernel (mru)",
           ["replay", "{moon}", *CAP, "--engine", "compiled", "--policy", "mru", "--quiet"], names=["mru"])
    for pol, item, name in POLICY_PARAMS:
        simple(BP, f"replay.policy-param.{pol}.{_slug(item)}", f"--policy {pol} --policy-param {item!r}",
               [*REPLAY1, *CAP, "--policy", pol, "--policy-param", item], names=[name])
    simple(BP, "replay.policy-param.two-policies-one-param", "--policy lru slru --policy-param segments=2 (lru "
           "has no such parameter)", [*REPLAY1, *CAP, "--policy", "lru", "slru", "--policy-param", "segments=2",
                                     "--out", "{tmp}/S"], names=["segments"], accept="either",
           check=lambda c, r: sweep_check(c, "S", 2, 60)())
    for flag, value, acc in [("--limit", "0", "E"), ("--limit", "-5", "E"), ("--block-size", "0", "E"),
                             ("--capacity-blocks", "0", "E"), ("--capacity-blocks", "-1", "E"),
                             ("--policy", "lruu", "e"), ("--policy-param", "bogus=1", "e")]:
        base = SWEEP1 if flag == "--capacity-blocks" else [*SWEEP1, *CAP]
        simple(BP, f"sweep.{_slug(flag)}.{_slug(value)}", f"sweep {flag} {value!r}", [*base, flag, value],
               names=[flag if flag != "--policy-param" else "bogus"], range_hint=acc == "E",
               no_output="{tmp}/S/sweep.parquet")
    simple(BP, "sweep.no-out", "sweep without --out", ["sweep", "{moon}", *CAP, "--quiet"], names=["--out"])
    simple(BP, "sweep.same-trace-twice", "the same trace listed twice (valid)", ["sweep", "{moon}", *SWEEP1[1:], *CAP],
           accept="either", names=["moon"],
           check=lambda c, r: None if (c.path("S") / "sweep.parquet").is_file() else "no sweep.parquet")
    for flag, value, acc in SIM_VALUES:
        _flag_case("simulate", SIM, flag, value, acc, ok_out=True, requests=20)

    def bad_json(ctx: Ctx) -> dict:
        ctx.write("bad.json", "{ this is not json")
        return {}

    simple(BP, "simulate.model-garbage-json", "--model pointing at a garbled config.json",
           [*SIM, "--model", "{tmp}/bad.json"], names=["bad.json"], setup=bad_json)
    simple(BP, "simulate.hardware-garbage-json", "--hardware pointing at a garbled profile",
           [*SIM, "--hardware", "{tmp}/bad.json"], names=["bad.json"], setup=bad_json)
    simple(BP, "simulate.hardware-missing-file", "--hardware ./h100.json that does not exist",
           [*SIM, "--hardware", "{tmp}/h100.json"], names=["h100.json"])
    simple(BP, "simulate.policy-param-bogus", "simulate --policy-param bogus=1",
           [*SIM, "--policy-param", "bogus=1"], names=["bogus"])
    simple(BP, "simulate.policy-param-segments-0", "simulate --policy slru --policy-param segments=0",
           [*SIM, "--policy", "slru", "--policy-param", "segments=0"], names=["segments"])
    simple(BP, "simulate.engine-on-block-trace", "--executor engine on a block-id (mooncake) trace",
           [*SIM, "--executor", "engine"], names=["token"], weight=2)
    simple(BP, "simulate.engine-threads-0", "--executor engine --engine-threads 0",
           ["simulate", "{nat}", "--limit", "5", "--quiet", "--executor", "engine", "--engine-threads", "0"],
           names=["--engine-threads"], range_hint=True, weight=2)
    simple(BP, "simulate.engine-model-unknown", "--executor engine --engine-model nope",
           ["simulate", "{nat}", "--limit", "5", "--quiet", "--executor", "engine", "--engine-model", "nope"],
           names=["nope"], weight=2)
    for flag, value, acc in STATS_VALUES:
        _flag_case("stats", STATS + ["{moon}"], flag, value, acc, ok_out=False, requests=60, check_kind="stats")
    for flag, value, acc in CAL_VALUES:
        cid = f"calibrate.{_slug(flag)}.{_slug(value)}"
        simple(BP, cid, f"calibrate {flag} {value!r}",
               ["calibrate", "--quick", "--quiet", flag, value, "--out", "{tmp}/cal.json"], names=[flag],
               range_hint=acc == "E", timeout=120, weight=6, no_output="{tmp}/cal.json")
    simple(BP, "calibrate.max-context-negative", "calibrate --max-new-tokens 8 --max-context -1",
           ["calibrate", "--quick", "--quiet", "--max-new-tokens", "8", "--max-context", "-1", "--out",
            "{tmp}/cal.json"], names=["--max-context"], range_hint=True, timeout=120, weight=6)
    simple(BP, "calibrate.threads-abc", "calibrate --threads abc", ["calibrate", "--threads", "abc"],
           names=["--threads"])
    simple(BP, "simulate.engine-threads-negative", "--executor engine --engine-threads -1",
           ["simulate", "{nat}", "--limit", "5", "--quiet", "--executor", "engine", "--engine-threads", "-1"],
           names=["--engine-threads"], range_hint=True, weight=2)
    simple(BP, "download.unknown-name", "kvlab download no_such_trace", ["download", "no_such_trace"],
           names=["no_such_trace"])
    simple(BP, "download.offline", "download a trace with no local copy while offline (must fail fast)",
           ["download", "mooncake_toolagent", "--cache-dir", "{tmp}/cache"], names=["toolagent"],
           no_output="{tmp}/cache/toolagent_trace.jsonl")
    simple(BP, "cli.no-command", "kvlab with no sub-command", [], names=[])
    simple(BP, "cli.unknown-command", "kvlab replayy", ["replayy", "{moon}"], names=["replayy"])
    simple(BP, "cli.replay-no-trace", "kvlab replay without a trace", ["replay", *CAP], names=["trace"])
    simple(BP, "cli.unknown-flag", "a misspelt extra flag --capcity", [*REPLAY1, *CAP, "--capcity", "100"],
           names=["--capcity"])


# ================================================================================================
# output locations (and trace header names, which choose sweep folders)
# ================================================================================================
OL = "output location"


def _out_case(cid: str, desc: str, args: Sequence[str], *, setup: Callable[[Ctx], dict | None] | None = None,
              protect: Sequence[str] = (), accept: str = "either", names: Sequence[str] = (),
              check: Callable[[Ctx, Run], str | None] | None = None, **kw) -> None:
    """``names`` that are plain file or folder names are expected as their full path in the message."""
    names = [n if n.startswith(("-", "{")) or n == "name" else "{tmp}/" + n for n in names]
    simple(OL, cid, desc, args, setup=setup, protect=protect, accept=accept, names=names, check=check, **kw)


def _thesis(rel: str = "mydata") -> Callable[[Ctx], dict]:
    def setup(ctx: Ctx) -> dict:
        ctx.sentinel(f"{rel}/thesis.tex", "\\documentclass{article} my thesis\n")
        ctx.sentinel(f"{rel}/figures/plot.pdf", "%PDF-1.4 not really\n")
        return {}

    return setup


def _user_file(rel: str, content: str = "user's own file\n") -> Callable[[Ctx], dict]:
    def setup(ctx: Ctx) -> dict:
        ctx.sentinel(rel, content)
        return {}

    return setup


def _copy_ref(ctx: Ctx, key: str, args: Sequence[str], dest: str) -> Path:
    _, folder = ctx.reference(key, *args)
    d = ctx.path(dest)
    shutil.copytree(folder, d)
    return d


SMALL_SWEEP = ["sweep", "{moon}", "--capacity-blocks", "50", "100", "200", "--engine", "python", "--quiet"]
SINGLE = ["replay", "{moon}", "--capacity-blocks", "100", "--engine", "python", "--quiet"]


def _with_sweep(dest: str) -> Callable[[Ctx], dict]:
    def setup(ctx: Ctx) -> dict:
        ctx.protect(_copy_ref(ctx, "small-sweep", SMALL_SWEEP, dest))
        return {}

    return setup


def _with_replay(dest: str) -> Callable[[Ctx], dict]:
    def setup(ctx: Ctx) -> dict:
        ctx.protect(_copy_ref(ctx, "single-replay", SINGLE, dest))
        return {}

    return setup


def _no_hidden_leftovers(ctx: Ctx, folder: str = ".") -> str | None:
    left = [p.name for p in ctx.path(folder).iterdir() if p.name.startswith(".") and ".old-" in p.name]
    return f"left {left} behind" if left else None


def _register_outputs() -> None:
    _out_case("out.replay-foreign-folder", "replay --out mydata (holds thesis.tex) [issue example]",
              [*SINGLE, "--out", "{tmp}/mydata"], setup=_thesis(), names=["mydata"],
              check=lambda c, r: summary_check(c, "mydata", 60)())
    _out_case("out.replay-existing-file", "replay --out notes.txt, an existing file [issue example]",
              [*SINGLE, "--out", "{tmp}/notes.txt"], setup=_user_file("notes.txt"), accept="error",
              names=["notes.txt"])
    _out_case("out.replay-on-sweep-folder", "a single replay pointed at a sweep folder [issue example]",
              [*SINGLE, "--out", "{tmp}/S"], setup=_with_sweep("S"), accept="error", names=["S"])
    _out_case("out.replay-sweep-on-foreign-folder", "replay with 3 capacities --out a folder with thesis.tex",
              ["replay", "{moon}", "--capacity-blocks", "50", "100", "200", "--engine", "python", "--quiet", "--out",
               "{tmp}/mydata"], setup=_thesis(), names=["mydata"], check=lambda c, r: sweep_check(c, "mydata", 3)())
    _out_case("out.replay-sweep-user-manifest", "replay with 3 capacities --out a folder with the user's own "
              "manifest.json", ["replay", "{moon}", "--capacity-blocks", "50", "100", "200", "--engine", "python",
                                "--quiet", "--out", "{tmp}/mine"],
              setup=_user_file("mine/manifest.json", '{"mine": 1}'),
              names=["mine"], check=lambda c, r: sweep_check(c, "mine", 3)())
    _out_case("out.replay-sweep-on-replay-folder", "replay with 3 capacities --out a single replay's folder",
              ["replay", "{moon}", "--capacity-blocks", "50", "100", "200", "--engine", "python", "--quiet", "--out",
               "{tmp}/R"], setup=_with_replay("R"), names=["R"], check=lambda c, r: sweep_check(c, "R", 3)())
    _out_case("out.sweep-on-replay-folder", "kvlab sweep --out a single replay's folder",
              [*SMALL_SWEEP, "--out", "{tmp}/R"], setup=_with_replay("R"), names=["R"],
              check=lambda c, r: sweep_check(c, "R", 3)())
    _out_case("out.sweep-user-csv", "kvlab sweep --out a folder with the user's own sweep.csv",
              [*SMALL_SWEEP, "--out", "{tmp}/mine"], setup=_user_file("mine/sweep.csv", "a,b\n1,2\n"),
              names=["mine"], check=lambda c, r: sweep_check(c, "mine", 3)())
    _out_case("out.sweep-foreign-folder", "kvlab sweep --out a folder with thesis.tex",
              [*SMALL_SWEEP, "--out", "{tmp}/mydata"], setup=_thesis(), names=["mydata"],
              check=lambda c, r: sweep_check(c, "mydata", 3)())
    _out_case("out.replay-over-own-replay", "replay --out the folder of an earlier replay (other capacity)",
              ["replay", "{moon}", "--capacity-blocks", "200", "--engine", "python", "--quiet", "--out", "{tmp}/R"],
              setup=lambda c: {"_": _copy_ref(c, "single-replay", SINGLE, "R")}, names=["R"],
              check=lambda c, r: summary_check(c, "R", 60)() or (
                  None if read_json(c.path("R") / "summary.json").get("capacity_blocks") == 200
                  else "summary is not the new run's") or _no_hidden_leftovers(c))
    _out_case("out.under-a-file", "--out notes.txt/sub where notes.txt is a file",
              [*SINGLE, "--out", "{tmp}/notes.txt/sub"], setup=_user_file("notes.txt"), accept="error",
              names=["notes.txt"])
    _out_case("out.sweep-under-a-file", "sweep --out notes.txt/sub", [*SMALL_SWEEP, "--out", "{tmp}/notes.txt/sub"],
              setup=_user_file("notes.txt"), accept="error", names=["notes.txt"])
    _out_case("out.sweep-on-a-file", "sweep --out an existing file", [*SMALL_SWEEP, "--out", "{tmp}/notes.txt"],
              setup=_user_file("notes.txt"), accept="error", names=["notes.txt"])

    def readonly(ctx: Ctx) -> dict:
        ctx.path("ro").mkdir()
        ctx.path("ro").chmod(0o555)
        return {}

    _out_case("out.unwritable-folder", "--out inside a read-only folder (capabilities dropped)",
              [*SINGLE, "--out", "{tmp}/ro/R"], setup=readonly, accept="error", names=["ro"], drop_dac=True)
    _out_case("out.sweep-unwritable-folder", "sweep --out inside a read-only folder",
              [*SMALL_SWEEP, "--out", "{tmp}/ro/S"], setup=readonly, accept="error", names=["ro"], drop_dac=True)
    _out_case("out.simulate-unwritable-folder", "simulate --out inside a read-only folder",
              [*SIM, "--out", "{tmp}/ro/R"], setup=readonly, accept="error", names=["ro"], drop_dac=True)

    def deep(ctx: Ctx) -> dict:
        ctx.path("a/b").mkdir(parents=True)
        return {}

    def link(ctx: Ctx) -> dict:
        _thesis()(ctx)
        os.symlink(ctx.path("mydata"), ctx.path("link"))
        return {}

    @case(OL, "out.symlink-to-foreign-folder", "--out a symlink to a folder holding thesis.tex")
    def symlink_out(ctx: Ctx) -> Verdict:
        link(ctx)
        run = ctx.run(*SINGLE, "--out", "{tmp}/link")
        lk = ctx.path("link")
        if not lk.is_symlink() or os.readlink(lk) != str(ctx.path("mydata")):
            return Verdict("data loss", "the user's symlink 'link' was moved or replaced", run)
        return judge_either(run, [ctx.fmt("{tmp}/link")], summary_check(ctx, "link", 60))
    _out_case("out.sweep-trace-folder-taken", "sweep --out S where S/moon (the trace's folder) is a user's file",
              [*SMALL_SWEEP, "--out", "{tmp}/S"], setup=_user_file("S/moon", "not a folder\n"), names=["S"],
              check=lambda c, r: sweep_check(c, "S", 3)())
    _out_case("out.relative-dotdot", "--out ../res from a sub-folder (valid)", [*SINGLE, "--out", "../res"],
              cwd="{tmp}/a/b", setup=deep, accept="ok", check=lambda c, r: summary_check(c, "a/res", 60)())
    _out_case("out.spaces-unicode", "--out 'my results/résumé 数据' (valid)",
              [*SINGLE, "--out", "{tmp}/my results/résumé 数据"], accept="ok",
              check=lambda c, r: summary_check(c, "my results/résumé 数据", 60)())
    _out_case("out.sweep-spaces-unicode", "sweep --out 'my results/ünï' (valid)",
              [*SMALL_SWEEP, "--out", "{tmp}/my results/ünï"], accept="ok",
              check=lambda c, r: sweep_check(c, "my results/ünï", 3)())
    _out_case("out.trailing-slash", "--out res/ (valid)", [*SINGLE, "--out", "{tmp}/res/"], accept="ok",
              check=lambda c, r: summary_check(c, "res", 60)())
    _out_case("out.empty-string", "--out '' with the user's files in the current folder",
              [*SINGLE, "--out", ""], setup=_thesis("."), accept="error", names=["--out"])
    _out_case("out.dot", "--out . (the current folder holds the user's files)", [*SINGLE, "--out", "."],
              setup=_thesis("."), names=[], check=lambda c, r: summary_check(c, ".", 60)())
    _out_case("out.the-trace-itself", "--out the trace file itself", [*SINGLE[:1], "{tmp}/my.jsonl", *SINGLE[2:],
                                                                       "--out", "{tmp}/my.jsonl"],
              setup=lambda c: {"_": c.sentinel("my.jsonl", "\n".join(moon_lines(c)) + "\n")}, accept="error",
              names=["my.jsonl"])
    _out_case("out.the-trace-folder", "--out the folder that holds the trace", [*SINGLE[:1], "{tmp}/data/my.jsonl",
                                                                                 *SINGLE[2:], "--out", "{tmp}/data"],
              setup=lambda c: {"_": c.sentinel("data/my.jsonl", "\n".join(moon_lines(c)) + "\n")}, names=["data"],
              check=lambda c, r: summary_check(c, "data", 60)())
    _out_case("out.name-too-long", "--out with a 300-character name", [*SINGLE, "--out", "{tmp}/" + "x" * 300],
              accept="error", names=["x" * 40])
    _out_case("out.simulate-foreign-folder", "simulate --out a folder with thesis.tex",
              [*SIM, "--out", "{tmp}/mydata"], setup=_thesis(), names=["mydata"],
              check=lambda c, r: summary_check(c, "mydata", 20)())
    _out_case("out.simulate-existing-file", "simulate --out an existing file", [*SIM, "--out", "{tmp}/notes.txt"],
              setup=_user_file("notes.txt"), accept="error", names=["notes.txt"])
    _out_case("out.simulate-on-sweep-folder", "simulate --out a sweep folder", [*SIM, "--out", "{tmp}/S"],
              setup=_with_sweep("S"), accept="error", names=["S"])
    _out_case("out.demo-foreign-folder", "demo --out a folder with the user's own summary.csv",
              ["demo", "--quick", "--quiet", "--out", "{tmp}/mine"], setup=_user_file("mine/summary.csv", "x\n1\n"),
              names=["mine"], check=lambda c, r: sweep_check(c, "mine", 5)(), weight=3)
    _out_case("out.demo-under-file", "demo --out notes.txt/sub", ["demo", "--quick", "--quiet", "--out",
                                                                  "{tmp}/notes.txt/sub"],
              setup=_user_file("notes.txt"), accept="error", names=["notes.txt"])
    _out_case("out.download-cache-under-file", "download --cache-dir notes.txt/sub (no local copy)",
              ["download", "mooncake_toolagent", "--cache-dir", "{tmp}/notes.txt/sub"], setup=_user_file("notes.txt"),
              accept="error", names=["notes.txt"])
    _out_case("out.calibrate-out-folder", "calibrate --out an existing folder", ["calibrate", "--quick", "--quiet",
                                                                                 "--out", "{tmp}/mydata"],
              setup=_thesis(), accept="error", names=["mydata"], timeout=120, weight=6)

    # -- trace header names: the folder a sweep writes to
    def named(name: str, victim: bool = False) -> Callable[[Ctx], dict]:
        def setup(ctx: Ctx) -> dict:
            header = {**NATIVE_HEADER, "name": ctx.fmt(name) if "{" in name else name}
            ctx.write("trace.jsonl", native_text(header))
            ctx.path("a/b").mkdir(parents=True)
            if victim:
                ctx.sentinel("victim/thesis.tex", "my thesis\n")
            ctx.vars["_before"] = json.dumps(sorted(str(p) for p in ctx.listing()))
            return {}

        return setup

    def confined(ctx: Ctx, run: Run) -> str | None:
        before = set(json.loads(ctx.vars["_before"]))
        out = ctx.path("a/b/S")
        escaped = sorted(str(p.relative_to(ctx.root)) for p in ctx.listing()
                         if str(p) not in before and not (p == out or out in p.parents))
        if escaped:
            return f"wrote outside --out: {escaped[:3]}"
        return sweep_check(ctx, "a/b/S", 1, 80)()

    for cid, name, desc, victim in [
        ("name.dotdot", "../../escape", "header name '../../escape' [issue example]", False),
        ("name.absolute", "{tmp}/victim", "header name = an absolute path to a user folder [issue example]", True),
        ("name.parent", "..", "header name '..'", False),
        ("name.slash", "a/b", "header name 'a/b'", False),
        ("name.empty", "", "header name ''", False),
        ("name.dot", ".", "header name '.'", False),
        ("name.long", "n" * 300, "header name of 300 characters", False),
        ("name.unicode", "数据-résumé ü", "header name in Unicode with spaces (valid)", False),
        ("name.nul", "a\u0000b", "header name with a NUL character", False),
        ("name.sweep-parquet", "sweep.parquet", "header name 'sweep.parquet' (collides with the table)", False),
        ("name.newline", "two\nlines", "header name with a newline", False),
    ]:
        _out_case(cid, desc, ["sweep", "{tmp}/trace.jsonl", "--capacity-blocks", "64", "--engine", "python",
                              "--quiet", "--out", "{tmp}/a/b/S"], setup=named(name, victim), names=["name"],
                  check=confined)

    @case(OL, "name.same-name-two-traces", "two different traces with the same file name in one sweep")
    def same_name(ctx: Ctx) -> Verdict:
        ctx.write("d1/trace.jsonl", Path(ctx.vars["moon"]).read_text())
        ctx.write("d2/trace.jsonl", Path(ctx.vars["moonb"]).read_text())
        r1 = ctx.run("sweep", "{tmp}/d1/trace.jsonl", "--capacity-blocks", "100", "--engine", "python", "--quiet",
                     "--out", "{tmp}/ref1")
        r2 = ctx.run("sweep", "{tmp}/d2/trace.jsonl", "--capacity-blocks", "100", "--engine", "python", "--quiet",
                     "--out", "{tmp}/ref2")
        for r in (r1, r2):
            if r.rc != 0:
                return failure_of(r, "a single-trace sweep failed")
        run = ctx.run("sweep", "{tmp}/d1/trace.jsonl", "{tmp}/d2/trace.jsonl", "--capacity-blocks", "100",
                      "--engine", "python", "--quiet", "--out", "{tmp}/S")

        def check() -> str | None:
            import pandas as pd

            got = read_table(ctx.path("S/sweep.parquet"))
            want = pd.concat([read_table(ctx.path("ref1/sweep.parquet")), read_table(ctx.path("ref2/sweep.parquet"))])
            if len(got) != 2:
                return f"{len(got)} rows, expected 2"
            got_rates = sorted(got["token_hit_rate"].round(12))
            want_rates = sorted(want["token_hit_rate"].round(12))
            return None if got_rates == want_rates else (
                f"token_hit_rate {got_rates}, separate runs give {want_rates} (one trace served the other's results)")

        return judge_either(run, ["trace"], check)


# ================================================================================================
# interruption and resume
# ================================================================================================
IR = "interruption"
SWEEP30 = ["sweep", "{moon300}", "--policy", "lru", "fifo", "lfu", "--capacity-blocks", "50", "100", "200", "400",
           "800", "--mode", "vllm", "ideal", "--engine", "python", "--quiet"]
REPLAY30 = ["replay", *SWEEP30[1:]]


def _table_or_none(path: Path):
    try:
        return read_table(path)
    except Exception:
        return None


def _stats(folder: Path, name: str) -> dict[Path, tuple[int, int]]:
    """(inode, mtime) of every file called ``name`` under ``folder``; safe while another process renames
    and removes folders there (os.walk skips what vanished)."""
    out = {}
    for parent, _, files in os.walk(folder):
        if name in files:
            p = Path(parent) / name
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                st = p.stat()
                out[p] = (st.st_ino, st.st_mtime_ns)
    return out


def _run_files(folder: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every per-run requests table: unchanged when a resume reads runs back."""
    return {str(p.relative_to(folder)): v for p, v in _stats(folder, "requests.parquet").items()}


def _kill_fresh(seed: int, sig: int = signal.SIGKILL) -> Callable[[Ctx], Verdict]:
    def fn(ctx: Ctx) -> Verdict:
        ref_run, ref = ctx.reference("sweep30", *SWEEP30)
        t = random.Random(ctx.seed * 7919 + seed).uniform(0.25, 1.0) * ref_run.seconds
        p = ctx.start(*SWEEP30, "--out", "{tmp}/S")
        time.sleep(t)
        p.send(sig)
        first = ctx.finish(p)
        if sig == signal.SIGINT:
            bad = judge_interrupted(first)
            if bad:
                return bad
        elif first.traceback:
            return Verdict("traceback", f"after signal {sig}: {first.last_line}", first)
        run = ctx.run(*SWEEP30, "--out", "{tmp}/S")
        return judge_ok(run, lambda: same_table(read_table(ctx.path("S/sweep.parquet")),
                                                read_table(ref / "sweep.parquet")))

    return fn


def _tables(folder: Path) -> dict[Path, tuple[int, int]]:
    """(inode, mtime) of every sweep.parquet under ``folder`` (top-level and per trace)."""
    return _stats(folder, "sweep.parquet")


def _kill_rerun(command: Sequence[str], key: str, seed: int | None) -> Callable[[Ctx], Verdict]:
    """A complete 30-row sweep; a --no-resume rerun killed at a seeded moment (``seed``) or the moment any of
    its sweep.parquet tables changes (``seed`` None); every complete table must survive (unchanged, or
    replaced by an equally complete one); then a resume must match a clean run."""

    def fn(ctx: Ctx) -> Verdict:
        ref_run, ref = ctx.reference(key, *command)
        s = _copy_ref(ctx, key, command, "S")
        before = {p: p.read_bytes() for p in _tables(s)}
        stamps = _tables(s)
        p = ctx.start(*command, "--no-resume", "--out", "{tmp}/S")
        if seed is None:
            deadline = time.monotonic() + ctx.runner.opts.timeout
            while p.alive() and time.monotonic() < deadline and _tables(s) == stamps:
                time.sleep(0.005)
        else:
            time.sleep(random.Random(ctx.seed * 104729 + seed).uniform(0.25, 1.0) * ref_run.seconds)
        p.send(signal.SIGKILL)
        first = ctx.finish(p)
        if first.traceback:
            return Verdict("traceback", first.last_line, first)
        for table, data in before.items():
            rel = table.relative_to(s)
            if not table.is_file():
                return Verdict("data loss", f"the complete S/{rel} is gone after the kill", first)
            if table.read_bytes() != data:
                t = _table_or_none(table)
                if t is None:
                    return Verdict("data loss", f"S/{rel} unreadable after the kill", first)
                msg = same_table(t, read_table(ref / rel))
                if msg:
                    return Verdict("data loss", f"the complete S/{rel} was replaced: {msg}", first)
        run = ctx.run(*command, "--out", "{tmp}/S")
        return judge_ok(run, lambda: same_table(read_table(s / "sweep.parquet"), read_table(ref / "sweep.parquet")))

    return fn


def _register_interruption() -> None:
    for i in range(4):
        register(IR, f"kill.fresh-sweep.{i}", f"SIGKILL a fresh 30-run sweep at a seeded moment (#{i}), resume",
                 _kill_fresh(i), weight=4)
    for i in range(3):
        register(IR, f"kill.rerun-sweep.{i}", f"SIGKILL a --no-resume sweep rerun over a complete 30-row sweep "
                 f"(#{i}) [issue example]", _kill_rerun(SWEEP30, "sweep30", i), weight=4)
        register(IR, f"kill.rerun-replay.{i}", f"SIGKILL a --no-resume 'replay' rerun (30 configs) over its complete "
                 f"table (#{i}) [issue example]", _kill_rerun(REPLAY30, "replay30", i), weight=4)
    register(IR, "kill.rerun-sweep.on-table-write", "SIGKILL a sweep rerun the moment a sweep.parquet changes",
             _kill_rerun(SWEEP30, "sweep30", None), weight=4)
    register(IR, "kill.rerun-replay.on-table-write", "SIGKILL a 'replay' rerun the moment its sweep.parquet changes",
             _kill_rerun(REPLAY30, "replay30", None), weight=4)
    for i in range(2):
        register(IR, f"sigint.sweep.{i}", f"Ctrl-C a sweep at a seeded moment (#{i}): clean message, then resume",
                 _kill_fresh(100 + i, signal.SIGINT), weight=4)
    register(IR, "sigterm.sweep", "SIGTERM a sweep, then resume", _kill_fresh(200, signal.SIGTERM), weight=4)

    @case(IR, "kill.single-replay-over-result", "SIGKILL a replay writing over an earlier complete result",
          weight=3)
    def kill_single(ctx: Ctx) -> Verdict:
        args = ["replay", "{moon300}", "--capacity-blocks", "100", "--engine", "python", "--quiet", "--out",
                "{tmp}/R"]
        first = ctx.run(*args)
        if first.rc != 0:
            return failure_of(first, "first replay")
        summary = ctx.path("R/summary.json").read_bytes()
        p = ctx.start(*args[:3], "200", *args[4:])
        deadline = time.monotonic() + ctx.runner.opts.timeout
        while p.alive() and time.monotonic() < deadline and not any(
                x.name.startswith(".R") for x in ctx.root.iterdir()):
            time.sleep(0.01)
        p.send(signal.SIGKILL)
        killed = ctx.finish(p)
        s = ctx.path("R/summary.json")
        if not s.is_file() or not ctx.path("R/manifest.json").is_file():
            return Verdict("data loss", "the earlier result is gone/incomplete after the kill", killed)
        if s.read_bytes() != summary and sane_summary(read_json(s), 300):
            return Verdict("data loss", "R/summary.json is neither the old nor a complete new result", killed)
        return Verdict("correct result", "", killed)

    @case(IR, "sigint.single-replay", "Ctrl-C a long replay: one clean line, no traceback", weight=2)
    def sigint_replay(ctx: Ctx) -> Verdict:
        p = ctx.start("replay", "{conv}", "--capacity-blocks", "1000", "--engine", "python", "--out", "{tmp}/R")
        deadline = time.monotonic() + ctx.runner.opts.timeout
        while p.alive() and time.monotonic() < deadline and "replay" not in b"".join(p._err).decode(errors="replace"):
            time.sleep(0.05)
        time.sleep(0.3)
        p.send(signal.SIGINT)
        run = ctx.finish(p)
        bad = judge_interrupted(run)
        if bad:
            return bad
        if run.rc == 0:
            return judge_ok(run, summary_check(ctx, "R", 12031))
        if ctx.path("R").exists():
            return Verdict("silent wrong", "interrupted replay left a results folder", run)
        return Verdict("clear error", run.last_line, run)

    @case(IR, "sigint.simulate", "Ctrl-C a simulation: one clean line, no traceback", weight=2)
    def sigint_sim(ctx: Ctx) -> Verdict:
        p = ctx.start("simulate", "{conv}", "--no-fast-forward", "--out", "{tmp}/R")
        deadline = time.monotonic() + ctx.runner.opts.timeout
        while p.alive() and time.monotonic() < deadline and not p._err:
            time.sleep(0.05)
        time.sleep(0.5)
        p.send(signal.SIGINT)
        run = ctx.finish(p)
        bad = judge_interrupted(run)
        if bad:
            return bad
        if run.rc != 0 and ctx.path("R").exists():
            return Verdict("silent wrong", "interrupted simulation left a results folder", run)
        return Verdict("clear error" if run.rc else "correct result", run.last_line, run)

    @case(IR, "resume.without-block-size", "rerun a finished sweep without --block-size: nothing is redone "
          "[issue example]", weight=2)
    def resume_no_bs(ctx: Ctx) -> Verdict:
        args = ["replay", "{moon}", "--capacity-blocks", "100", "200", "--engine", "python", "--quiet", "--out",
                "{tmp}/S"]
        first = ctx.run(*args)
        if first.rc != 0:
            return failure_of(first, "first run")
        files = _run_files(ctx.path("S"))
        table = read_table(ctx.path("S/sweep.parquet"))
        run = ctx.run(*args)

        def check() -> str | None:
            if not files:
                return "no per-run requests.parquet on disk"
            if _run_files(ctx.path("S")) != files:
                return "the finished runs were replayed again instead of read back"
            return same_table(read_table(ctx.path("S/sweep.parquet")), table)

        return judge_ok(run, check)

    @case(IR, "resume.default-policy-param", "rerun a sweep with a policy parameter spelt out at its default: "
          "same numbers", weight=2)
    def resume_param(ctx: Ctx) -> Verdict:
        args = ["replay", "{moon}", "--capacity-blocks", "100", "200", "--policy", "slru", "--engine", "python",
                "--quiet", "--out", "{tmp}/S"]
        first = ctx.run(*args)
        if first.rc != 0:
            return failure_of(first, "first run")
        table = read_table(ctx.path("S/sweep.parquet"))
        run = ctx.run(*args, "--policy-param", "segments=4")
        return judge_ok(run, lambda: same_table(read_table(ctx.path("S/sweep.parquet")), table))

    @case(IR, "kill.demo", "SIGKILL the demo half-way, run it again: same numbers as a clean demo", weight=5)
    def kill_demo(ctx: Ctx) -> Verdict:
        ref_run, ref = ctx.reference("demo", "demo", "--quick", "--quiet")
        p = ctx.start("demo", "--quick", "--quiet", "--out", "{tmp}/D")
        time.sleep(random.Random(ctx.seed + 31).uniform(0.4, 0.9) * ref_run.seconds)
        p.send(signal.SIGKILL)
        ctx.finish(p)
        run = ctx.run("demo", "--quick", "--quiet", "--out", "{tmp}/D")
        return judge_ok(run, lambda: same_table(read_table(ctx.path("D/sweep.parquet")),
                                                read_table(ref / "sweep.parquet")))


# ================================================================================================
# concurrency
# ================================================================================================
CC = "concurrency"
SWEEP_A = ["sweep", "{moon}", "--policy", "lru", "fifo", "lfu", "--capacity-blocks", "30", "50", "70", "100", "150",
           "200", "300", "400", "--engine", "python", "--quiet"]
SWEEP_B = ["sweep", "{moon}", "--policy", "lru", "sieve", "--capacity-blocks", "40", "60", "80", "120", "160", "240",
           "--engine", "python", "--quiet"]


def _concurrent(ctx: Ctx, commands: list[list[str]], delays: Sequence[float]) -> list[Run]:
    procs = []
    for cmd, delay in zip(commands, delays, strict=True):
        time.sleep(delay)
        procs.append(ctx.start(*cmd))
    return [ctx.finish(p) for p in procs]


def _concurrency_verdict(runs: list[Run], check: Callable[[], str | None]) -> Verdict:
    """Every process: exit 0, or a clear error (e.g. 'folder in use'); at least one succeeds; check() holds."""
    for r in runs:
        if r.rc != 0:
            v = judge_error(r)
            if v.outcome != "clear error":
                return v
    ok = [r for r in runs if r.rc == 0]
    if not ok:
        return Verdict("silent wrong", "no process finished", runs[0])
    return judge_ok(ok[-1], check)


def _register_concurrency() -> None:
    for i, delays in enumerate([(0.0, 0.0), (0.0, 0.7), (0.0, 1.5)]):
        @case(CC, f"two-sweeps.same.{i}", f"two identical sweeps on one folder (second starts {delays[1]} s later) "
              "[issue example]", weight=4)
        def same(ctx: Ctx, delays=delays) -> Verdict:
            _, ref = ctx.reference("sweepA", *SWEEP_A)
            runs = _concurrent(ctx, [[*SWEEP_A, "--out", "{tmp}/S"]] * 2, delays)
            return _concurrency_verdict(runs, lambda: same_table(read_table(ctx.path("S/sweep.parquet")),
                                                                 read_table(ref / "sweep.parquet")))

    @case(CC, "two-sweeps.different", "two different sweeps on one folder at once", weight=4)
    def different(ctx: Ctx) -> Verdict:
        _, ref_a = ctx.reference("sweepA", *SWEEP_A)
        _, ref_b = ctx.reference("sweepB", *SWEEP_B)
        runs = _concurrent(ctx, [[*SWEEP_A, "--out", "{tmp}/S"], [*SWEEP_B, "--out", "{tmp}/S"]], (0.0, 0.3))

        def check() -> str | None:
            t = read_table(ctx.path("S/sweep.parquet"))
            a = same_table(t, read_table(ref_a / "sweep.parquet"))
            b = same_table(t, read_table(ref_b / "sweep.parquet"))
            return None if a is None or b is None else f"sweep.parquet matches neither sweep ({a}; {b})"

        v = _concurrency_verdict(runs, check)
        if v.outcome != "correct result":
            return v
        again = ctx.run(*SWEEP_A, "--out", "{tmp}/S")  # the runs/ folder must still serve A correctly
        return judge_ok(again, lambda: same_table(read_table(ctx.path("S/sweep.parquet")),
                                                  read_table(ref_a / "sweep.parquet")))

    @case(CC, "three-sweeps.same", "three identical sweeps on one folder at once", weight=5)
    def three(ctx: Ctx) -> Verdict:
        _, ref = ctx.reference("sweepA", *SWEEP_A)
        runs = _concurrent(ctx, [[*SWEEP_A, "--out", "{tmp}/S"]] * 3, (0.0, 0.2, 0.4))
        return _concurrency_verdict(runs, lambda: same_table(read_table(ctx.path("S/sweep.parquet")),
                                                             read_table(ref / "sweep.parquet")))

    @case(CC, "two-replays.same-out", "two single replays (different capacities) to one --out at once", weight=3)
    def two_replays(ctx: Ctx) -> Verdict:
        base = ["replay", "{moon300}", "--engine", "python", "--quiet", "--out", "{tmp}/R", "--capacity-blocks"]
        runs = _concurrent(ctx, [[*base, "100"], [*base, "200"]], (0.0, 0.0))

        def check() -> str | None:
            s = read_json(ctx.path("R/summary.json"))
            return sane_summary(s, 300) or (None if s.get("capacity_blocks") in (100, 200) else "odd capacity")

        return _concurrency_verdict(runs, check)

    @case(CC, "sweep-and-replay.same-out", "a sweep and a single replay on one folder at once", weight=3)
    def sweep_and_replay(ctx: Ctx) -> Verdict:
        _, ref = ctx.reference("sweepA", *SWEEP_A)
        runs = _concurrent(ctx, [[*SWEEP_A, "--out", "{tmp}/S"],
                                 ["replay", "{moon}", "--capacity-blocks", "100", "--engine", "python", "--quiet",
                                  "--out", "{tmp}/S"]], (0.0, 1.0))
        for r in runs:
            if r.rc != 0 and judge_error(r).outcome != "clear error":
                return judge_error(r)
        if runs[0].rc == 0:
            t = _table_or_none(ctx.path("S/sweep.parquet"))
            if t is None:
                return Verdict("data loss", "the sweep reported success but its sweep.parquet is gone", runs[0])
            msg = same_table(t, read_table(ref / "sweep.parquet"))
            if msg:
                return Verdict("data loss", f"the sweep's table was changed: {msg}", runs[0])
        if runs[1].rc == 0 and runs[0].rc == 0:
            return Verdict("silent wrong", "both succeeded on one folder: a replay and a sweep share it", runs[1])
        return Verdict("correct result", "", runs[0])

    @case(CC, "two-sweeps.two-traces", "two sweeps of different traces into one --out at once", weight=4)
    def two_traces(ctx: Ctx) -> Verdict:
        base = ["--capacity-blocks", "50", "100", "--engine", "python", "--quiet", "--out", "{tmp}/S"]
        runs = _concurrent(ctx, [["sweep", "{moon}", *base], ["sweep", "{moonb}", *base]], (0.0, 0.0))

        def check() -> str | None:
            t = read_table(ctx.path("S/sweep.parquet"))
            return sane_table(t, None, 60) or (None if len(t) in (2, 4) else f"{len(t)} rows, expected 2 or 4")

        return _concurrency_verdict(runs, check)

    @case(CC, "two-simulates.same-out", "two simulations to one --out at once", weight=3)
    def two_sims(ctx: Ctx) -> Verdict:
        runs = _concurrent(ctx, [[*SIM, "--out", "{tmp}/R"], [*SIM, "--policy", "fifo", "--out", "{tmp}/R"]],
                           (0.0, 0.0))
        return _concurrency_verdict(runs, summary_check(ctx, "R", 20))

    @case(CC, "two-demos.same-out", "two demos (--quick) on one --out at once", weight=6)
    def two_demos(ctx: Ctx) -> Verdict:
        _, ref = ctx.reference("demo", "demo", "--quick", "--quiet")
        runs = _concurrent(ctx, [["demo", "--quick", "--quiet", "--out", "{tmp}/D"]] * 2, (0.0, 0.5))
        return _concurrency_verdict(runs, lambda: same_table(read_table(ctx.path("D/sweep.parquet")),
                                                             read_table(ref / "sweep.parquet")))

    @case(CC, "resume-during-no-resume", "a resuming sweep while a --no-resume sweep rewrites the same folder",
          weight=4)
    def resume_vs_redo(ctx: Ctx) -> Verdict:
        _, ref = ctx.reference("sweepA", *SWEEP_A)
        _copy_ref(ctx, "sweepA", SWEEP_A, "S")
        runs = _concurrent(ctx, [[*SWEEP_A, "--no-resume", "--out", "{tmp}/S"], [*SWEEP_A, "--out", "{tmp}/S"]],
                           (0.0, 0.5))
        return _concurrency_verdict(runs, lambda: same_table(read_table(ctx.path("S/sweep.parquet")),
                                                             read_table(ref / "sweep.parquet")))


# ================================================================================================
# corrupt or stale results on disk
# ================================================================================================
CR = "corrupt result"


def _first_run_dir(s: Path) -> Path | None:
    runs = sorted(p.parent for p in s.rglob("summary.json") if p.parent != s)
    return runs[0] if runs else None


def _corrupt_case(cid: str, desc: str, damage: Callable[[Ctx, Path, Path], None], *, name_file: bool = True) -> None:
    """A complete small sweep, ``damage(ctx, sweep_folder, one_run_folder)``, then the same sweep again:
    recompute (numbers == fresh) or refuse naming the damaged file; never serve wrong numbers."""

    def fn(ctx: Ctx) -> Verdict:
        _, ref = ctx.reference("small-sweep", *SMALL_SWEEP)
        s = _copy_ref(ctx, "small-sweep", SMALL_SWEEP, "S")
        run_dir = _first_run_dir(s)
        if run_dir is None:
            return Verdict("harness error", "no run folder with summary.json in the sweep")
        ctx.vars["damaged"] = run_dir.name
        damage(ctx, s, run_dir)
        run = ctx.run(*SMALL_SWEEP, "--out", "{tmp}/S")
        return judge_either(run, [run_dir.name] if name_file else [],
                            lambda: same_table(read_table(s / "sweep.parquet"), read_table(ref / "sweep.parquet")))

    register(CR, cid, desc, fn, weight=2)


def _truncate(rel: str, frac: float = 0.5) -> Callable[[Ctx, Path, Path], None]:
    def damage(ctx: Ctx, s: Path, run: Path) -> None:
        p = (s if rel.startswith("/") else run) / rel.lstrip("/")
        data = p.read_bytes()
        p.write_bytes(data[: int(len(data) * frac)])

    return damage


def _overwrite(rel: str, data: bytes | str) -> Callable[[Ctx, Path, Path], None]:
    def damage(ctx: Ctx, s: Path, run: Path) -> None:
        p = (s if rel.startswith("/") else run) / rel.lstrip("/")
        p.write_bytes(data if isinstance(data, bytes) else data.encode())

    return damage


def _delete(rel: str) -> Callable[[Ctx, Path, Path], None]:
    def damage(ctx: Ctx, s: Path, run: Path) -> None:
        p = (s if rel.startswith("/") else run) / rel.lstrip("/")
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()

    return damage


def _edit_summary(ctx: Ctx, s: Path, run: Path) -> None:
    p = run / "summary.json"
    d = json.loads(p.read_text())
    d["token_hit_rate"] = 0.987654321
    d["evictions"] = 7
    p.write_text(json.dumps(d, indent=2))


def _register_corrupt() -> None:
    _corrupt_case("corrupt.requests-truncated", "a run's requests.parquet cut in half, then resume",
                  _truncate("requests.parquet"))
    _corrupt_case("corrupt.requests-garbage", "a run's requests.parquet overwritten with garbage",
                  _overwrite("requests.parquet", random.Random(3).randbytes(500)))
    _corrupt_case("corrupt.requests-deleted", "a run's requests.parquet deleted", _delete("requests.parquet"))
    _corrupt_case("corrupt.summary-garbled", "a run's summary.json garbled", _truncate("summary.json", 0.6))
    _corrupt_case("corrupt.summary-empty", "a run's summary.json emptied", _overwrite("summary.json", ""))
    _corrupt_case("corrupt.summary-list", "a run's summary.json replaced by []", _overwrite("summary.json", "[]"))
    _corrupt_case("corrupt.summary-deleted", "a run's summary.json deleted", _delete("summary.json"))
    _corrupt_case("corrupt.summary-edited", "a run's summary.json edited to other (valid) numbers", _edit_summary)
    _corrupt_case("corrupt.manifest-garbled", "a run's manifest.json garbled", _truncate("manifest.json", 0.5),
                  name_file=False)
    _corrupt_case("corrupt.manifest-list", "a run's manifest.json replaced by []", _overwrite("manifest.json", "[]"),
                  name_file=False)
    _corrupt_case("corrupt.run-is-file", "a run folder replaced by a file", lambda c, s, r: (shutil.rmtree(r),
                  r.write_text("oops")), name_file=False)
    _corrupt_case("corrupt.sweep-table-truncated", "the top-level sweep.parquet cut in half",
                  _truncate("/sweep.parquet"), name_file=False)
    _corrupt_case("corrupt.sweep-manifest-garbled", "the top-level manifest.json garbled (if any)",
                  lambda c, s, r: [p.write_text("{") for p in s.rglob("manifest.json")
                                   if (p.parent / "sweep.parquet").exists()],
                  name_file=False)
    _corrupt_case("corrupt.stale-temp-folders", "hidden temp folders of a killed run left in the sweep",
                  lambda c, s, r: [(r.parent / f".{r.name}.tmp-abc123").mkdir(),
                                   (r.parent / f".{r.name}.tmp-abc123" / "requests.parquet").write_text("x")],
                  name_file=False)

    @case(CR, "stale.limit-50-then-2000", "replay --limit 50 ... --out S, then --limit 2000 into S "
          "[issue example]", weight=3)
    def stale_limit(ctx: Ctx) -> Verdict:
        base = ["replay", "{conv}", "--block-size", "512", "--capacity-blocks", "100", "200", "--engine", "python",
                "--quiet"]
        first = ctx.run(*base, "--limit", "50", "--out", "{tmp}/S")
        if first.rc != 0:
            return failure_of(first, "first run")
        fresh = ctx.run(*base, "--limit", "2000", "--out", "{tmp}/fresh")
        if fresh.rc != 0:
            return failure_of(fresh, "fresh run")
        run = ctx.run(*base, "--limit", "2000", "--out", "{tmp}/S")
        return judge_either(run, ["S"], lambda: same_table(read_table(ctx.path("S/sweep.parquet")),
                                                           read_table(ctx.path("fresh/sweep.parquet"))))

    @case(CR, "stale.other-trace", "replay trace A --out S, then trace B (same name) --out S [issue example]",
          weight=3)
    def stale_trace(ctx: Ctx) -> Verdict:
        ctx.write("a/trace.jsonl", Path(ctx.vars["moon"]).read_text())
        ctx.write("b/trace.jsonl", Path(ctx.vars["moonb"]).read_text())
        base = ["--capacity-blocks", "100", "200", "--engine", "python", "--quiet"]
        first = ctx.run("replay", "{tmp}/a/trace.jsonl", *base, "--out", "{tmp}/S")
        if first.rc != 0:
            return failure_of(first, "first run")
        fresh = ctx.run("replay", "{tmp}/b/trace.jsonl", *base, "--out", "{tmp}/fresh")
        if fresh.rc != 0:
            return failure_of(fresh, "fresh run")
        run = ctx.run("replay", "{tmp}/b/trace.jsonl", *base, "--out", "{tmp}/S")
        return judge_either(run, ["S"], lambda: same_table(read_table(ctx.path("S/sweep.parquet")),
                                                           read_table(ctx.path("fresh/sweep.parquet"))))

    @case(CR, "stale.trace-edited-in-place", "the trace file edited in place between two sweeps into one folder",
          weight=3)
    def stale_edit(ctx: Ctx) -> Verdict:
        ctx.write("trace.jsonl", Path(ctx.vars["moon"]).read_text())
        base = ["sweep", "{tmp}/trace.jsonl", "--capacity-blocks", "100", "200", "--engine", "python", "--quiet"]
        first = ctx.run(*base, "--out", "{tmp}/S")
        if first.rc != 0:
            return failure_of(first, "first run")
        ctx.write("trace.jsonl", Path(ctx.vars["moonb"]).read_text())
        fresh = ctx.run(*base, "--out", "{tmp}/fresh")
        if fresh.rc != 0:
            return failure_of(fresh, "fresh run")
        run = ctx.run(*base, "--out", "{tmp}/S")
        return judge_either(run, ["S"], lambda: same_table(read_table(ctx.path("S/sweep.parquet")),
                                                           read_table(ctx.path("fresh/sweep.parquet"))))

    @case(CR, "stale.other-hash", "a sweep with --hash sha256 into a folder of an xxh3 sweep", weight=2)
    def stale_hash(ctx: Ctx) -> Verdict:
        _copy_ref(ctx, "small-sweep", SMALL_SWEEP, "S")
        fresh = ctx.run(*SMALL_SWEEP, "--hash", "sha256", "--out", "{tmp}/fresh")
        if fresh.rc != 0:
            return failure_of(fresh, "fresh run")
        run = ctx.run(*SMALL_SWEEP, "--hash", "sha256", "--out", "{tmp}/S")
        return judge_either(run, ["S"], lambda: same_table(read_table(ctx.path("S/sweep.parquet")),
                                                           read_table(ctx.path("fresh/sweep.parquet"))))


# ================================================================================================
# resource exhaustion
# ================================================================================================
RE = "resource exhaustion"


def _infinite_cache_check(ctx: Ctx, out: str, requests: int, table: bool = False) -> Callable[[], str | None]:
    """A cache larger than the trace: every reusable token hits (hit rate == ideal), no evictions."""

    def check() -> str | None:
        if table:
            t = read_table(ctx.path(out) / "sweep.parquet")
            recs = t.to_dict("records")
        else:
            recs = [read_json(ctx.path(out) / "summary.json")]
        for s in recs:
            msg = sane_summary(s, requests)
            if msg:
                return msg
            if s.get("evictions", 0) != 0:
                return f"{s.get('evictions')} evictions in a cache larger than the trace"
            if abs(s.get("token_hit_rate", 0) - s.get("ideal_hit_rate", 0)) > 1e-12:
                return f"token_hit_rate {s.get('token_hit_rate')} != ideal {s.get('ideal_hit_rate')}"
        return None

    return check


def _big_claim(tokens_each: int, n: int = 3, ids: int = 3) -> Callable[[Ctx], dict]:
    """A valid native blocks trace whose requests claim ``tokens_each`` tokens each."""

    def setup(ctx: Ctx) -> dict:
        bs = -(-tokens_each // ids)
        recs = [{"arrival": float(i), "output_length": 4, "input_length": tokens_each,
                 "hash_ids": [i * 10 + j for j in range(ids)]} for i in range(n)]
        ctx.write("big.jsonl", native_text({"kvlab_trace": 1, "kind": "blocks", "block_size": bs, "name": "big"}, recs))
        return {}

    return setup


def _register_resource() -> None:
    huge = "1000000000000"
    simple(RE, "res.replay-capacity-1e12", "replay --capacity-blocks 10^12 (compiled engine) [issue example]",
           ["replay", "{moon}", "--capacity-blocks", huge, "--quiet", "--out", "{tmp}/R"],
           accept="either", names=["--capacity-blocks"], check=lambda c, r: _infinite_cache_check(c, "R", 60)())
    simple(RE, "res.replay-capacity-1e12-python", "replay --capacity-blocks 10^12 --engine python",
           ["replay", "{moon}", "--capacity-blocks", huge, "--engine", "python", "--quiet", "--out", "{tmp}/R"],
           accept="either", names=["--capacity-blocks"], check=lambda c, r: _infinite_cache_check(c, "R", 60)())
    simple(RE, "res.sweep-capacity-1e12", "sweep --capacity-blocks 100 10^12",
           ["sweep", "{moon}", "--capacity-blocks", "100", huge, "--engine", "python", "--quiet", "--out", "{tmp}/S"],
           accept="either", names=["--capacity-blocks"], check=lambda c, r: sweep_check(c, "S", 2, 60)())
    simple(RE, "res.simulate-capacity-1e12", "simulate --capacity-blocks 10^12",
           [*SIM, "--capacity-blocks", huge, "--out", "{tmp}/R"], accept="either", names=["--capacity-blocks"],
           check=lambda c, r: summary_check(c, "R", 20)())
    simple(RE, "res.simulate-max-num-seqs-1e12", "simulate --max-num-seqs 10^12",
           [*SIM, "--max-num-seqs", huge, "--out", "{tmp}/R"], accept="either", names=["--max-num-seqs"],
           check=lambda c, r: summary_check(c, "R", 20)())
    simple(RE, "res.simulate-batched-tokens-1e15", "simulate --max-num-batched-tokens 10^15",
           [*SIM, "--max-num-batched-tokens", str(10**15), "--out", "{tmp}/R"], accept="either",
           names=["--max-num-batched-tokens"], check=lambda c, r: summary_check(c, "R", 20)())
    simple(RE, "res.simulate-instances-1e6", "simulate --instances 10^6",
           [*SIM, "--instances", str(10**6), "--out", "{tmp}/R"], accept="either", names=["--instances"],
           check=lambda c, r: summary_check(c, "R", 20)())
    simple(RE, "res.simulate-tensor-parallel-1e6", "simulate --tensor-parallel 10^6",
           [*SIM, "--tensor-parallel", str(10**6), "--out", "{tmp}/R"], accept="either", names=["--tensor-parallel"],
           check=lambda c, r: summary_check(c, "R", 20)())
    simple(RE, "res.replay-block-size-1e9", "replay a token trace with --block-size 10^9",
           ["replay", "{nat}", "--capacity-blocks", "100", "--block-size", str(10**9), "--engine", "python",
            "--quiet", "--out", "{tmp}/R"], accept="either", names=["--block-size"],
           check=lambda c, r: summary_check(c, "R", 80)())
    simple(RE, "res.calibrate-capacity-blocks-1e12", "calibrate --capacity-blocks 10^12 (a KV pool of 10^12 blocks)",
           ["calibrate", "--quick", "--quiet", "--capacity-blocks", str(10**12), "--out", "{tmp}/cal.json"],
           accept="either", names=["--capacity-blocks"], timeout=120, weight=6,
           check=lambda c, r: None if c.path("cal.json").is_file() else "no profile written")
    simple(RE, "res.simulate-rate-tiny", "simulate --rate 1e-300 (arrivals ~1e300 s apart)",
           [*SIM, "--rate", "1e-300", "--out", "{tmp}/R"], accept="either", names=["--rate"],
           check=lambda c, r: summary_check(c, "R", 20)())
    simple(RE, "res.simulate-rate-huge", "simulate --rate 1e300 (a burst)", [*SIM, "--rate", "1e300", "--out",
                                                                              "{tmp}/R"],
           accept="either", names=["--rate"], check=lambda c, r: summary_check(c, "R", 20)())
    simple(RE, "res.simulate-time-scale-huge", "simulate --time-scale 1e300",
           [*SIM, "--time-scale", "1e300", "--out", "{tmp}/R"], accept="either", names=["--time-scale"],
           check=lambda c, r: summary_check(c, "R", 20)())
    for pol, item, name in [("slru", "segments=1000000000", "segments"), ("clock", "bits=1000000", "bits"),
                            ("wtinylfu", "max_count=1000000000000", "max_count"),
                            ("workload-aware", "window=1000000000000", "window"),
                            ("s3fifo", "move_to_main_threshold=1000000000000", "move_to_main_threshold")]:
        simple(RE, f"res.policy-param.{pol}", f"--policy {pol} --policy-param {item}"
               + (" [issue example]" if pol == "slru" else ""),
               ["replay", "{moon}", "--capacity-blocks", "100", "--policy", pol, "--policy-param", item, "--quiet",
                "--out", "{tmp}/R", *([] if pol == "slru" else ["--engine", "python"])], accept="either",
               names=[name], check=lambda c, r: summary_check(c, "R", 60)())
    simple(RE, "res.simulate-slru-segments-1e9", "simulate --policy slru --policy-param segments=10^9",
           [*SIM, "--policy", "slru", "--policy-param", "segments=1000000000", "--out", "{tmp}/R"], accept="either",
           names=["segments"], check=lambda c, r: summary_check(c, "R", 20)())
    simple(RE, "res.trace-1e15-tokens-stats", "a valid trace claiming 10^15 tokens per request: trace stats",
           [*STATS, "{tmp}/big.jsonl"], setup=_big_claim(10**15), accept="either", names=["big.jsonl"],
           check=lambda c, r: stats_check(lambda: r, 3)())
    simple(RE, "res.trace-1e15-tokens-replay", "a trace claiming 10^15 tokens per request: replay",
           ["replay", "{tmp}/big.jsonl", "--capacity-blocks", "100", "--quiet", "--out", "{tmp}/R"],
           setup=_big_claim(10**15), accept="either", names=["big.jsonl"],
           check=lambda c, r: summary_check(c, "R", 3)())
    simple(RE, "res.trace-1e15-tokens-simulate", "a trace claiming 10^15 tokens per request: simulate",
           ["simulate", "{tmp}/big.jsonl", "--quiet", "--out", "{tmp}/R"], setup=_big_claim(10**15),
           accept="either", names=["big.jsonl"], check=lambda c, r: summary_check(c, "R", 3)())
    simple(RE, "res.trace-int64-overflow", "lengths whose sum passes int64 (3 x 4e18 tokens): replay",
           ["replay", "{tmp}/big.jsonl", "--capacity-blocks", "100", "--quiet", "--out", "{tmp}/R"],
           setup=_big_claim(4 * 10**18), accept="either", names=["big.jsonl"],
           check=lambda c, r: summary_check(c, "R", 3)())

    def long_line(ctx: Ctx) -> dict:
        n = 200_000
        rec = {"timestamp": 0, "input_length": n * 512, "output_length": 1, "hash_ids": list(range(n))}
        ctx.write("long.jsonl", json.dumps(rec) + "\n" + "\n".join(moon_lines(ctx)[1:20]) + "\n")
        return {}

    simple(RE, "res.long-prompt-replay", "a valid 10^8-token prompt (200,000 block ids on one line): replay",
           ["replay", "{tmp}/long.jsonl", "--capacity-blocks", "1000", "--quiet", "--out", "{tmp}/R"],
           setup=long_line, accept="ok", check=lambda c, r: summary_check(c, "R", 20)())
    simple(RE, "res.long-prompt-simulate", "a valid 10^8-token prompt: simulate",
           ["simulate", "{tmp}/long.jsonl", "--quiet", "--out", "{tmp}/R"], setup=long_line, accept="either",
           names=["long.jsonl"], check=lambda c, r: summary_check(c, "R", 20)())
    simple(RE, "res.limit-huge", "--limit 10^18 (more than the trace: all requests)",
           ["replay", "{moon}", "--capacity-blocks", "100", "--limit", str(10**18), "--quiet", "--out", "{tmp}/R"],
           accept="ok", check=lambda c, r: summary_check(c, "R", 60)())

    def mentions_rejected(ctx: Ctx, run: Run) -> str | None:
        text = run.out.replace(str(ctx.root), "").lower()
        return None if "reject" in text else "requests were rejected but the printout does not say so"

    simple(RE, "res.replay-rejections-printed", "replay with a cache smaller than most prompts: rejections shown",
           ["replay", "{moon}", "--capacity-blocks", "5", "--engine", "python", "--out", "{tmp}/R"],
           accept="ok", check=lambda c, r: mentions_rejected(c, r) or summary_check(c, "R", 60)())
    simple(RE, "res.sweep-rejections-printed", "sweep at 5 and 100 blocks: rejections in the printout",
           ["sweep", "{moon}", "--capacity-blocks", "5", "100", "--engine", "python", "--out", "{tmp}/S"],
           accept="ok", check=lambda c, r: mentions_rejected(c, r) or sweep_check(c, "S", 2)())
    simple(RE, "res.simulate-pool-smaller-than-request", "simulate with a 5-block pool (prompts need ~24 blocks)",
           [*SIM, "--capacity-blocks", "5", "--out", "{tmp}/R"], accept="either", names=["--capacity-blocks"],
           check=lambda c, r: mentions_rejected(c, r) or summary_check(c, "R", 20)())

    @case(RE, "res.demo-rejections", "demo (--quick): rejected requests in summary.csv and, when there are "
          "any, in the printout [issue example]", weight=3)
    def demo_rejections(ctx: Ctx) -> Verdict:
        run = ctx.run("demo", "--quick", "--out", "{tmp}/D")

        def check() -> str | None:
            t = read_table(ctx.path("D/sweep.parquet"))
            if "rejected_requests" not in t:
                return "sweep.parquet has no rejected_requests column"
            header = ctx.path("D/summary.csv").read_text().splitlines()[0]
            if "reject" not in header:
                return f"summary.csv has no rejected column ({header})"
            return mentions_rejected(ctx, run) if (t["rejected_requests"] > 0).any() else None

        return judge_ok(run, check)


_register_mooncake()
_register_alibaba()
_register_native()
_register_parquet()
_register_bad_parameters()
_register_outputs()
_register_interruption()
_register_concurrency()
_register_corrupt()
_register_resource()
surfaces.register_all(sys.modules[__name__])


# ------------------------------------------------------------------------------------------ driver
def run_case(runner: Runner, c: Case) -> Result:
    t0 = time.monotonic()
    ctx = None
    try:
        ctx = Ctx(runner, c)
        try:
            verdict = c.fn(ctx)
        except CaseFailed as exc:
            verdict = exc.verdict
        loss = ctx.check_sentinels()
        if loss:
            verdict = Verdict("data loss", loss, verdict.run)
    except HarnessSkip as exc:
        verdict = Verdict("harness error", f"skipped: {exc}")
    except Exception as exc:  # a bug in the case or an output no check anticipated
        verdict = Verdict("harness error", f"{type(exc).__name__}: {exc}")
    return Result(c, verdict, time.monotonic() - t0, ctx.runs if ctx else [])


def select(only: Sequence[str] = (), ids: Sequence[str] = ()) -> list[Case]:
    """Cases of the classes in ``only`` plus the cases named in ``ids`` (all cases when both are empty)."""
    wanted = {o.lower() for o in only}
    bad = wanted - {c.lower() for c in CLASSES}
    if bad:
        raise SystemExit(f"robustness: unknown class {sorted(bad)}; classes: {', '.join(CLASSES)}")
    missing = [i for i in ids if i not in {c.id for c in CASES}]
    if missing:
        raise SystemExit(f"robustness: unknown case id(s) {missing}")
    if not wanted and not ids:
        return list(CASES)
    return [c for c in CASES if c.cls.lower() in wanted or c.id in set(ids)]


def run_cases(cases: Sequence[Case], *, jobs: int = 2, opts: Options | None = None, root: Path | None = None,
              progress: Callable[[Result], None] | None = None) -> list[Result]:
    """Run ``cases`` (heaviest first, ``jobs`` at a time) in a fresh temp folder; results in catalogue order."""
    opts = opts or Options()
    own = root is None
    root = Path(tempfile.mkdtemp(prefix="kvlab-robustness-")) if own else root
    try:
        runner = Runner(root, opts)
        results: dict[str, Result] = {}
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = [pool.submit(run_case, runner, c) for c in sorted(cases, key=lambda c: -c.weight)]
            for f in as_completed(futures):
                r = f.result()
                results[r.case.id] = r
                if progress:
                    progress(r)
        return [results[c.id] for c in cases]
    finally:
        if own:
            _rmtree(root)


def _rmtree(root: Path) -> None:
    """Remove the run folder (read-only folders and mode-000 files made by cases included)."""
    for p in root.rglob("*"):
        with contextlib.suppress(OSError):
            if not p.is_symlink():
                p.chmod(0o755 if p.is_dir() else 0o644)
    shutil.rmtree(root, ignore_errors=True)


def table_text(results: Sequence[Result]) -> str:
    used = [o for o in OUTCOMES if o in GOOD or any(r.outcome == o for r in results)]
    for o in SEVERE:
        if o not in used:
            used.append(o)
    used = [o for o in OUTCOMES if o in used]
    w0 = max(len(c) for c in CLASSES) + 2
    widths = [max(len(o), 5) for o in used]
    head = f"{'class':<{w0}}" + " ".join(f"{o:>{w}}" for o, w in zip(used, widths, strict=True)) + "  total"
    lines = [head, "-" * len(head)]
    for cls in [*CLASSES, "all"]:
        rs = [r for r in results if cls == "all" or r.case.cls == cls]
        if not rs and cls != "all":
            continue
        if cls == "all":
            lines.append("-" * len(head))
        counts = [sum(r.outcome == o for r in rs) for o in used]
        lines.append(f"{cls:<{w0}}" + " ".join(f"{n:>{w}}" for n, w in zip(counts, widths, strict=True))
                     + f"  {len(rs):>5}")
    return "\n".join(lines)


def table_counts(results: Sequence[Result]) -> dict[str, dict[str, int]]:
    """The table as data: class (and 'all') -> outcome -> number of cases (every outcome listed)."""
    out = {}
    for cls in [*CLASSES, "all"]:
        rs = [r for r in results if cls == "all" or r.case.cls == cls]
        if rs or cls == "all":
            out[cls] = {o: sum(r.outcome == o for r in rs) for o in OUTCOMES} | {"total": len(rs)}
    return out


def _short(text: str, n: int = 220) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."


def failures_text(results: Sequence[Result]) -> str:
    bad = [r for r in results if r.outcome not in GOOD]
    if not bad:
        return "no failures: every case ended in a clear error or a correct result"
    lines = [f"{len(bad)} cases did not end in a clear error or a correct result:"]
    for cls in CLASSES:
        for r in (r for r in bad if r.case.cls == cls):
            detail = _short(r.verdict.detail)
            lines.append(f"  [{r.outcome}] {r.case.id}: {r.case.desc}\n      {detail}")
            last = r.verdict.run.last_line if r.verdict.run is not None else ""
            if last and last not in r.verdict.detail:
                lines.append(f"      stderr: {_short(last)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], metavar="CLASS", help=f"one of: {', '.join(CLASSES)}")
    ap.add_argument("--new", action="store_true", help="issue 23's cases (robustness_surfaces.py); with --only: "
                    "these as well")
    ap.add_argument("--id", action="append", default=[], dest="ids", metavar="CASE",
                    help="run this case (repeatable; with --only: these as well)")
    ap.add_argument("--jobs", type=int, default=2, help="cases run in parallel (default 2)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every case's outcome here")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per command before 'hang'")
    ap.add_argument("--mem-gib", type=float, default=DEFAULT_MEM_GIB, help="address-space limit per command")
    ap.add_argument("--pythonpath", default=None, help="prepend to PYTHONPATH (test another copy of kvlab)")
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help="the shared traces folder")
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill moments of the interruption cases")
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR", help="run in DIR and keep it (debugging)")
    ap.add_argument("--quiet", action="store_true", help="no per-case progress lines")
    a = ap.parse_args(argv)
    new_ids = [c.id for c in CASES if c.fn.__module__ == surfaces.__name__] if a.new else []
    cases = select(a.only, [*a.ids, *new_ids])
    if a.list:
        for c in cases:
            print(f"{c.cls:<20} {c.id:<52} {c.desc}")
        print(f"{len(cases)} cases")
        return 0
    if a.jobs < 1 or not math.isfinite(a.timeout) or a.timeout <= 0 or a.mem_gib <= 0:
        ap.error("--jobs, --timeout and --mem-gib must be positive")
    opts = Options(a.timeout, int(a.mem_gib * (1 << 30)), a.pythonpath, a.traces.resolve(), a.seed)
    done = [0]
    lock = threading.Lock()

    def progress(r: Result) -> None:
        with lock:
            done[0] += 1
            if not a.quiet:
                mark = "ok " if r.outcome in GOOD else "BAD"
                print(f"[{done[0]:>3}/{len(cases)}] {mark} {r.outcome:<19} {r.seconds:6.1f}s  {r.case.id}",
                      file=sys.stderr, flush=True)

    root = None
    if a.keep:
        a.keep.mkdir(parents=True, exist_ok=False)
        root = a.keep.resolve()
    t0 = time.monotonic()
    results = run_cases(cases, jobs=a.jobs, opts=opts, root=root, progress=progress)
    wall = time.monotonic() - t0
    print(table_text(results))
    print()
    print(failures_text(results))
    print(f"\n{len(results)} cases in {wall:.0f} s with {a.jobs} jobs")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"seconds": round(wall, 1), "jobs": a.jobs, "timeout": a.timeout,
                                      "table": table_counts(results), "cases": [r.record() for r in results]},
                                     indent=1, ensure_ascii=False) + "\n")
    severe = sum(r.outcome not in GOOD for r in results)
    return 1 if severe else 0


if __name__ == "__main__":
    sys.exit(main())
