"""One figure style for every kvlab plot, and one way to save a figure with the data behind it.

* Paper preset: :data:`COLUMN` (3.4 in) and :data:`DOUBLE` (7.0 in) print widths (:func:`figure`), fonts of
  7-9 pt (:data:`RC`), saved at their true size, so no figure needs shrinking (none wider than :data:`MAX_WIDTH`).
* Colours: the Okabe-Ito palette (colour-blind safe) without its pale yellow. Every policy and baseline has one
  fixed colour + marker + line style (:func:`policy_style`), every (marker, line style) pair unique so greyscale
  prints keep series apart; other series take :func:`series_style`. No panel draws more than :data:`MAX_SERIES`.
* Confidence bands (:func:`band`): the series' colour, translucent. Legends (:func:`legend`): right of the axes
  when there are more than :data:`LEGEND_INSIDE_MAX` entries. Storage tiers: :data:`TIER_COLORS`.
* :func:`save` writes ``<folder>/<name>.png`` and ``.pdf``, the data drawn as ``<name>.parquet`` (a tidy
  frame) and ``<name>.json`` (the caption: what the figure shows, and where its numbers came from: experiment
  config hash, trace checksum). Parquet files are written without pandas' index and with sorted metadata so the
  same data gives the same bytes. Every file is an owned output (:mod:`kvlab.results.owned`): atomic, listed in
  the folder's ``.kvlab-outputs.json`` with its sha256, and never replaced unless kvlab wrote it and nobody
  changed it since.

Figure folders: :func:`figure_folder` is ``$KVLAB_FIGURES_DIR/<notebook>`` (default ``results/figures``), the
layout ``make figures`` fills (docs/figures.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib as mpl
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from kvlab.plots.layout_check import layout_problems
from kvlab.plots.sizes import MAX_WIDTH, MIN_FONT_PT, SAVE_PAD  # the print limits, published here too

#: the layout problems :func:`save` found in the figure it saved last (:func:`layout_problems`); [] when none
last_problems: list[str] = []

#: Okabe & Ito (2008), "Color Universal Design", without its yellow (#F0E442: too pale for a line on white);
#: index 6 is its grey, index 7 black (black alone is kept for baselines by :func:`policy_style`)
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#999999", "#000000")
#: "the rest" when a panel draws its top k series in colour and the others in one light grey, unlabelled
REST_COLOR = "#BBBBBB"
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
#: baselines (infinite cache, Belady, FLOP ideal): black, no marker, each with its own dash pattern
BASELINE = {"infinite cache": (0, (5, 3)), "belady": (0, (1, 2)), "flop ideal": (0, (3, 1, 1, 1))}
#: storage tiers (stacked shares, per-tier lines): the device first; other tier names take the palette in order
TIER_COLORS = {"device": PALETTE[0], "dram": PALETTE[2], "ssd": PALETTE[1], "pool": PALETTE[4]}
#: marks that flag a problem with a point (rejected requests), not a series
ALERT = "red"
#: confidence bands: the series' colour at this opacity, no edge
BAND_ALPHA = 0.2
#: a legend with more entries than this goes right of the axes, outside the data
LEGEND_INSIDE_MAX = 6
#: print sizes (inches, width x height): one column of a two-column paper, and the full text width.
#: A figure is saved at its true size (``bbox_inches="tight"``, :data:`SAVE_PAD` margin), so a font's pt size in
#: :data:`RC` is its printed size as long as the saved figure is at most :data:`MAX_WIDTH` wide.
COLUMN = (3.4, 2.4)
DOUBLE = (7.0, 2.8)
WIDTHS = {"column": COLUMN, "double": DOUBLE}
#: old names, now print sizes: one panel = one column, two or three panels = the full width
SINGLE = COLUMN
WIDE = DOUBLE
#: no panel draws more series than this (more: small multiples, or the top k and the rest in REST_COLOR)
MAX_SERIES = 8
DPI = 300

RC = {
    "figure.figsize": COLUMN,
    "figure.dpi": 100,
    "savefig.dpi": DPI,
    "savefig.pad_inches": SAVE_PAD,
    "font.size": 8,
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "legend.fontsize": 7,
    "legend.title_fontsize": 7,
    "figure.titlesize": 9,
    "figure.labelsize": 8,
    "lines.linewidth": 1.2,
    "lines.markersize": 4,
    "axes.linewidth": 0.6,
    "xtick.major.width": 0.6,
    "ytick.major.width": 0.6,
    "legend.handlelength": 2.8,  # long enough to show a dash pattern
    "legend.framealpha": 0.9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.5,
    "axes.prop_cycle": mpl.cycler(color=PALETTE[:7]),
    "pdf.fonttype": 42,  # TrueType in PDFs (editable text, accepted by publishers)
    "svg.hashsalt": "kvlab",
}

#: one look per policy, the same in every figure: (colour, marker, line style). Colours from :data:`PALETTE`;
#: every (marker, line style) pair is unique, so every series can be told apart in greyscale too. Policies often
#: drawn together have different colours (classic: lru arc lfu s3fifo fifo sieve 2q; frequency: lfu lfuda
#: lfu-halflife wtinylfu pgdsf length-aware; leaf-only: prefix-aware* sglang-leaf trtllm-priority workload-aware).
#: Baselines are black without markers (their dashes in :data:`BASELINE`); ``belady`` is both a policy and a baseline.
_B, _O, _G, _V, _P, _S, _GREY = PALETTE[:7]
POLICY_STYLES: dict[str, tuple[str, str, Any]] = {
    # solid: the classic policies
    "lru": (_B, "o", "-"),
    "arc": (_V, "s", "-"),
    "lfu": (_G, "^", "-"),
    "s3fifo": (_O, "D", "-"),
    "sieve": (_P, "v", "-"),
    "fifo": (_S, "P", "-"),
    "2q": (_GREY, "X", "-"),
    "wtinylfu": (_V, "*", "-"),
    # dashed: frequency / cost variants and other classics
    "lfuda": (_O, "o", "--"),
    "lfu-halflife": (_P, "s", "--"),
    "pgdsf": (_S, "^", "--"),
    "length-aware": (_B, "D", "--"),
    "clock": (_G, "v", "--"),
    "slru": (_V, "P", "--"),
    "mru": (_GREY, "X", "--"),
    "ttl": (_O, "*", "--"),
    # dotted: leaf-only (radix tree) policies and cost-aware ones
    "prefix-aware": (_P, "o", ":"),
    "prefix-aware-lru": (_B, "s", ":"),
    "prefix-aware-lfu": (_G, "^", ":"),
    "sglang-leaf": (_O, "D", ":"),
    "trtllm-priority": (_V, "v", ":"),
    "workload-aware": (_S, "P", ":"),
    "gdsf": (_GREY, "X", ":"),
    # baselines: black, no marker
    "belady": ("#000000", "", BASELINE["belady"]),
    "infinite cache": ("#000000", "", BASELINE["infinite cache"]),
    "flop ideal": ("#000000", "", BASELINE["flop ideal"]),
}
#: (marker, line style) pairs no known policy uses: names not in :data:`POLICY_STYLES` (a policy registered by a
#: user) take one of these, chosen by a checksum of the name (the same in every process)
_SPARE = tuple((m, ls) for ls in ("-.", (0, (6, 2)), (0, (2, 1))) for m in ("h", "p", "d", "<", ">", "8"))


def apply() -> None:
    """Make the kvlab paper style matplotlib's default (notebooks call it once at the top)."""
    mpl.rcParams.update(RC)


def figure(width: str = "column", nrows: int = 1, ncols: int = 1, height: float | None = None,
           **subplots_kw: Any) -> tuple[Figure, Any]:
    """A new figure at a print width: ``"column"`` (:data:`COLUMN`, 3.4 in) or ``"double"`` (:data:`DOUBLE`,
    7.0 in); ``height`` in inches (default: the preset's height per row of panels, i.e. ``nrows`` times it).
    Constrained layout keeps titles, labels and legends inside the figure, so the saved size is the print
    size. Other keywords go to :func:`matplotlib.pyplot.subplots` (``sharex``, ``squeeze``, ...). Returns
    ``(fig, axes)`` as ``subplots`` does; makes the preset matplotlib's default first (:func:`apply`).
    Refused (ValueError): another width, a height that is not positive."""
    import matplotlib.pyplot as plt

    if width not in WIDTHS:
        raise ValueError(f"figure width must be one of {sorted(WIDTHS)}, not {width!r}")
    w, h = WIDTHS[width]
    if height is None:
        height = h * nrows
    if not height > 0:
        raise ValueError(f"figure height must be positive inches, not {height!r}")
    apply()
    subplots_kw.setdefault("layout", "constrained")
    return plt.subplots(nrows, ncols, figsize=(w, float(height)), **subplots_kw)


def policy_style(name: str) -> dict[str, Any]:
    """Colour, marker and line style of policy (or baseline) ``name``, the same in every figure
    (:data:`POLICY_STYLES`; case and surrounding blanks ignored). A name not in the map (a user's policy) gets a
    grey-free palette colour and a spare (marker, line style) pair chosen by the name's CRC-32, so it is stable
    across runs; two unknown names may collide, which :func:`layout_problems` reports."""
    import zlib

    key = str(name).strip().lower()
    if key in POLICY_STYLES:
        color, marker, linestyle = POLICY_STYLES[key]
    else:
        crc = zlib.crc32(key.encode())
        marker, linestyle = _SPARE[crc % len(_SPARE)]
        color = PALETTE[(crc // len(_SPARE)) % 6]
    return {"color": color, "marker": marker, "linestyle": linestyle}


def series_style(i: int) -> dict[str, Any]:
    """Colour, line style and marker of non-policy series ``i`` (0-based): the first 8 differ by colour and
    marker; from the 9th on the line style changes too, so series ``i`` and ``i + 8`` never look the same."""
    return {"color": PALETTE[i % len(PALETTE)], "linestyle": LINESTYLES[(i // len(PALETTE)) % len(LINESTYLES)],
            "marker": MARKERS[i % len(MARKERS)]}


def baseline_style(name: str) -> dict[str, Any]:
    """A reference line (``infinite cache``, ``belady``, ``flop ideal``): black, thin, its own dashes."""
    return {"color": "black", "linewidth": 1.0, "linestyle": BASELINE.get(name.lower(), (0, (4, 2)))}


def tier_color(name: str, i: int = 0) -> str:
    """Colour of storage tier ``name`` (:data:`TIER_COLORS`), else palette colour ``i``."""
    return TIER_COLORS.get(name.lower(), PALETTE[i % len(PALETTE)])


def band(ax: Axes, x: Any, low: Any, high: Any, color: str, **kw: Any) -> Any:
    """A confidence band ``low`` .. ``high`` over ``x`` in ``color`` (:data:`BAND_ALPHA`, no edge, no legend
    entry); returns the PolyCollection."""
    return ax.fill_between(x, low, high, color=color, alpha=BAND_ALPHA, linewidth=0, label="_nolegend_", **kw)


def legend(ax: Axes, *, outside: bool | None = None, **kw: Any) -> Any:
    """The axes' legend: inside (``loc``, default the best place) with up to :data:`LEGEND_INSIDE_MAX` entries,
    else (or with ``outside=True``) one column right of the axes, outside the data (``save`` keeps it in the
    file). None when nothing is labelled."""
    handles, _ = ax.get_legend_handles_labels()
    loc = kw.pop("loc", "best")
    if not handles:
        return None
    if outside or (outside is None and len(handles) > LEGEND_INSIDE_MAX):
        kw.pop("ncol", None)
        return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kw)
    return ax.legend(loc=loc, **kw)


def set_title(ax: Axes, text: str, **kw: Any) -> Any:
    """``ax.set_title(text)`` with every line wrapped at word boundaries to fit the figure's width (a title wider
    than its figure would widen the saved file past its print width); returns the Text."""
    import textwrap

    import matplotlib as mpl
    from matplotlib.font_manager import FontProperties

    size = FontProperties(size=kw.get("fontsize", mpl.rcParams["axes.titlesize"])).get_size_in_points()
    most = max(20, int((ax.figure.get_figwidth() - 0.1) * 72 / (0.55 * size)))  # characters: ~0.55 em each
    lines = [textwrap.fill(line, most) if line else line for line in text.split("\n")]
    return ax.set_title("\n".join(lines), **kw)


def value_ticks(ax: Axes, values: Any, axis: str = "x", most: int = 12) -> None:
    """Ticks at the data's own values (``most`` at most, e.g. the capacities swept) instead of a log axis'
    powers of ten; whole thousands written ``10k``, other values in full."""
    import numpy as np
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ticks = np.unique(np.asarray(values, dtype=np.float64))
    ticks = ticks[np.isfinite(ticks)]
    if not 0 < len(ticks) <= most:
        return
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(FixedLocator(ticks))
    target.set_minor_locator(NullLocator())
    target.set_major_formatter(FuncFormatter(_value_label))


def _value_label(v: float, _pos: object = None) -> str:
    if v >= 1000 and v % 1000 == 0:
        return f"{v / 1000:,.0f}k"
    return f"{v:,.0f}" if v == int(v) else f"{v:g}"


def figures_root(quick: bool) -> Path:
    """The default figures root: ``results/figures``, or ``results/figures/quick`` for quick runs (so a quick
    run never replaces the full figures); ``kvlab figures`` and :func:`figure_folder` share it."""
    return Path("results/figures/quick") if quick else Path("results/figures")


def figure_folder(notebook: str) -> Path:
    """Where notebook ``notebook`` (its stem, e.g. ``01_lru_vs_frequency``) writes its figures:
    ``$KVLAB_FIGURES_DIR/<notebook>``; by default ``results/figures/<notebook>``, or
    ``results/figures/quick/<notebook>`` in quick mode (``KVLAB_QUICK=1``), so a quick run never replaces
    the full figures."""
    root = os.environ.get("KVLAB_FIGURES_DIR")
    return (Path(root) if root is not None else figures_root(os.environ.get("KVLAB_QUICK") == "1")) / notebook


def caption(finding: str, *, config: Mapping[str, Any] | None = None, workload: Any = None,
            run_ids: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """A figure's caption record: the one-line ``finding``, the hash of the ``config`` that produced it
    (:func:`kvlab.results.config_hash`, as run manifests record it), the trace it read (``workload``: a kvlab
    Workload; its source, content sha256 and file sha256), the ``run_ids`` of experiment runs drawn, and any ``extra``
    fields (e.g. ``quick=True``). :func:`caption_markdown` renders it for the cell under the figure."""
    from kvlab.results import config_hash

    out: dict[str, Any] = {"finding": finding}
    if config is not None:
        out["config"] = dict(config)
        out["config_hash"] = config_hash(dict(config))
    if workload is not None:
        ident = workload.identity()
        out["trace"] = {"source": str(workload.source), "content_sha256": ident.get("content_sha256"),
                        "file_sha256": ident.get("file_sha256"), "requests": len(workload)}
    if run_ids is not None:
        out["run_ids"] = list(run_ids)
    out.update(extra)
    return out


def caption_markdown(record: Mapping[str, Any]) -> str:
    """The caption as Markdown: the finding, then config hash, trace (name, sha256 prefix) and run count."""
    parts = [str(record.get("finding", ""))]
    facts = []
    if "config_hash" in record:
        facts.append(f"config `{record['config_hash']}`")
    trace = record.get("trace")
    if trace:
        sha = trace.get("file_sha256") or trace.get("content_sha256") or ""
        facts.append(f"trace `{Path(str(trace.get('source', ''))).name}` (sha256 `{str(sha)[:12]}`, "
                     f"{trace.get('requests', '?'):,} requests)")
    if record.get("run_ids"):
        facts.append(f"{len(record['run_ids'])} runs")
    if facts:
        parts.append("*Source:* " + "; ".join(facts) + ".")
    return "\n\n".join(p for p in parts if p)


def save_names(name: str, *, data: bool = True, caption: bool = True) -> list[str]:
    """The file names :func:`save` writes for figure ``name``: ``name.png``, ``name.pdf``, and ``name.parquet`` /
    ``name.json`` with ``data`` / ``caption``. A command checks them (:func:`kvlab.results.owned.check_folder`'s
    ``names``) before its work starts."""
    return [f"{name}.{s}" for s, on in (("png", True), ("pdf", True), ("parquet", data), ("json", caption)) if on]


def prepare_figure_folder(folder: str | os.PathLike, *, flag: str | None = None,
                          names: list[str] | tuple[str, ...] = ()) -> Path:
    """Make ``folder`` an owned output folder (:mod:`kvlab.results.owned`) and return it absolute: each folder on
    the way that does not exist yet is created with a listing, top down (so ``results/figures`` created by a
    notebook's first figure is as much kvlab's as the notebook's folder). Refused (ResultsLocationError, one line,
    nothing created): a symbolic link, a file, a non-empty folder kvlab did not write, an edited listed file, an
    existing ``names`` file kvlab did not write."""
    from kvlab.results.owned import check_folder, prepare_folder

    folder = check_folder(folder, flag=flag, names=names)
    missing = []
    step = folder
    while not step.exists() and step != step.parent:
        missing.append(step)
        step = step.parent
    for path in reversed(missing):
        prepare_folder(path, flag=flag)
    return prepare_folder(folder, flag=flag, names=names)


def save(fig: Figure, folder: str | os.PathLike, name: str, data: pd.DataFrame | None = None,
         caption: Mapping[str, Any] | None = None, *, dpi: int = DPI) -> list[Path]:
    """Write ``fig`` as ``folder/name.png`` (``dpi``) and ``.pdf`` at its true size (``bbox_inches="tight"``,
    :data:`SAVE_PAD` margin), ``data`` as ``name.parquet`` and ``caption`` as ``name.json``; returns the paths
    written. Same data, same parquet bytes.

    The figure's layout problems (:func:`layout_problems`: legend over data, overlapping or clipped text, text
    under 7 pt, wider than 7.2 in, two series alike) are recorded, never raised (a notebook still finishes): in
    the caption as ``"layout_problems"`` (a list, empty when the layout is clean) and in :data:`last_problems`.

    Every file is an owned output (docs/plots.md, "Owned outputs"): written atomically and recorded in
    ``folder``'s listing (:func:`kvlab.results.owned.write_owned`). Before anything is written, ``folder`` and
    the four names are checked (:func:`prepare_figure_folder`): a file kvlab did not write, or one it wrote and
    somebody changed since, is refused with one line (ResultsLocationError) and nothing is replaced; the writes
    then skip the folder check (``prepared``) and check only their own file."""
    from kvlab.results.owned import write_owned

    global last_problems
    given = Path(folder)
    folder = prepare_figure_folder(given, names=save_names(name, data=data is not None, caption=caption is not None))
    last_problems = layout_problems(fig)
    paths = []
    for fmt in ("png", "pdf"):
        metadata = {"Software": None} if fmt == "png" else {"Creator": None, "Producer": None, "CreationDate": None}
        write_owned(folder / f"{name}.{fmt}", lambda p, fmt=fmt, md=metadata: fig.savefig(
            p, dpi=dpi, format=fmt, bbox_inches="tight", pad_inches=SAVE_PAD, metadata=md), prepared=True)
        paths.append(given / f"{name}.{fmt}")
    if data is not None:
        frame = data.reset_index(drop=True)
        frame.attrs = {}
        write_owned(folder / f"{name}.parquet", lambda p: frame.to_parquet(p, index=False), prepared=True)
        paths.append(given / f"{name}.parquet")
    if caption is not None:
        record = {**dict(caption), "layout_problems": list(last_problems)}
        text = json.dumps(record, indent=2, sort_keys=True, default=str) + "\n"
        write_owned(folder / f"{name}.json", lambda p: Path(p).write_text(text), prepared=True)
        paths.append(given / f"{name}.json")
    return paths


__all__ = ["BASELINE", "COLUMN", "DOUBLE", "DPI", "LINESTYLES", "MARKERS", "MAX_SERIES", "MAX_WIDTH", "MIN_FONT_PT",
           "PALETTE", "POLICY_STYLES", "REST_COLOR", "SAVE_PAD", "SINGLE", "WIDE", "apply", "baseline_style",
           "caption", "caption_markdown", "figure", "figure_folder", "figures_root", "last_problems",
           "layout_problems", "policy_style", "prepare_figure_folder", "save", "save_names", "series_style",
           "set_title"]
