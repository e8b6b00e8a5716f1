"""The index of ``kvlab figures``: every figure under OUT with its caption's finding, config hash, trace checksum,
timing and needs-download marks and data digests, each notebook's measured wall time and the machine it was
measured on; written as ``OUT/index.json`` and ``OUT/index.md`` (owned outputs). :mod:`kvlab.figures` runs the
notebooks and re-exports these names."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

INDEX_KIND = "kvlab figures index"
MD_MARK = "<!-- kvlab figures index: written by `kvlab figures`, replaced on every run -->"
FIGURE_SUFFIXES = (".png", ".pdf", ".parquet", ".json")
#: the files kvlab figures writes at the top of OUT
INDEX_FILES = ("index.json", "index.md")


def executed_path(notebook: Path, out: Path, executed_dir: Path | None = None) -> Path:
    """Where the executed copy of ``notebook`` goes: ``OUT/<stem>/<stem>.ipynb`` or ``DIR/<stem>.ipynb``."""
    return (executed_dir / notebook.name) if executed_dir is not None else out / notebook.stem / notebook.name


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def figure_records(folder: Path, since: float | None = None) -> list[dict[str, Any]]:
    """The figures in ``folder``: for each name, its files and its caption's finding, config hash, trace
    checksum, timing and needs-download marks and the data's sha256. ``stale``: no file of it written since
    ``since`` (the notebook no longer makes it)."""
    if not folder.is_dir():
        return []
    names = sorted({p.stem for p in folder.iterdir()
                    if p.suffix in FIGURE_SUFFIXES and p.is_file() and not p.name.startswith(".")})
    records = []
    for name in names:
        files = [folder / f"{name}{s}" for s in FIGURE_SUFFIXES if (folder / f"{name}{s}").is_file()]
        cap = _read_json(folder / f"{name}.json") if (folder / f"{name}.json").is_file() else None
        cap = cap if isinstance(cap, dict) else {}
        trace = cap.get("trace") if isinstance(cap.get("trace"), dict) else {}
        data = folder / f"{name}.parquet"
        timing = cap.get("timing", False)
        timing = sorted(map(str, timing)) if isinstance(timing, list) else bool(timing)
        records.append({
            "name": name,
            "files": [p.name for p in files],
            "finding": cap.get("finding"),
            "config_hash": cap.get("config_hash"),
            "trace": Path(str(trace["source"])).name if trace.get("source") else None,
            "trace_sha256": trace.get("file_sha256") or trace.get("content_sha256"),
            "timing": timing,
            "needs_download": cap.get("needs_download"),
            "data_sha256": hashlib.sha256(data.read_bytes()).hexdigest() if data.is_file() else None,
            "stable_sha256": _stable_sha256(data, timing) if data.is_file() else None,
            "stale": since is not None and max(p.stat().st_mtime for p in files) < since - 2.0,
        })
    return records


def caption_problems(folder: Path, executed: Path | None = None) -> list[str]:
    """Figures in ``folder`` whose caption is missing or incomplete (a finding and a config hash) or is not
    shown in the executed notebook (``executed``, default ``folder/<folder name>.ipynb``: its config hash and
    trace sha256 prefix in some cell's output, as ``style.caption_markdown`` writes them)."""
    executed = _read_json(executed if executed is not None else folder / f"{folder.name}.ipynb")
    shown = json.dumps([c.get("outputs", []) for c in executed.get("cells", [])]) if isinstance(executed, dict) else ""
    problems = []
    for f in figure_records(folder):
        if f["stale"] or f["needs_download"]:
            continue
        if not f["finding"] or not f["config_hash"]:
            problems.append(f"{folder.name}/{f['name']}: caption without a finding or config hash")
        elif f["config_hash"] not in shown or (f["trace_sha256"] and f["trace_sha256"][:12] not in shown):
            problems.append(f"{folder.name}/{f['name']}: no cell output shows its caption (config hash, trace)")
    return problems


def _stable_sha256(path: Path, timing: bool | list[str]) -> str | None:
    """sha256 of the part of a figure's data that must repeat: the whole parquet file, or (``timing`` a list of
    columns) the data without those columns, re-encoded; None when all of it is timing."""
    if timing is True:
        return None
    if not timing:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    import io

    import pandas as pd

    buffer = io.BytesIO()
    pd.read_parquet(path).drop(columns=timing, errors="ignore").to_parquet(buffer, index=False)
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def machine() -> dict[str, Any]:
    """The machine the notebooks' times were measured on: the cores this process may use (as ``nproc``
    counts them) and the CPU model (``/proc/cpuinfo``'s ``model name``; None where there is none)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count()
    model = None
    with contextlib.suppress(OSError, UnicodeDecodeError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name":
                model = " ".join(value.split())
                break
    return {"cores": cores, "cpu": model}


def machine_text(info: dict[str, Any]) -> str:
    """``2 cores, AMD EPYC 7B13`` (``nproc`` cores, CPU model)."""
    return f"{info.get('cores')} cores, {info.get('cpu') or 'CPU model unknown'}"


def build_index(out: Path, quick: bool, executed_dir: Path | None = None) -> dict[str, Any]:
    """The index of every notebook folder under ``out`` (figures and the executed copy's run record; executed
    copies in ``executed_dir`` if given)."""
    notebooks = []
    folders = sorted(p for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")) if out.is_dir() else []
    for folder in folders:
        path = executed_path(Path(f"{folder.name}.ipynb"), out, executed_dir)
        executed = _read_json(path)
        run = executed.get("metadata", {}).get("kvlab_figures", {}) if isinstance(executed, dict) else {}
        figures = figure_records(folder, since=run.get("started"))
        if not figures and not run:
            continue
        notebooks.append({"notebook": folder.name, "executed": os.path.relpath(path, out) if run else None,
                          "quick": run.get("quick"), "seconds": run.get("seconds"), "error": run.get("error"),
                          "needs_download": run.get("needs_download"), "figures": figures})
    total = sum(nb["seconds"] or 0.0 for nb in notebooks)
    return {"kind": INDEX_KIND, "quick": quick, "machine": machine(), "total_seconds": round(total, 3),
            "notebooks": notebooks}


def data_digests(index: dict[str, Any]) -> dict[str, str]:
    """``{"<notebook>/<figure>": stable_sha256}`` for every figure with data that is not all timing: what two
    runs must write byte-equal (the parquet file, or its non-timing columns)."""
    return {f"{nb['notebook']}/{f['name']}": f["stable_sha256"] for nb in index["notebooks"] for f in nb["figures"]
            if f["stable_sha256"] and not f["stale"]}


def index_markdown(index: dict[str, Any]) -> str:
    """The index as Markdown: one table per notebook (figure, finding, config hash, trace, files)."""
    lines = [MD_MARK, "", "# Figures" + (" (quick mode)" if index["quick"] else ""), "",
             "Regenerate with `make figures` (docs/figures.md). Each figure's data is `<figure>.parquet`, its caption "
             "`<figure>.json`.", ""]
    timed = [nb for nb in index["notebooks"] if nb.get("seconds") is not None]
    if timed:
        lines += [f"Wall time of each notebook's last run, measured on {machine_text(index.get('machine', {}))}: "
                  f"{sum(nb['seconds'] for nb in timed):,.0f} s in all ({len(timed)} notebooks).", "",
                  "| notebook | measured wall time (s) |", "|---|---|"]
        lines += [f"| {nb['notebook']} | {nb['seconds']:,.1f} |" for nb in timed] + [""]
    for nb in index["notebooks"]:
        secs = f", {nb['seconds']:.0f} s" if nb.get("seconds") is not None else ""
        lines += [f"## {nb['notebook']}{secs}", ""]
        if nb.get("needs_download"):
            commands = "`, `".join(nb["needs_download"])
            lines += [f"**Needs data** (stopped, nothing drawn): `{commands}`", ""]
        elif nb.get("error"):
            lines += [f"**Failed:** {nb['error']}", ""]
        if nb["figures"]:
            lines += ["| figure | finding | config | trace | files |", "|---|---|---|---|---|"]
        for f in nb["figures"]:
            finding = f["finding"] or ""
            if f["needs_download"]:
                finding = f"needs download: `{f['needs_download']}`" + (f"; {finding}" if finding else "")
            if f["stale"]:
                finding = "(stale: not written by the last run) " + finding
            trace = f"{f['trace'] or ''} `{(f['trace_sha256'] or '')[:12]}`" if f["trace_sha256"] else ""
            files = " ".join(f"[{Path(n).suffix[1:]}]({nb['notebook']}/{n})" for n in f["files"])
            cells = [f["name"], finding, f"`{f['config_hash']}`" if f["config_hash"] else "", trace, files]
            lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def write_index(out: Path, quick: bool, executed_dir: Path | None = None) -> dict[str, Any]:
    """Write ``out/index.json`` and ``out/index.md`` as owned outputs (atomic, listed; a file kvlab did not write
    is refused, not replaced); returns the index."""
    from kvlab.plots.style import prepare_figure_folder
    from kvlab.results.owned import write_owned_text

    prepare_figure_folder(out, flag="--out", names=INDEX_FILES)
    index = build_index(out, quick, executed_dir)
    write_owned_text(out / "index.json", json.dumps(index, indent=2, sort_keys=True) + "\n", flag="--out")
    write_owned_text(out / "index.md", index_markdown(index), flag="--out")
    return index


__all__ = ["FIGURE_SUFFIXES", "INDEX_FILES", "INDEX_KIND", "MD_MARK", "build_index", "caption_problems",
           "data_digests", "executed_path", "figure_records", "index_markdown", "machine", "machine_text",
           "write_index"]
