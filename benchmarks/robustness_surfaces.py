"""Issue 23's surfaces in the adversarial catalogue: experiment files, tier specs, simulator flags, the layout
study, tokenizers and text, ``kvlab figures``, result tables and the Python API.

``benchmarks/robustness.py`` loads this module, adds :data:`CLASSES` to its own and calls
:func:`register_all` with itself once its helpers exist; every case here is judged by its classifier. Each of
the 47 rows of ``../shared/cases/new-surfaces-2026-12-05.tsv`` is a case whose description starts with
``TSV#NN`` (its row, 1-based after the header); the other cases are the issue's further examples.

Python-API cases run a small snippet as ``python -c`` (same timeout, address-space limit and environment as
the command line) under a driver that turns a kvlab ``ConfigError`` / ``ResultsError`` /
``ResultsLocationError`` (or, for a trace file, a ``TraceFormatError``; subclasses included) into the command
line's last line (``kvlab: error: <that class>: <message>``, exit 2),
so the same judge applies; any other exception stays a traceback. Warnings are printed to stderr as
``warning: <Category>: <message>``. Inputs (``IN/`` of the TSV) are written once per catalogue run:
``mc20`` / ``mc300`` (the first 20 / 300 lines of the Mooncake conversation trace), ``nat60``
(``synthetic_chat(60, seed=1)`` as native JSONL), ``reqlog`` (a 40-line request log) and a one-notebook
``nbs/`` folder; a case copies what it needs into its own folder.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

EF = "experiment file"
TS = "tier spec"
SF = "simulator flags"
LS = "layout study"
TT = "text/tokenizer"
FG = "figures"
RT = "results tables"
PA = "Python API"
CLASSES = (EF, TS, SF, LS, TT, FG, RT, PA)
"""The new classes, after robustness.py's own (issue 10's) in the table."""

FIFO_TIMEOUT = 15.0  # seconds: a command reading a FIFO that never gets a writer is a hang past this
PY_ERRORS = ("ConfigError", "ResultsError", "ResultsLocationError", "TraceFormatError")

rb: ModuleType  # benchmarks/robustness.py, bound by register_all


# ------------------------------------------------------------------------------------------ Python snippets
_PY_DRIVER = (
    "import os, resource, signal, sys, warnings\n"
    "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "lim = int(sys.argv[1])\n"
    "if lim > 0:\n"
    "    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "from kvlab.errors import ConfigError, ResultsError, ResultsLocationError, TraceFormatError\n"
    "KVLAB_ERRORS = (ConfigError, ResultsError, ResultsLocationError, TraceFormatError)\n"
    "def _flush(caught):\n"
    "    for w in caught:\n"
    "        print(f'warning: {w.category.__name__}: {w.message}', file=sys.stderr)\n"
    "with warnings.catch_warnings(record=True) as caught:\n"
    "    warnings.simplefilter('always')\n"
    "    try:\n"
    "        exec(compile(sys.argv[2], '<case>', 'exec'), {'__name__': '__case__'})\n"
    "    except KVLAB_ERRORS as exc:\n"
    "        _flush(caught)\n"
    "        base = next(b for b in KVLAB_ERRORS if isinstance(exc, b))\n"
    "        print(f'kvlab: error: {base.__name__}: {exc}', file=sys.stderr)\n"
    "        sys.exit(2)\n"
    "_flush(caught)\n"
)


def py(ctx: Any, code: str, *, timeout: float | None = None) -> Any:
    """Run the Python ``code`` in the case's folder (see the module docstring); the finished ``Run``."""
    runner = ctx.runner
    cmd = [sys.executable, "-c", _PY_DRIVER, str(runner.opts.mem_bytes), code]
    popen = subprocess.Popen(cmd, cwd=ctx.root, env=runner.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    return ctx.finish(rb.Proc(["python", "-c", code], popen, timeout or runner.opts.timeout))


def warnings_of(run: Any, category: str = "ResultsWarning") -> list[str]:
    """The ``warning: CATEGORY: ...`` lines a snippet printed."""
    return [ln for ln in run.lines if ln.startswith(f"warning: {category}:")]


def json_out(run: Any) -> dict:
    """The merged JSON objects a snippet printed on stdout, one per line."""
    out: dict = {}
    for ln in run.out.splitlines():
        if ln.startswith("{"):
            out.update(json.loads(ln))
    return out


def py_case(cls: str, cid: str, desc: str, code: str, names: Sequence[str], *, inputs: Sequence[str] = (),
            setup: Callable[[Any], None] | None = None, timeout: float | None = None, weight: float = 1.0) -> None:
    """A snippet that must end in a kvlab error (:data:`PY_ERRORS`) naming ``names``."""

    def fn(ctx: Any) -> Any:
        use(ctx, *inputs)
        if setup is not None:
            setup(ctx)
        run = py(ctx, code, timeout=timeout)
        v = rb.judge_error(run, names)
        if v.outcome == "clear error" and not any(f": {e}: " in run.last_line for e in PY_ERRORS):
            return rb.Verdict("unclear error", f"not a kvlab error: {run.last_line}", run)
        return v

    rb.register(cls, cid, desc, fn, weight)


# ------------------------------------------------------------------------------------------ inputs
_INPUT_LOCK = threading.Lock()
NOTEBOOK_CELLS = [
    ("markdown", "# tiny\nOne figure of made-up numbers."),
    ("parameters", 'import os\n\nQUICK = os.environ.get("KVLAB_QUICK") == "1"'),
    ("code", "import matplotlib.pyplot as plt\nimport pandas as pd\n\nfrom kvlab.plots import style\n\n"
             "style.apply()\nFIGURES = style.figure_folder('01_tiny')\n"
             "data = pd.DataFrame({'capacity_blocks': [8, 32, 128], 'token_hit_rate': [0.1, 0.3, 0.5]})\n"
             "fig, ax = plt.subplots()\nax.plot(data['capacity_blocks'], data['token_hit_rate'])\n"
             "style.save(fig, FIGURES, 'hit_rate', data=data, caption=style.caption('rises', config={'x': 1}))"),
]


def _notebook_json(cells: Sequence[tuple[str, str]]) -> str:
    """An nbformat-4 notebook of ``cells`` (kind, source): 'markdown', 'parameters' or 'code'."""
    out = []
    for i, (kind, source) in enumerate(cells):
        cell: dict[str, Any] = {"cell_type": "markdown" if kind == "markdown" else "code", "id": f"c{i}",
                                "metadata": {"tags": ["parameters"]} if kind == "parameters" else {},
                                "source": source}
        if cell["cell_type"] == "code":
            cell.update(execution_count=None, outputs=[])
        out.append(cell)
    nb = {"cells": out, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                    "language": "python"}}, "nbformat": 4, "nbformat_minor": 5}
    return json.dumps(nb, indent=1) + "\n"


def request_log_lines(n: int = 40, seed: int = 0) -> list[str]:
    """A request log of ``n`` requests in 8 sessions (shared system prompt, growing history), token ids < 1000."""
    rng = random.Random(seed)
    system = [rng.randrange(8, 1000) for _ in range(32)]
    history: dict[int, list[int]] = {}
    lines, t = [], 1_700_000_000.0
    for i in range(n):
        s = rng.randrange(8)
        hist = history.setdefault(s, list(system))
        hist.extend(rng.randrange(8, 1000) for _ in range(rng.randrange(4, 24)))
        t += rng.expovariate(2.0)
        out = [rng.randrange(8, 1000) for _ in range(rng.randrange(1, 5))]
        lines.append(json.dumps({"request_id": i, "session_id": f"s{s}", "arrival_time": round(t, 3),
                                 "prompt_token_ids": list(hist), "output_token_ids": out}))
        hist.extend(out)
    return lines


def _make_inputs(ctx: Any) -> Path:
    """``IN/`` of the TSV, written once per catalogue run (under the runner's inputs folder)."""
    runner = ctx.runner
    folder = runner.inputs / "surfaces"
    with _INPUT_LOCK:
        if (folder / ".done").is_file():
            return folder
        folder.mkdir(parents=True, exist_ok=True)
        lines = Path(ctx.vars["moon300"]).read_text().splitlines(keepends=True)
        (folder / "mc20.jsonl").write_text("".join(lines[:20]))
        (folder / "mc300.jsonl").write_text("".join(lines[:300]))
        (folder / "reqlog.jsonl").write_text("\n".join(request_log_lines()) + "\n")
        (folder / "nbs").mkdir(exist_ok=True)
        (folder / "nbs" / "01_tiny.ipynb").write_text(_notebook_json(NOTEBOOK_CELLS))
        code = ("from kvlab.workload import synthetic_chat, save_jsonl\n"
                f"save_jsonl(synthetic_chat(60, seed=1), {str(folder / 'nat60.jsonl')!r})\n")
        proc = subprocess.run([sys.executable, "-c", code], env=runner.env, capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"writing nat60.jsonl failed: {proc.stderr[-500:]}")
        (folder / ".done").write_text("")
    return folder


def use(ctx: Any, *names: str) -> None:
    """Copy the named inputs (``mc20``, ``mc300``, ``nat60``, ``reqlog``, ``nbs``) into the case's folder."""
    if not names:
        return
    folder = _make_inputs(ctx)
    for name in names:
        src = folder / name if name == "nbs" else folder / f"{name}.jsonl"
        dest = ctx.root / src.name
        if src.is_dir():
            shutil.copytree(src, dest)
        else:
            shutil.copyfile(src, dest)


def cached(ctx: Any, key: str, build: Callable[[Any, Path], Any]) -> Path:
    """A folder built once per catalogue run by ``build(ctx, folder)`` (which returns its Run or None); a
    failing build ends the case with its outcome."""
    runner = ctx.runner
    with runner._lock:
        lock = runner._ref_locks.setdefault("surfaces:" + key, threading.Lock())
    with lock:
        folder = runner.root / "refs" / "surfaces" / key
        marker = folder.parent / f"{key}.ok"
        failed = folder.parent / f"{key}.failed"
        if not marker.exists() and not failed.exists():
            folder.mkdir(parents=True)
            try:
                run = build(ctx, folder)
            except Exception as exc:  # recorded: every case needing the setup ends the same way
                failed.write_text(json.dumps({"stderr_tail": f"{type(exc).__name__}: {exc}"}))
                raise
            if run is not None and (run.rc != 0 or run.timed_out):
                failed.write_text(json.dumps(run.record()))
            else:
                marker.write_text("")
        if failed.exists():
            rec = json.loads(failed.read_text())
            if "argv" not in rec:
                raise rb.CaseFailed(rb.Verdict("harness error", f"the shared setup {key!r} failed: "
                                                                f"{rec['stderr_tail'][-300:]}"))
            run = rb.Run(rec["argv"], rec["rc"], rec["stdout_tail"], rec["stderr_tail"], rec["seconds"],
                         rec["timed_out"])
            raise rb.CaseFailed(rb.failure_of(run, f"the shared setup {key!r} failed"))
    return folder


# ------------------------------------------------------------------------------------------ experiments
def exp_yaml(name: str = "y1", trace: str = "{path: mc300.jsonl}", cache: str = "{capacity_blocks: 300, policy: lru}",
             extra: str = "") -> str:
    return f"name: {name}\ntrace: {trace}\ncache: {cache}\n{extra}"


def run_check(ctx: Any, results: str, name: str, rows: int) -> Callable[[], str | None]:
    """A complete experiment table: ``results/name/sweep.parquet`` with ``rows`` sane rows."""

    def check() -> str | None:
        p = ctx.path(results) / name / "sweep.parquet"
        if not p.is_file():
            return f"no {p.relative_to(ctx.root)}"
        return rb.sane_table(rb.read_table(p), rows)

    return check


def computed_runs(ctx: Any, results: str, name: str) -> list[str]:
    runs = ctx.path(results) / name / "runs"
    return sorted(p.name for p in runs.iterdir()) if runs.is_dir() else []


def before_runs(v: Any, ctx: Any, results: str, name: str) -> Any:
    """A clear error is only clear if it came before any run was computed (a late failure otherwise)."""
    if v.outcome == "clear error" and computed_runs(ctx, results, name):
        return rb.Verdict("unclear error", f"refused only after computing {len(computed_runs(ctx, results, name))} "
                                           f"run(s): {v.detail}", v.run)
    return v


def exp_case(cid: str, desc: str, text: str, *, accept: str = "error", names: Sequence[str] = (),
             args: Sequence[str] = ("--no-figure",), name: str = "y1", rows: int = 1,
             inputs: Sequence[str] = ("mc300",), early: bool = True, check: Callable[[Any, Any], str | None] | None
             = None, timeout: float | None = None, cls: str = EF, weight: float = 1.0) -> None:
    """``kvlab run exp.yaml --results res ARGS`` with ``text`` as exp.yaml. A clear error must come before any
    run was computed (``early``); a correct result is a sane table of ``rows`` rows (and ``check``)."""

    def fn(ctx: Any) -> Any:
        use(ctx, *inputs)
        ctx.write("exp.yaml", text)
        run = ctx.run("run", "exp.yaml", "--results", "res", "--quiet", *args, timeout=timeout)
        base = run_check(ctx, "res", name, rows)

        def chk() -> str | None:
            return base() or (check(ctx, run) if check is not None else None)

        if accept == "error":
            v = rb.judge_error(run, names)
        elif accept == "ok":
            v = rb.judge_ok(run, chk)
        else:
            v = rb.judge_either(run, names, chk)
        return before_runs(v, ctx, "res", name) if early else v

    rb.register(cls, cid, desc, fn, weight)


def _not_naming(*words: str) -> Callable[[Any, Any], str | None]:
    def check(ctx: Any, run: Any) -> str | None:
        bad = [w for w in words if w in run.last_line]
        return f"names {bad}, which this command does not have" if bad else None

    return check


def _simple_neg(cls: str, cid: str, desc: str, args: Sequence[str], names: Sequence[str], *, not_naming: Sequence[str],
                inputs: Sequence[str] = (), write: dict[str, str] | None = None, timeout: float | None = None,
                weight: float = 1.0) -> None:
    """A clear error naming ``names`` and none of ``not_naming`` (flags another command has)."""

    def fn(ctx: Any) -> Any:
        use(ctx, *inputs)
        for rel, data in (write or {}).items():
            ctx.write(rel, data)
        run = ctx.run(*args, timeout=timeout)
        v = rb.judge_error(run, names)
        if v.outcome == "clear error":
            msg = _not_naming(*not_naming)(ctx, run)
            if msg:
                return rb.Verdict("unclear error", f"{msg}: {run.last_line}", run)
        return v

    rb.register(cls, cid, desc, fn, weight)


def _grid(axes: dict[str, list]) -> str:
    return "sweep:\n  grid:\n" + "".join(f"    {k}: {json.dumps(v)}\n" for k, v in axes.items())


def _fifo_case(cls: str, cid: str, desc: str, args: Sequence[str], fifo: str, names: Sequence[str],
               write: dict[str, str] | None = None) -> None:
    """A FIFO without a writer where a file is read: a clear error; a hang is bounded by FIFO_TIMEOUT."""

    def fn(ctx: Any) -> Any:
        for rel, data in (write or {}).items():
            ctx.write(rel, data)
        os.mkfifo(ctx.path(fifo))
        return rb.judge_error(ctx.run(*args, timeout=FIFO_TIMEOUT), names)

    rb.register(cls, cid, desc, fn)


def _register_experiment() -> None:
    exp_case("exp.capacity-bool", "TSV#01: cache.capacity_blocks: true (a YAML boolean) is not 1 block",
             exp_yaml(cache="{capacity_blocks: true, policy: lru}"), names=["capacity_blocks"])
    axes6 = {"cache.capacity_blocks": list(range(100, 200)), "seed": list(range(100)),
             "hasher.root_seed": list(range(100)), "trace.limit": list(range(100, 200)),
             "trace.resample_seed": list(range(100)), "cache.policy_params.x": list(range(100))}

    def grid_check(ctx: Any, run: Any) -> str | None:
        return _not_naming("--limit")(ctx, run)

    for cid, tsv, axes in (("exp.grid-1e12", "TSV#02: sweep.grid of 6 axes x 100 values (10^12 points)", axes6),
                           ("exp.grid-1e6", "TSV#03: sweep.grid of 1000 capacities x 1000 seeds (10^6 points)",
                            {"cache.capacity_blocks": list(range(1, 1001)), "seed": list(range(1000))})):
        def fn(ctx: Any, axes: dict = axes) -> Any:
            use(ctx, "mc300")
            ctx.write("exp.yaml", exp_yaml() + _grid(axes))
            run = ctx.run("run", "exp.yaml", "--results", "res", "--quiet", "--no-figure")
            v = rb.judge_error(run, ["sweep.grid"])
            msg = grid_check(ctx, run) if v.outcome == "clear error" else None
            return rb.Verdict("unclear error", f"{msg}: {run.last_line}", run) if msg else v

        rb.register(EF, cid, tsv + ": refused before planning, naming sweep.grid", fn, weight=2)
    exp_case("exp.grid-max-points", "a 4-point grid with --max-points 3: refused naming sweep.grid and the flag",
             exp_yaml(extra=_grid({"cache.capacity_blocks": [50, 100, 200, 300]})),
             args=["--no-figure", "--max-points", "3"], names=["sweep.grid", "--max-points"])
    exp_case("exp.grid-max-points-raised", "a 4-point grid with --max-points 4 runs its 4 points",
             exp_yaml(extra=_grid({"cache.capacity_blocks": [50, 100, 200, 300]})),
             args=["--no-figure", "--max-points", "4"], accept="ok", rows=4)
    exp_case("exp.policy-params-bool", "cache.policy_params: {segments: true} for slru (a boolean is not 1 "
             "segment)", exp_yaml(cache="{capacity_blocks: 300, policy: slru, policy_params: {segments: true}}"),
             names=["segments"])
    exp_case("exp.duplicate-top-key", "TSV#04: two top-level 'cache:' keys: refused naming the key and line",
             "name: y1\ntrace: {path: mc300.jsonl}\ncache: {capacity_blocks: 100, policy: lru}\n"
             "cache: {capacity_blocks: 5000, policy: fifo}\n", names=["cache", "line 4"])
    for reserved in ("figures", "runs"):
        exp_case(f"exp.name-{reserved}", f"TSV#05: an experiment named '{reserved}' (a folder kvlab uses "
                 "itself) is refused", exp_yaml(name=reserved), args=[], name=reserved, names=["name", reserved])

    def user_figure(ctx: Any) -> Any:
        use(ctx, "mc300")
        ctx.write("exp.yaml", exp_yaml(name="y34", extra=_grid({"cache.capacity_blocks": [100, 300]})))
        ctx.sentinel("res/figures/y34/hit_rate_vs_capacity.png", "MY OWN FIGURE\n")
        run = ctx.run("run", "exp.yaml", "--results", "res", "--quiet")
        return before_runs(rb.judge_error(run, ["hit_rate_vs_capacity.png"]), ctx, "res", "y34")

    def rerun_then_edit(ctx: Any) -> Any:
        use(ctx, "mc300")
        ctx.write("exp.yaml", exp_yaml(name="y36", extra=_grid({"cache.capacity_blocks": [100, 300]})))
        png = "res/figures/y36/hit_rate_vs_capacity.png"
        for attempt in ("first run", "rerun over its own figure"):
            run = ctx.run("run", "exp.yaml", "--results", "res", "--quiet")
            if run.rc != 0 or not ctx.path(png).is_file():
                return rb.judge_ok(run, lambda: f"no {png}") if run.rc == 0 else rb.failure_of(run, attempt)
        ctx.sentinel(png, "the user's edit of kvlab's figure\n")
        return rb.judge_error(ctx.run("run", "exp.yaml", "--results", "res", "--quiet"), ["hit_rate_vs_capacity.png"])

    rb.register(EF, "exp.figure-rerun-then-user-edit", "kvlab run twice replaces its own figure; after the user "
                "edits it, a third run refuses naming it (an edited kvlab file counts as the user's)", rerun_then_edit,
                weight=3)
    rb.register(EF, "exp.user-figure-in-figures-folder", "TSV#06: the user's own RESULTS/figures/<name>/"
                "hit_rate_vs_capacity.png: refused before the runs, the file kept", user_figure, weight=2)

    def figures_file(ctx: Any) -> Any:
        use(ctx, "mc300")
        ctx.write("exp.yaml", exp_yaml(name="y35", extra=_grid({"cache.capacity_blocks": [100, 300]})))
        ctx.sentinel("res/figures", "user file\n")
        run = ctx.run("run", "exp.yaml", "--results", "res", "--quiet")
        v = rb.judge_error(run, ["figures"])
        if v.outcome == "clear error" and "Errno" in run.last_line:
            v = rb.Verdict("unclear error", f"raw errno: {run.last_line}", run)
        return before_runs(v, ctx, "res", "y35")

    rb.register(EF, "exp.figures-root-is-a-file", "TSV#07: RESULTS/figures is a user's file: refused before the "
                "runs, naming it (no raw errno)", figures_file)
    _fifo_case(EF, "exp.fifo", "TSV#08: the experiment file is a FIFO without a writer", ["run", "f.yaml"],
               "f.yaml", ["f.yaml"])
    exp_case("exp.warmup-exceeds-trace", "TSV#09: analysis.warmup_requests 100000 on 300 requests: refused before "
             "the runs naming analysis.warmup_requests", exp_yaml(extra="analysis: {warmup_requests: 100000}\n"),
             names=["warmup_requests"])

    def few_windows_note(ctx: Any, run: Any) -> str | None:
        notes = [ln for ln in (run.out + "\n" + run.err).splitlines() if ln.startswith("note:") and "window" in ln]
        return None if notes else "no 'note:' line saying fewer analysis windows were used"

    exp_case("exp.limit-10", "TSV#28: a valid replay experiment with trace.limit 10 (< 20 analysis windows): a "
             "table with fewer windows and a note", exp_yaml(trace="{path: mc300.jsonl, limit: 10}"), accept="ok",
             check=few_windows_note)
    exp_case("exp.reqlog-engine-6", "TSV#27: the engine driver on a 6-request request log (valid): a table with "
             "fewer windows and a note",
             "name: r16\ntrace: {path: reqlog.jsonl, format: request-log, limit: 6}\n"
             "cache: {block_size: 16, capacity_blocks: 64, policy: lru}\ndriver: engine\n"
             "engine: {model: tiny-llama, threads: 1, max_num_seqs: 4, time_scale: 0.01, warmup: 0}\n",
             name="r16", inputs=("reqlog",), accept="ok", check=few_windows_note, timeout=90, weight=4)
    exp_case("exp.max-load-tokens-without-tiers", "TSV#44: cache.max_load_tokens without cache.tiers: refused as "
             "the CLI refuses --max-load-tokens without --tier",
             exp_yaml(cache="{capacity_blocks: 300, policy: lru, max_load_tokens: 512}"),
             names=["max_load_tokens", "tiers"])
    exp_case("exp.tier-chunk4-write-back", "TSV#45: a tier with chunk_blocks 4 and write: write_back in an "
             "experiment (documented as refused)",
             exp_yaml(cache="{capacity_blocks: 300, policy: lru, tiers: [{name: dram, capacity_blocks: 100, "
                            "chunk_blocks: 4, write: write_back}]}"), names=["dram", "chunk"])
    exp_case("exp.tier-write-back-below-chunk2", "cache.tiers: a write_back tier below a chunk_blocks 2 tier",
             exp_yaml(cache="{capacity_blocks: 300, policy: lru, tiers: [{name: a, capacity_blocks: 100, "
                            "chunk_blocks: 2}, {name: b, capacity_blocks: 100, write: write_back}]}"),
             names=["'b'", "chunk"])

    def edited_trace(ctx: Any) -> Any:
        use(ctx, "mc300")
        ctx.write("exp.yaml", exp_yaml(name="y65", extra=_grid({"cache.capacity_blocks": [100, 300]})))
        first = ctx.run("run", "exp.yaml", "--results", "res", "--quiet", "--no-figure")
        if first.rc != 0:
            return rb.failure_of(first, "first run")
        mc = ctx.path("mc300.jsonl")
        mc.write_text("".join(mc.read_text().splitlines(keepends=True)[:100]))
        second = ctx.run("run", "exp.yaml", "--results", "res", "--quiet", "--no-figure")
        if second.rc != 0:
            return rb.failure_of(second, "second run (edited trace)")
        return _load_verdict(ctx, "y65", ["trace"])

    rb.register(EF, "exp.trace-edited-between-runs", "TSV#42: the trace edited in place between two kvlab run: "
                "load() warns that runs of two trace contents share the folder (strict=True refuses)",
                edited_trace, weight=3)

    def two_definitions(allow: bool) -> Callable[[Any], Any]:
        def fn(ctx: Any) -> Any:
            _kexp(ctx, "res")
            ctx.write("expB.yaml", exp_yaml(name="kexp", trace=_kexp_trace(ctx), cache="{capacity_blocks: 300, "
                                            "policy: fifo}", extra=_grid({"cache.capacity_blocks": [100, 300]})))
            if not allow:
                ctx.protect("res/kexp")
                run = ctx.run("run", "expB.yaml", "--results", "res", "--quiet", "--no-figure")
                return rb.judge_error(run, ["--allow-redefine"])
            run = ctx.run("run", "expB.yaml", "--results", "res", "--quiet", "--no-figure", "--allow-redefine")
            if run.rc != 0:
                return rb.judge_ok(run)
            return _load_verdict(ctx, "kexp", ["defin"])

        return fn

    rb.register(EF, "exp.redefined-same-name", "TSV#43: a different experiment file under the same name: refused "
                "naming --allow-redefine, the first experiment's results kept", two_definitions(False), weight=2)
    rb.register(EF, "exp.redefined-allowed", "TSV#43: the same with --allow-redefine runs, and load() warns that "
                "two definitions share the folder (strict=True refuses)", two_definitions(True), weight=3)

    def cosmetic_edit(ctx: Any) -> Any:
        _kexp(ctx, "res")
        ctx.write("exp.yaml", "# the same experiment, keys reordered and commented\nsweep:\n  grid:\n"
                  "    cache.capacity_blocks: [50, 100, 200, 300]\n"
                  f"cache: {{policy: lru, capacity_blocks: 300}}   # device\ntrace: {_kexp_trace(ctx)}\nname: kexp\n")
        run = ctx.run("run", "exp.yaml", "--results", "res", "--quiet", "--no-figure")
        return rb.judge_ok(run, run_check(ctx, "res", "kexp", 4))

    rb.register(EF, "exp.comments-and-key-order", "the same experiment with comments and keys reordered is the "
                "same definition: rerun accepted (no --allow-redefine needed)", cosmetic_edit, weight=2)


def _load_verdict(ctx: Any, name: str, words: Sequence[str], results: str = "res") -> Any:
    """load(name) must warn (a ResultsWarning naming each of ``words``), load(strict=True) raise ResultsError."""
    code = ("import json\nimport kvlab.results as R\nfrom kvlab.errors import ResultsError\n"
            f"t = R.load({name!r}, results={results!r})\nprint(json.dumps({{'rows': len(t)}}))\n"
            f"try:\n    R.load({name!r}, results={results!r}, strict=True)\n"
            "except ResultsError as exc:\n    print(json.dumps({'strict': str(exc)}))\n"
            "else:\n    print(json.dumps({'strict': None}))\n")
    run = py(ctx, code)

    def check() -> str | None:
        warned = warnings_of(run)
        if not warned:
            return f"no ResultsWarning ({json_out(run).get('rows')} rows)"
        text = " ".join(warned).lower()
        missing = [w for w in words if w.lower() not in text]
        if missing:
            return f"the warning does not name {missing}: {warned[0]}"
        if not json_out(run).get("strict"):
            return "load(strict=True) did not raise ResultsError"
        return None

    return rb.judge_ok(run, check)


# ------------------------------------------------------------------------------------------ tiers
REPLAY_MC300 = ["replay", "mc300.jsonl", "--capacity-blocks", "300", "--quiet"]


def _tier_case(cid: str, desc: str, tiers: Sequence[str], names: Sequence[str], *, backends: Sequence[str] =
               ("default",)) -> None:
    """``kvlab replay mc300 --tier ...`` on each backend (the default: the compiled kernel): a clear error, no
    output folder. tests/test_tier_rules.py runs every rule on both backends and three entry points."""
    for backend in backends:
        extra = [] if backend == "default" else ["--backend", backend]
        args = [*REPLAY_MC300, *[a for t in tiers for a in ("--tier", t)], *extra, "--out", "t"]
        suffix = "" if backend == "default" else f".{backend}"
        d = desc if backend == "default" else f"{desc.split(': ', 1)[-1]} (--backend {backend})"

        def fn(ctx: Any, args: list = args) -> Any:
            use(ctx, "mc300")
            v = rb.judge_error(ctx.run(*args), names)
            if v.outcome == "clear error" and ctx.path("t").exists():
                return rb.Verdict("silent wrong", f"refused, but left t/ behind: {v.detail}", v.run)
            return v

        rb.register(TS, cid + suffix, d, fn)


def _register_tiers() -> None:
    _tier_case("tier.chunk4-write-back", "TSV#10: chunk=4 with write=write_back (documented as refused)",
               ["dram:blocks=100:chunk=4:write=write_back"], ["dram", "chunk"])
    _tier_case("tier.write-back-below-chunk2", "TSV#11: a write_back tier below a chunk=2 tier",
               ["a:blocks=100:chunk=2", "b:blocks=100:write=write_back"], ["'b'", "chunk"])
    _tier_case("tier.smaller-than-chunk", "TSV#12: a tier of 3 blocks with chunk=4 (no whole chunk fits)",
               ["dram:blocks=3:chunk=4"], ["dram", "chunk"])
    _tier_case("tier.duplicate-key", "TSV#13: blocks=10:blocks=20 (a key given twice)",
               ["dram:blocks=10:blocks=20"], ["blocks"])
    _tier_case("tier.write-back-and-selective", "TSV#15: write=write_back together with selective=3 (two write "
               "policies)", ["dram:blocks=10:write=write_back:selective=3"], ["write_back", "selective"])

    def selective_spelling(ctx: Any) -> Any:
        use(ctx, "mc300")
        run = ctx.run(*REPLAY_MC300, "--tier", "dram:blocks=10:write=selective=3", "--out", "t")
        if run.rc == 0:
            def check() -> str | None:
                tiers = rb.read_json(ctx.path("t/summary.json")).get("tiers") or [{}]
                got = (tiers[0].get("write"), tiers[0].get("selective_hits"))
                return None if got == ("write_through_selective", 3) else f"tier write/selective_hits {got}"

            return rb.judge_ok(run, check)
        v = rb.judge_error(run, ["write"])
        if v.outcome != "clear error":
            return v
        helped = ctx.run("replay", "--help")
        flat = re.sub(r"\s+", "", helped.out)
        if re.search(r"write=[a-z_|]*\|selective=", flat):
            return rb.Verdict("unclear error", "refused, but `kvlab replay --help` still offers "
                                               f"write=...|selective=K: {run.last_line}", run)
        return v

    rb.register(TS, "tier.write-selective-spelling", "TSV#14: write=selective=3, the spelling --help showed: "
                "accepted, or refused and --help shows only what the parser accepts", selective_spelling)
    rb.register("bad parameter", "policy-param.duplicate", "--policy-param segments given twice: refused naming it",
                _cli_error_fn([*REPLAY_MC300, "--policy", "slru", "--policy-param", "segments=2",
                               "--policy-param", "segments=3"], ["segments"], ("mc300",)))
    rb.register("bad parameter", "policy-param.bool", "--policy-param segments=true (a boolean is not 1 segment): "
                "refused naming it", _cli_error_fn([*REPLAY_MC300, "--policy", "slru", "--policy-param",
                                                    "segments=true", "--out", "o"], ["segments"], ("mc300",)))


def _cli_error_fn(args: Sequence[str], names: Sequence[str], inputs: Sequence[str] = (),
                  write: dict[str, str] | None = None, protect: Sequence[str] = (),
                  timeout: float | None = None) -> Callable[[Any], Any]:
    def fn(ctx: Any) -> Any:
        use(ctx, *inputs)
        for rel, data in (write or {}).items():
            ctx.write(rel, data)
        for p in protect:
            ctx.protect(p)
        return rb.judge_error(ctx.run(*args, timeout=timeout), names)

    return fn


# ------------------------------------------------------------------------------------------ simulator
SIM_MC300 = ["simulate", "mc300.jsonl", "--model", "llama-3-8b", "--hardware", "h100", "--limit", "100", "--quiet"]


def _register_simulator() -> None:
    rb.register(SF, "sim.medium-preset-nan-latency", "TSV#16: a medium preset file with \"latency_s\": NaN: "
                "refused naming the file and latency_s",
                _cli_error_fn(["simulate", "nat60.jsonl", "--model", "llama-3-8b", "--hardware", "h100",
                               "--capacity-blocks", "200", "--quiet", "--tier",
                               "ssd:blocks=5000:medium=nanlat.json:link=pcie5_x16", "--out", "s01b"],
                              ["nanlat.json", "latency_s"], ("nat60",),
                              {"nanlat.json": '{"kind": "medium", "bandwidth": 7e9, "latency_s": NaN}\n'}))
    rb.register(SF, "sim.prefetch-timeout-without-timeout", "TSV#17: --prefetch-timeout-s 5 without "
                "--tier-prefetch timeout: refused naming both",
                _cli_error_fn([*SIM_MC300, "--tier", "dram:gib=64:link=pcie5_x16", "--prefetch-timeout-s", "5",
                               "--out", "s06"], ["--prefetch-timeout-s", "--tier-prefetch"], ("mc300",)))

    def hardware_nan(ctx: Any) -> Any:
        use(ctx, "mc300")
        profile = json.loads((rb.REPO / "kvlab" / "data" / "hardware" / "h100.json").read_text())
        ctx.write("hw.json", json.dumps({**profile, "name": "nanhw", "memory_efficiency": float("nan")}))
        run = ctx.run("simulate", "mc300.jsonl", "--model", "llama-3-8b", "--hardware", "hw.json", "--limit", "100",
                      "--quiet", "--out", "s02")
        return rb.judge_error(run, ["hw.json", "memory_efficiency"])

    rb.register(SF, "sim.hardware-profile-nan", "a hardware profile JSON with memory_efficiency NaN: refused naming "
                "the file and the field", hardware_nan)

    def rate_minus_inf(ctx: Any) -> Any:
        use(ctx, "mc300")
        return rb.judge_error(ctx.run(*SIM_MC300, "--rate", "-inf"), ["--rate"], range_hint=True)

    rb.register(SF, "sim.rate-minus-inf", "TSV#18: --rate -inf (space-separated): refused naming --rate and its "
                "allowed range, not 'expected one argument'", rate_minus_inf)
    rb.register(SF, "sim.tensor-parallel-3", "TSV#19: --tensor-parallel 3 for llama-3-8b (8 KV heads): refused, "
                "as vLLM refuses it", _cli_error_fn([*SIM_MC300, "--tensor-parallel", "3", "--out", "s14"],
                                                     ["--tensor-parallel"], ("mc300",)))


# ------------------------------------------------------------------------------------------ layout study
LAYOUT = ("tokenizer: byte\nblock_size: 16\ncache_blocks: [512]\ncommon_layouts: [as_generated]\nfamilies:\n"
          "  rag:\n    family: rag\n    config: {n_requests: 4, k: 2}\n"
          "boundary: {prompt_tokens: 64, position_step: 16, block_sizes: [16], requests: 2}\n")


def _register_layout() -> None:
    _fifo_case(LS, "layout.config-fifo", "TSV#20: the layout-study config is a FIFO without a writer",
               ["layout-study", "cfg.fifo", "--out", "l09", "--quiet"], "cfg.fifo", ["cfg.fifo"])

    def foreign_out(ctx: Any) -> Any:
        ctx.write("base.yaml", LAYOUT)
        ctx.sentinel("mydata/thesis.tex", "thesis\n")
        run = ctx.run("layout-study", "base.yaml", "--out", "mydata", "--quiet")
        v = rb.judge_error(run, ["mydata"])
        extra = sorted(p.name for p in ctx.path("mydata").iterdir() if p.name != "thesis.tex")
        if v.outcome == "clear error" and extra:
            return rb.Verdict("silent wrong", f"refused, but wrote {extra} into mydata", run)
        return v

    rb.register(LS, "layout.out-foreign-folder", "TSV#21: --out a user folder holding thesis.tex: refused, "
                "nothing written beside it", foreign_out)
    rb.register(LS, "layout.family-named-boundary", "TSV#22: a family named 'boundary' (the boundary sweep's "
                "folder): refused", _cli_error_fn(["layout-study", "l27.yaml", "--out", "l27", "--quiet"],
                                                  ["boundary"], write={"l27.yaml": LAYOUT.replace("  rag:\n",
                                                                                                 "  boundary:\n")}))
    _simple_neg(LS, "layout.rag-n-requests-1e9", "TSV#23: families.rag.config.n_requests 10^9: refused naming "
                "the field (not flags the command lacks)", ["layout-study", "l16.yaml", "--out", "l16", "--quiet"],
                ["n_requests"], not_naming=["--limit", "capacity"],
                write={"l16.yaml": LAYOUT.replace("n_requests: 4", "n_requests: 1000000000")})
    rb.register(LS, "layout.cache-blocks-bool", "a layout config with cache_blocks: [true] (a boolean is not 1 "
                "block)", _cli_error_fn(["layout-study", "lb.yaml", "--out", "lb", "--quiet"], ["cache_blocks"], write={
                    "lb.yaml": LAYOUT.replace("cache_blocks: [512]", "cache_blocks: [true]")}))
    rb.register(LS, "layout.duplicate-key", "a layout config with block_size twice: refused naming it",
                _cli_error_fn(["layout-study", "dup.yaml", "--out", "ld", "--quiet"], ["block_size", "line"],
                              write={"dup.yaml": LAYOUT + "block_size: 32\n"}))
    rb.register(LS, "layout.nan-float", "a layout config with boundary.position_step .nan: refused naming it",
                _cli_error_fn(["layout-study", "nan.yaml", "--out", "ln", "--quiet"], ["position_step"],
                              write={"nan.yaml": LAYOUT.replace("position_step: 16", "position_step: .nan")}))


# ------------------------------------------------------------------------------------------ tokenizers, text
def _register_text() -> None:
    rb.register(TT, "tok.empty-tiktoken-study", "TSV#24: an empty .tiktoken file as the study tokenizer: refused "
                "naming the file (no endless loop)",
                _cli_error_fn(["layout-study", "l23.yaml", "--out", "l23", "--quiet"], ["empty.tiktoken"],
                              write={"l23.yaml": LAYOUT.replace("tokenizer: byte", "tokenizer: empty.tiktoken"),
                                     "empty.tiktoken": ""}, timeout=FIFO_TIMEOUT * 2))
    py_case(TT, "tok.empty-tiktoken-python", "TSV#25: load_tokenizer('empty.tiktoken'): a ConfigError naming the "
            "file", "from kvlab.workload.tokenizer import load_tokenizer\n"
                    "print(load_tokenizer('empty.tiktoken').encode('hello world'))\n", ["empty.tiktoken"],
            setup=lambda ctx: ctx.write("empty.tiktoken", ""))
    py_case(TT, "tok.lone-surrogate-render", "TSV#26: render_prompt with a lone surrogate: a ConfigError naming the "
            "text field", "from kvlab.workload.tokenizer import load_tokenizer\n"
                          "from kvlab.workload.render import Message, Part, render_prompt\n"
                          "render_prompt(load_tokenizer('byte'), [Message('user', (Part('user', "
                          "'bad \\ud800 surrogate'),))])\n", ["surrogate"])
    py_case(TT, "tok.lone-surrogate-mt-bench", "an MT-Bench question file with a \\ud800 JSON escape: a "
            "TraceFormatError naming the file, line and turns[0]",
            "from kvlab.workload.text import mt_bench_sessions\nfrom kvlab.workload.tokenizer import load_tokenizer\n"
            "mt_bench_sessions('q.jsonl', load_tokenizer('byte'))\n", ["q.jsonl:1", "turns[0]"],
            setup=lambda ctx: ctx.write("q.jsonl", '{"question_id": 1, "category": "writing", '
                                                   '"turns": ["bad \\ud800 one", "two"]}\n'))
    py_case(TT, "tok.lone-surrogate-encode", "ByteTokenizer.encode of a lone surrogate: a ConfigError",
            "from kvlab.workload.tokenizer import load_tokenizer\nload_tokenizer('byte').encode('x \\udfff y')\n",
            ["surrogate"])


# ------------------------------------------------------------------------------------------ figures
FIGURES = ["figures", "--notebooks", "nbs", "--quick"]


def _register_figures() -> None:
    def foreign(ctx: Any) -> Any:
        use(ctx, "nbs")
        ctx.sentinel("mine/thesis.tex", "thesis\n")
        ctx.sentinel("mine/01_tiny/hit_rate.png", "MY PNG\n")
        ctx.sentinel("mine/01_tiny/hit_rate.parquet", "my data\n")
        before = ctx.listing(ctx.path("mine"))
        run = ctx.run(*FIGURES, "--out", "mine", timeout=90)
        v = rb.judge_error(run, ["mine"])
        new = sorted(str(p.relative_to(ctx.root)) for p in ctx.listing(ctx.path("mine")) - before)
        if v.outcome == "clear error" and new:
            return rb.Verdict("silent wrong", f"refused, but wrote {new[:4]}", run)
        return v

    rb.register(FG, "fig.out-foreign-folder", "TSV#29: --out a user folder with thesis.tex and its own 01_tiny/"
                "hit_rate.png and .parquet: refused, nothing replaced", foreign, weight=3)

    def truncated(ctx: Any) -> Any:
        use(ctx, "nbs")
        shutil.copytree(ctx.path("nbs"), ctx.path("badnbs"))
        ctx.sentinel("badnbs/02_broken.ipynb", '{"cells": [\n')
        run = ctx.run("figures", "--notebooks", "badnbs", "--out", "f06", "--quick", timeout=90)
        v = rb.judge_error(run, ["02_broken.ipynb"])
        if v.outcome == "clear error" and ctx.path("f06").exists():
            return rb.Verdict("unclear error", f"refused only after running notebooks (f06/ written): {v.detail}",
                              run)
        return v

    rb.register(FG, "fig.truncated-notebook", "TSV#30: a truncated .ipynb among the notebooks: refused naming it "
                "before any notebook runs", truncated, weight=3)

    def strip(ctx: Any) -> Any:
        use(ctx, "nbs")
        ctx.write("badnbs/01_tiny.ipynb", ctx.path("nbs/01_tiny.ipynb").read_text())
        ctx.sentinel("badnbs/02_broken.ipynb", '{"cells": [\n')
        return rb.judge_error(ctx.run("figures", "--notebooks", "badnbs", "--strip"), ["02_broken.ipynb"])

    rb.register(FG, "fig.strip-truncated-notebook", "TSV#31: --strip over a truncated .ipynb: refused naming it, "
                "the file kept", strip)
    rb.register(FG, "fig.out-is-a-file", "TSV#32: --out an existing file: refused naming it (no raw errno)",
                _cli_error_fn([*FIGURES, "--out", "outfile"], ["outfile"], ("nbs",), {"outfile": "x\n"},
                              ["outfile"], timeout=90), weight=2)

    def symlinked(ctx: Any) -> Any:
        use(ctx, "nbs")
        ctx.sentinel("other/keep.txt", "keep\n")
        ctx.path("linkout").symlink_to("other")
        run = ctx.run(*FIGURES, "--out", "linkout", timeout=90)
        v = rb.judge_error(run, ["linkout"])
        extra = sorted(p.name for p in ctx.path("other").iterdir() if p.name != "keep.txt")
        if extra:
            return rb.Verdict("silent wrong", f"wrote {extra} through the symlink", run)
        return v

    rb.register(FG, "fig.out-symlink", "TSV#33: --out a symlink to a user folder: refused, nothing written "
                "through it", symlinked, weight=2)


# ------------------------------------------------------------------------------------------ result tables
def _kexp_trace(ctx: Any) -> str:
    """The shared experiment's ``trace:`` section (the shared inputs' mc300 by absolute path)."""
    return f"{{path: {_make_inputs(ctx) / 'mc300.jsonl'}}}"


def _kexp(ctx: Any, dest: str) -> Path:
    """A copy of a complete 4-run experiment 'kexp' (LRU at 50-300 blocks) as ``dest/kexp``, with its file
    ``kexp.yaml`` and ``mc300.jsonl`` in the case's folder. The file names the trace by its absolute path in the
    shared inputs, so the copy is the same definition as the original."""

    def build(c: Any, folder: Path) -> Any:
        shutil.copyfile(_make_inputs(c) / "mc300.jsonl", folder / "mc300.jsonl")
        (folder / "kexp.yaml").write_text(exp_yaml(name="kexp", trace=_kexp_trace(c),
                                                   extra=_grid({"cache.capacity_blocks": [50, 100, 200, 300]})))
        return c.finish(c.runner.start(["run", "kexp.yaml", "--results", "res", "--quiet", "--no-figure"],
                                       cwd=folder))

    ref = cached(ctx, "kexp", build)
    for f in ("mc300.jsonl", "kexp.yaml"):
        if not ctx.path(f).exists():
            shutil.copyfile(ref / f, ctx.path(f))
    shutil.copytree(ref / "res", ctx.path(dest))
    return ctx.path(dest) / "kexp"


def _run_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in (folder / "runs").iterdir() if p.is_dir())


def _damaged_load(damage: Callable[[Path], list[str]], timeout: float | None = None) -> Callable[[Any], Any]:
    """Damage a copy of kexp (``damage`` returns the run ids it touched); load() must warn naming one."""

    def fn(ctx: Any) -> Any:
        exp = _kexp(ctx, "c1")
        touched = damage(exp)
        code = ("import json\nimport kvlab.results as R\nfrom kvlab.errors import ResultsError\n"
                "t = R.load('kexp', results='c1')\nprint(json.dumps({'rows': len(t)}))\n"
                "try:\n    R.load('kexp', results='c1', strict=True)\n"
                "except ResultsError as exc:\n    print(json.dumps({'strict': str(exc)}))\n"
                "else:\n    print(json.dumps({'strict': None}))\n")
        run = py(ctx, code, timeout=timeout)

        def check() -> str | None:
            warned = warnings_of(run)
            rows = json_out(run).get("rows")
            if not warned:
                return f"{rows} of 4 rows and no ResultsWarning"
            if not any(t[:8] in " ".join(warned) for t in touched):
                return f"the warning names none of the damaged runs {[t[:8] for t in touched]}: {warned[0]}"
            if not json_out(run).get("strict"):
                return "load(strict=True) did not raise ResultsError"
            return None

        return rb.judge_ok(run, check)

    return fn


def _truncate_requests(exp: Path) -> list[str]:
    run = _run_dirs(exp)[1]
    p = run / "requests.parquet"
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size // 2)
    return [run.name]


def _fifo_manifest(exp: Path) -> list[str]:
    run = _run_dirs(exp)[1]
    (run / "manifest.json").unlink()
    os.mkfifo(run / "manifest.json")
    return [run.name]


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def _swap_requests(exp: Path) -> list[str]:
    a, b = _run_dirs(exp)[:2]
    _swap(a / "requests.parquet", b / "requests.parquet")
    return [a.name, b.name]


def _swap_folders(exp: Path) -> list[str]:
    a, b = _run_dirs(exp)[:2]
    _swap(a, b)
    return [a.name, b.name]


def _register_results() -> None:
    rb.register(RT, "res.load-truncated-run", "TSV#34: load() with one run's requests.parquet truncated: a "
                "ResultsWarning naming the run (strict=True: ResultsError)", _damaged_load(_truncate_requests),
                weight=2)
    rb.register(RT, "res.load-fifo-manifest", "load() with a FIFO as one run's manifest.json: a ResultsWarning "
                "naming the run, no hang", _damaged_load(_fifo_manifest, timeout=FIFO_TIMEOUT), weight=2)
    rb.register(RT, "res.load-swapped-requests", "TSV#35: load() after swapping two runs' requests.parquet: a "
                "ResultsWarning naming them", _damaged_load(_swap_requests), weight=2)
    rb.register(RT, "res.load-swapped-run-folders", "TSV#36: load() after exchanging two run folders' names: a "
                "ResultsWarning naming them", _damaged_load(_swap_folders), weight=2)

    def corrupt_sweep(ctx: Any) -> Any:
        exp = _kexp(ctx, "c4")
        want = rb.read_table(exp / "sweep.parquet")
        with open(exp / "sweep.parquet", "r+b") as f:
            f.truncate(100)
        run = ctx.run("run", "kexp.yaml", "--results", "c4", "--quiet", "--no-figure")
        return rb.judge_ok(run, lambda: rb.same_table(rb.read_table(exp / "sweep.parquet"), want))

    def foreign_run(ctx: Any) -> Any:
        exp = _kexp(ctx, "c1")
        first = ctx.run("replay", "mc300.jsonl", "--capacity-blocks", "150", "--quiet", "--out", "r1")
        if first.rc != 0:
            return rb.failure_of(first, "the replay")
        run_id = rb.read_json(ctx.path("r1/manifest.json"))["run_id"]
        shutil.copytree(ctx.path("r1"), exp / "runs" / run_id)
        return _load_verdict(ctx, "kexp", [run_id[:8]], results="c1")

    rb.register(RT, "res.load-foreign-replay-run", "load() of an experiment folder holding a run kvlab replay wrote "
                "(copied in by hand): a ResultsWarning naming it (strict=True: ResultsError)", foreign_run, weight=2)
    def resume_fifo(ctx: Any) -> Any:
        exp = _kexp(ctx, "c5")
        touched = _fifo_manifest(exp)
        run = ctx.run("run", "kexp.yaml", "--results", "c5", "--quiet", "--no-figure", timeout=FIFO_TIMEOUT)
        return rb.judge_either(run, [touched[0]], run_check(ctx, "c5", "kexp", 4))

    rb.register(RT, "res.resume-fifo-manifest", "kvlab run resumed over a run whose manifest.json is a FIFO: "
                "refused naming the run, or the table complete; no hang", resume_fifo, weight=2)
    rb.register(RT, "res.resume-rebuilds-corrupt-sweep", "TSV#37: kvlab run resumed (every run complete) over a "
                "truncated sweep.parquet: the table is rebuilt", corrupt_sweep, weight=2)

    def replay_into_experiment(ctx: Any) -> Any:
        _kexp(ctx, "res")
        ctx.protect("res")
        run = ctx.run("replay", "mc300.jsonl", "--capacity-blocks", "100", "200", "--quiet", "--out", "res/kexp")
        return rb.judge_error(run, ["res/kexp"])

    rb.register(RT, "res.replay-into-experiment-folder", "TSV#46: kvlab replay --out an experiment's results "
                "folder: refused, the experiment kept", replay_into_experiment, weight=2)

    def wrong_columns(ctx: Any) -> Any:
        use(ctx, "mc300")
        first = ctx.run("replay", "mc300.jsonl", "--capacity-blocks", "100", "--quiet", "--out", "r1")
        if first.rc != 0:
            return rb.failure_of(first, "the replay")
        req = rb.write_parquet(ctx.path("r1/requests.parquet"), {"foo": [1, 2], "bar": [3, 4]})
        manifest = rb.read_json(ctx.path("r1/manifest.json"))
        manifest["files"]["requests.parquet"] = {"bytes": req.stat().st_size, "sha256": rb.sha256_path(req)}
        ctx.write("r1/manifest.json", json.dumps(manifest, indent=1))
        run = py(ctx, "import kvlab.results\nprint(list(kvlab.results.read_results('r1').requests.columns))\n")
        v = rb.judge_error(run, ["requests.parquet"])
        if v.outcome == "clear error" and "ResultsError" not in run.last_line:
            return rb.Verdict("unclear error", f"not a ResultsError: {run.last_line}", run)
        return v

    rb.register(RT, "res.read-results-wrong-columns", "TSV#47: read_results of a requests.parquet with other "
                "columns (manifest checksums updated): a ResultsError naming it", wrong_columns)
    rb.register("output location", "out.download-cache-dir-file", "TSV#38: kvlab download --cache-dir an "
                "existing file: refused naming it as not a folder",
                _cache_dir_file, weight=1)


def _cache_dir_file(ctx: Any) -> Any:
    ctx.sentinel("cdfile", "x\n")
    run = ctx.run("download", "alibaba_traceA", "--cache-dir", "cdfile")
    v = rb.judge_error(run, ["cdfile"])
    if v.outcome == "clear error" and ("Errno" in run.last_line or not re.search(r"folder|director",
                                                                                 run.last_line, re.I)):
        return rb.Verdict("unclear error", f"does not say it must be a folder: {run.last_line}", run)
    return v


# ------------------------------------------------------------------------------------------ Python API
def _register_api() -> None:
    py_case(PA, "api.replay-none", "TSV#39: replay(None, capacity_blocks=100): a ConfigError naming the argument",
            "from kvlab.replay import replay\nreplay(None, capacity_blocks=100)\n", ["workload"])
    py_case(PA, "api.replay-path", "TSV#40: replay('mc20.jsonl', ...) with a path: a ConfigError naming the "
            "argument and load_trace", "from kvlab.replay import replay\nreplay('mc20.jsonl', capacity_blocks=100)\n",
            ["workload", "load_trace"], inputs=("mc20",))
    py_case(PA, "api.tier-capacity-bool", "TSV#41: Tier(name='dram', capacity_blocks=True): a ConfigError naming "
            "capacity_blocks", "from kvlab.tiers import Tier\nprint(Tier(name='dram', capacity_blocks=True))\n",
            ["capacity_blocks"])
    py_case(PA, "api.load-none", "kvlab.results.load(None): a ConfigError naming the argument (not a TypeError)",
            "import kvlab.results\nkvlab.results.load(None)\n", ["experiment"])
    py_case(PA, "api.read-results-none", "kvlab.results.read_results(None): a ConfigError naming the argument",
            "import kvlab.results\nkvlab.results.read_results(None)\n", ["path"])
    py_case(PA, "api.run-experiment-dict", "run_experiment({...}) with a dict: a ConfigError naming the argument "
            "(an Experiment or a YAML path), not a TypeError",
            "from kvlab.experiment import run_experiment\nrun_experiment({'name': 'x', 'trace': {'path': "
            "'mc20.jsonl'}, 'cache': {'capacity_blocks': 100}})\n", ["experiment"], inputs=("mc20",))
    py_case(PA, "api.sweep-grid-bool", "run_sweep(w, grid([True, 100])): a ConfigError naming capacity_blocks",
            "from kvlab.sweep import grid, run_sweep\nfrom kvlab.workload import load_trace\n"
            "run_sweep(load_trace('mc20.jsonl'), grid([True, 100]), progress=False)\n", ["capacity_blocks"],
            inputs=("mc20",))
    py_case(PA, "api.synthetic-chat-1e9", "synthetic_chat(10**9): refused naming n_requests (generators bounded "
            "like the layout families), not a MemoryError or minutes of work",
            "from kvlab.workload import synthetic_chat\nsynthetic_chat(10**9, seed=1)\n", ["n_requests"], timeout=10)


def register_all(core: ModuleType) -> None:
    """Register every case of this module in ``core`` (benchmarks/robustness.py, whose CLASSES hold ours)."""
    global rb
    rb = core
    _register_experiment()
    _register_tiers()
    _register_simulator()
    _register_layout()
    _register_text()
    _register_figures()
    _register_results()
    _register_api()


def tsv_numbers(cases: Sequence[Any]) -> dict[int, list[str]]:
    """TSV row number -> the ids of the cases that turn it into a test."""
    out: dict[int, list[str]] = {}
    for c in cases:
        m = re.match(r"TSV#(\d+):", c.desc)
        if m:
            out.setdefault(int(m.group(1)), []).append(c.id)
    return out
