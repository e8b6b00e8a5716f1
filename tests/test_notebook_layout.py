"""Every figure of the quick notebooks is printable as it is: its caption JSON (kvlab.plots.style.save) records
no layout problem (legend over data, overlapping tick labels, clipped text, text under 7 pt at print size, two
series alike, wider than 7.2 in: kvlab.plots.layout_check) and its PDF page is at most style.MAX_WIDTH (7.2 in)
wide. Each notebook runs once here in quick mode (KVLAB_QUICK=1, as ``kvlab figures --quick``), in a temporary
folder."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from kvlab.figures import run_notebook
from kvlab.plots import style

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def pdf_width_in(path: Path) -> float:
    """The width in inches of the first page of a matplotlib PDF (its MediaBox, in points of 1/72 in)."""
    box = re.search(rb"/MediaBox\s*\[\s*([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)\s*\]", path.read_bytes())
    assert box, f"{path}: no MediaBox"
    x0, _, x1, _ = (float(v) for v in box.groups())
    return (x1 - x0) / 72.0


def figure_problems(folder: Path) -> dict[str, list[str]]:
    """``{figure: problems}`` for every figure (PNG) in ``folder``: no caption JSON, no ``layout_problems`` in
    it, the problems it lists, or a PDF wider than style.MAX_WIDTH."""
    out: dict[str, list[str]] = {}
    for png in sorted(folder.glob("*.png")):
        name, problems = png.stem, []
        caption = folder / f"{name}.json"
        record = json.loads(caption.read_text()) if caption.is_file() else None
        if not isinstance(record, dict):
            problems.append("no caption JSON (style.save(..., caption=...))")
        elif "layout_problems" not in record:
            problems.append("caption without layout_problems (not saved by style.save)")
        else:
            problems += [str(p) for p in record["layout_problems"]]
        pdf = folder / f"{name}.pdf"
        if not pdf.is_file():
            problems.append("no PDF")
        elif (width := pdf_width_in(pdf)) > style.MAX_WIDTH + 0.05:  # save's 0.02 in margin on each side
            problems.append(f"{width:.2f} in wide (at most {style.MAX_WIDTH} in)")
        if problems:
            out[name] = problems
    return out


def test_pdf_width_and_problems_are_read_from_a_saved_figure(tmp_path):
    fig, ax = style.figure(width="double")
    ax.plot([1, 2, 3], [1, 2, 3], label="lru", **style.policy_style("lru"))
    ax.set_xlabel("capacity (GiB)")
    ax.set_ylabel("token hit rate")
    style.save(fig, tmp_path / "ok", "fig", caption=style.caption("LRU rises."))
    assert figure_problems(tmp_path / "ok") == {}
    assert 6.9 <= pdf_width_in(tmp_path / "ok" / "fig.pdf") <= style.MAX_WIDTH + 0.05
    import matplotlib.pyplot as plt

    wide, ax = plt.subplots(figsize=(11, 3))
    ax.plot([1, 2], [1, 2])
    style.save(wide, tmp_path / "wide", "fig", caption=style.caption("too wide"))
    problems = figure_problems(tmp_path / "wide")["fig"]
    assert any("wide" in p for p in problems), problems
    plt.close("all")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_quick_notebook_figure_has_a_clean_layout(path, shared_traces, monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_TRACE_DIRS", str(shared_traces) + os.pathsep + os.environ.get("KVLAB_TRACE_DIRS", ""))
    out = tmp_path / "figures"
    run_notebook(path, out, quick=True, cwd=tmp_path, timeout=600)
    assert list((out / path.stem).glob("*.png")), f"{path.stem}: wrote no figure"
    problems = figure_problems(out / path.stem)
    assert not problems, f"{path.stem}: " + "; ".join(f"{name}: {', '.join(p)}" for name, p in problems.items())
