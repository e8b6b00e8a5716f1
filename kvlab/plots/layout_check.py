"""Layout checks that can fail: what a reviewer would reject in a figure, found from matplotlib's own bounding
boxes after a draw (:func:`layout_problems`, re-exported as :func:`kvlab.plots.style.layout_problems`).

Each problem is one short line naming the panel (its title, else ``panel <n>``, 1-based in ``fig.axes`` order)
and the text or series concerned. Checked, at the size the figure is saved (:func:`kvlab.plots.style.save`:
``bbox_inches="tight"``, :data:`kvlab.plots.style.SAVE_PAD` margin; the pt size of a font is its print size):

* **legend over data**: a legend's box (inside its axes, or outside over another panel) covers a plotted line
  (its segments, or its markers when it has no line), a marker of a scatter, a bar (a ``Rectangle`` in data
  coordinates), an error bar / ``vlines`` segment, or an opaque filled area (``stackplot``, ``fill_between``
  with alpha >= 0.5). Translucent confidence bands (alpha < 0.5, :func:`kvlab.plots.style.band`) do not count:
  the line they surround does, and a legend over a pale band hides nothing that line does not show. Reference
  lines spanning the axes (``axhline`` / ``axvline``) do not count either: their value stays readable where the
  legend is not. Images are not checked.
* **overlapping tick labels** on one axis (major and minor, drawn and non-empty; slanted text by its rotated
  rectangle, not its larger bounding box).
* **clipped or colliding text**: a title, axis label, tick label, offset text, free text, suptitle or legend
  that overlaps another one (a title over the tick labels of the panel above, a legend over a neighbour's
  labels), that sits inside another panel's plot area, that its clip box cuts, or that falls outside the area
  the figure is saved with.
* **small text**: any drawn text under :data:`kvlab.plots.style.MIN_FONT_PT` (7 pt); and, separately, a saved
  figure wider than :data:`kvlab.plots.style.MAX_WIDTH` (7.2 in: it would be shrunk to fit a page), or more than
  :data:`SPILL_IN` wider than it was drawn (a 3.4 in column figure saved 3.56 in wide because a label spills out
  would be shrunk to the column and print its 7 pt text at 6.5 pt).
* **same style twice**: two labelled lines in one axes with the same colour, marker and dash pattern.
  Unlabelled lines (``_``-prefixed labels, e.g. "the rest" in grey with one legend entry) are exempt.

Overlaps smaller than :data:`TOLERANCE_PX` display pixels (at the figure's dpi) in either direction are ignored.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import Collection, LineCollection, PathCollection
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from matplotlib.transforms import Bbox, BboxBase

from kvlab.plots.sizes import MAX_WIDTH, MIN_FONT_PT, SAVE_PAD

#: overlaps (and cuts) smaller than this many display pixels are rounding, not a problem
TOLERANCE_PX = 1.0
#: a filled area at least this opaque is data a legend must not cover
OPAQUE_ALPHA = 0.5


@dataclass(frozen=True)
class _Item:
    """One drawn text (or a legend's whole box) with its display-space extent."""

    owner: str  # the panel's name, or "figure"
    kind: str  # "title", "x tick label", "legend", ...
    text: str
    box: Bbox
    axis: object | None = None  # the Axis a tick label belongs to (tick labels of one axis: check (b))
    axes: Axes | None = None  # the axes the item belongs to (None: the figure)
    artist: Any = None
    corners: np.ndarray | None = None  # a rotated text's own rectangle (4 x 2, display); None: ``box`` is exact

    def name(self) -> str:
        where = "figure" if self.owner == "figure" else f"panel {self.owner}"
        what = self.kind if self.kind == "legend" else f"{self.kind} {_short(self.text)!r}"
        return f"{where} {what}"


SPILL_IN = 0.1
"""How far (inches) a saved figure may exceed the width it was drawn at (:func:`kvlab.plots.style.figure`'s 3.4 or
7.0 in): the paper widths are 3.3-3.5 in (column) and 7.0-7.2 in (full text width), so more than this would be
shrunk when placed and its text would print below :data:`kvlab.plots.style.MIN_FONT_PT`."""


def layout_problems(fig: Figure) -> list[str]:
    """The layout problems of ``fig`` (module docstring), one short line each, in a stable order; ``[]`` when
    there are none. Draws the figure once (``fig.canvas.draw()``); changes nothing else."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    names = _panel_names(fig)
    problems: list[str] = []
    items = list(_items(fig, renderer, names))
    problems += _legends_over_data(fig, renderer, names)
    problems += _tick_label_overlaps(items)
    problems += _text_collisions(fig, renderer, items, names, SAVE_PAD)
    problems += _small_text(items, MIN_FONT_PT)
    width = fig.get_tightbbox(renderer).width + 2 * SAVE_PAD
    if width > MAX_WIDTH + 0.005:
        problems.append(f"figure is {width:.2f} in wide when saved: wider than {MAX_WIDTH:g} in")
    elif width > fig.get_figwidth() + SPILL_IN:
        problems.append(f"figure is {width:.2f} in wide when saved, drawn at {fig.get_figwidth():.2f} in: text spills "
                        "out of the print width (a column figure would be shrunk below 7 pt)")
    problems += _same_styles(fig, names)
    return problems


# ---------------------------------------------------------------------------------------------------- naming
def _short(text: str, most: int = 40) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= most else text[: most - 1] + "…"


def _all_axes(fig: Figure) -> list[Axes]:
    """Every axes of ``fig``, child axes (secondary axes, insets) after their parent."""
    out: list[Axes] = []
    for ax in fig.axes:
        if ax not in out:
            out.append(ax)
        for child in getattr(ax, "child_axes", []):
            if child not in out:
                out.append(child)
    return out


def _panel_names(fig: Figure) -> dict[Axes, str]:
    """``'title'`` for an axes with a title of its own, ``<n> 'title'`` when several share it, else ``<n>``
    (1-based in ``fig.axes``); a child axes is named after its parent."""
    titles = [next((t for t in (ax.get_title(loc) for loc in ("center", "left", "right")) if t.strip()), "")
              for ax in fig.axes]
    names: dict[Axes, str] = {}
    for i, (ax, title) in enumerate(zip(fig.axes, titles, strict=True), start=1):
        shown = repr(_short(title))
        names[ax] = (shown if titles.count(title) == 1 else f"{i} {shown}") if title else str(i)
        for child in getattr(ax, "child_axes", []):
            names.setdefault(child, names[ax])
    return names


# ------------------------------------------------------------------------------------------- drawn text items
def _drawn(text: Text | None) -> bool:
    return text is not None and text.get_visible() and bool(text.get_text().strip())


def _drawn_tick_labels(ax: Axes) -> Iterator[tuple[str, Any, Text]]:
    for letter, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        if not axis.get_visible():
            continue
        for tick in axis._update_ticks():  # the ticks inside the view limits: those drawn
            for label in (tick.label1, tick.label2):
                if _drawn(label):
                    yield f"{letter} tick label", axis, label


def _axes_texts(ax: Axes) -> Iterator[tuple[str, Any, Text]]:
    for kind, text in (("title", ax.title), ("title", getattr(ax, "_left_title", None)),
                       ("title", getattr(ax, "_right_title", None))):
        if _drawn(text):
            yield kind, None, text
    if ax.axison:
        for kind, text in (("x label", ax.xaxis.label), ("y label", ax.yaxis.label),
                           ("x offset", ax.xaxis.offsetText), ("y offset", ax.yaxis.offsetText)):
            axis = ax.xaxis if kind[0] == "x" else ax.yaxis
            if _drawn(text) and axis.get_visible():
                yield kind, None, text
        yield from _drawn_tick_labels(ax)
    for text in ax.texts:
        if _drawn(text):
            yield "text", None, text


def _items(fig: Figure, renderer: Any, names: dict[Axes, str]) -> Iterator[_Item]:
    """Every drawn text of ``fig`` and every legend as one box (its own texts are inside it)."""
    for ax in _all_axes(fig):
        if not ax.get_visible():
            continue
        owner = names.get(ax, "?")
        for kind, axis, text in _axes_texts(ax):
            yield _Item(owner, kind, text.get_text(), text.get_window_extent(renderer), axis, ax, text,
                        _rotated_corners(text, renderer))
        leg = ax.get_legend()
        if leg is not None and leg.get_visible():
            yield _Item(owner, "legend", "", leg.get_window_extent(renderer), None, ax, leg)
    special = {id(t): kind for kind, t in (("suptitle", getattr(fig, "_suptitle", None)),
                                           ("x label", getattr(fig, "_supxlabel", None)),
                                           ("y label", getattr(fig, "_supylabel", None))) if t is not None}
    for text in fig.texts:  # suptitle and super labels are among them
        if _drawn(text):
            kind = special.get(id(text), "text")
            yield _Item("figure", kind, text.get_text(), text.get_window_extent(renderer), None, None, text,
                        _rotated_corners(text, renderer))
    for leg in fig.legends:
        if leg.get_visible():
            yield _Item("figure", "legend", "", leg.get_window_extent(renderer), None, None, leg)


def _rotated_corners(text: Text, renderer: Any) -> np.ndarray | None:
    """The corners of a text drawn at a slant (not a multiple of 90 degrees): its window extent is then the
    bounding box of a rotated rectangle, larger than the text; None for upright or vertical text."""
    rotation = float(text.get_rotation())
    if min(rotation % 90, 90 - rotation % 90) < 1e-6:
        return None
    centre = text.get_window_extent(renderer)
    text.set_rotation(0)
    try:
        flat = text.get_window_extent(renderer)
    finally:
        text.set_rotation(rotation)
    theta = np.radians(rotation)
    turn = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    half = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]]) * [flat.width / 2, flat.height / 2]
    return half @ turn.T + [(centre.x0 + centre.x1) / 2, (centre.y0 + centre.y1) / 2]


def _box_corners(box: Bbox) -> np.ndarray:
    return np.array([[box.x0, box.y0], [box.x1, box.y0], [box.x1, box.y1], [box.x0, box.y1]])


def _collide(a: _Item, b: _Item | BboxBase, tol: float = TOLERANCE_PX) -> bool:
    """Whether item ``a`` and item (or display box) ``b`` share a region more than ``tol`` pixels deep in every
    direction: bounding boxes, or the rotated rectangles of slanted text (separating-axis test)."""
    b_box, b_corners = (b, None) if isinstance(b, BboxBase) else (b.box, b.corners)
    if a.corners is None and b_corners is None:
        return _overlap(a.box, b_box, tol)
    if not _overlap(a.box, b_box, tol):
        return False
    pa = a.corners if a.corners is not None else _box_corners(a.box)
    pb = b_corners if b_corners is not None else _box_corners(b_box)
    for poly in (pa, pb):
        for edge in np.diff(np.vstack([poly, poly[:1]]), axis=0):
            normal = np.array([-edge[1], edge[0]]) / max(float(np.hypot(*edge)), 1e-12)
            ja, jb = pa @ normal, pb @ normal
            if min(ja.max(), jb.max()) - max(ja.min(), jb.min()) <= tol:
                return False
    return True


def _overlap(a: BboxBase, b: BboxBase, tol: float = TOLERANCE_PX) -> bool:
    """Whether ``a`` and ``b`` share a region more than ``tol`` pixels wide and high."""
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w > tol and h > tol


def _inside(inner: Bbox, outer: Bbox, tol: float = TOLERANCE_PX) -> bool:
    return (inner.x0 >= outer.x0 - tol and inner.x1 <= outer.x1 + tol and inner.y0 >= outer.y0 - tol
            and inner.y1 <= outer.y1 + tol)


# -------------------------------------------------------------------------------------------- (b) tick labels
def _tick_label_overlaps(items: list[_Item]) -> list[str]:
    out = []
    by_axis: dict[int, list[_Item]] = {}
    for item in items:
        if item.axis is not None:
            by_axis.setdefault(id(item.axis), []).append(item)
    for group in by_axis.values():
        for i, a in enumerate(group):
            hit = next((b for b in group[i + 1:] if _collide(a, b)), None)
            if hit is not None:
                out.append(f"panel {a.owner}: {a.kind}s overlap ({_short(a.text)!r} and {_short(hit.text)!r})")
                break  # one line per axis
    return out


# ---------------------------------------------------------------------------------------- (c) text collisions
def _same_panel(a: Axes | None, b: Axes | None) -> bool:
    """``a`` and ``b`` are one panel: the same axes, twins, or one a child of the other."""
    if a is None or b is None:
        return False
    if a is b or b in getattr(a, "child_axes", []) or a in getattr(b, "child_axes", []):
        return True
    return bool(np.allclose(a.get_position().bounds, b.get_position().bounds))


def _text_collisions(fig: Figure, renderer: Any, items: list[_Item], names: dict[Axes, str],
                     pad_in: float) -> list[str]:
    out: list[str] = []
    saved = fig.get_tightbbox(renderer).padded(pad_in).transformed(fig.dpi_scale_trans)
    for item in items:
        if not _inside(item.box, saved):
            out.append(f"{item.name()} is cut by the figure edge")
        artist = item.artist
        clip = artist.get_clip_box() if isinstance(artist, Text) and artist.get_clip_on() else None
        if clip is not None and not _inside(item.box, clip):
            out.append(f"{item.name()} is clipped by its axes")
    reported: set[tuple[int, int]] = set()
    for i, a in enumerate(items):
        for b in items[i + 1:]:
            if a.axis is not None and a.axis is b.axis:
                continue  # tick labels of one axis: _tick_label_overlaps
            key = (id(a.axis or a.artist), id(b.axis or b.artist))  # tick labels: one line per pair of axes
            if key not in reported and _collide(a, b):
                reported.add(key)
                out.append(f"{a.name()} overlaps {b.name()}")
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
    for item in items:
        if isinstance(item.artist, Legend):
            continue  # a legend over a panel is judged by what it covers (_legends_over_data)
        for ax in panels:
            key = (id(item.axis or item.artist), id(ax))  # tick labels: one line per axis and panel
            if key in reported or item.axes is not None and _same_panel(item.axes, ax):
                continue
            if _collide(item, ax.bbox):
                reported.add(key)
                out.append(f"{item.name()} lies over the plot area of panel {names.get(ax, '?')}")
    return out


# ---------------------------------------------------------------------------------------------- (d) font size
def _legend_texts(leg: Legend) -> list[Text]:
    return [t for t in [*leg.get_texts(), leg.get_title()] if _drawn(t)]


def _small_text(items: list[_Item], min_pt: float) -> list[str]:
    """Texts under ``min_pt``: tick labels, offsets and legend texts one line per panel and kind (smallest size),
    other texts one line each."""
    grouped = ("x tick label", "y tick label", "x offset", "y offset", "legend text")
    smallest: dict[tuple[str, str, str], float] = {}
    for item in items:
        texts = _legend_texts(item.artist) if isinstance(item.artist, Legend) else [item.artist]
        for text in texts:
            size = float(text.get_fontsize())
            if size >= min_pt - 1e-9:
                continue
            kind = "legend text" if isinstance(item.artist, Legend) else item.kind
            key = (item.owner, kind, "" if kind in grouped else text.get_text())
            smallest[key] = min(size, smallest.get(key, size))
    out = []
    for (owner, kind, text), size in smallest.items():
        where = "figure" if owner == "figure" else f"panel {owner}"
        what = f"{kind}s are" if kind in grouped else f"{kind} {_short(text)!r} is"
        out.append(f"{where}: {what} {size:g} pt (< {min_pt:g} pt at print size)")
    return out


# ------------------------------------------------------------------------------------------ (a) legend vs data
def _segments_hit(xy: np.ndarray, box: Bbox) -> bool:
    """Whether a polyline through display points ``xy`` (n x 2; non-finite points break it) crosses ``box``."""
    if len(xy) == 0:
        return False
    p0, p1 = xy[:-1], xy[1:]
    ok = np.isfinite(p0).all(axis=1) & np.isfinite(p1).all(axis=1)
    if len(xy) == 1 or not ok.any():
        pts = xy[np.isfinite(xy).all(axis=1)]
        return bool(_points_in(pts, box).any())
    p0, p1 = p0[ok], p1[ok]
    d = p1 - p0
    t0 = np.zeros(len(d))
    t1 = np.ones(len(d))
    alive = np.ones(len(d), dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        for p, q in ((-d[:, 0], p0[:, 0] - box.x0), (d[:, 0], box.x1 - p0[:, 0]),
                     (-d[:, 1], p0[:, 1] - box.y0), (d[:, 1], box.y1 - p0[:, 1])):
            zero = p == 0
            alive &= ~(zero & (q < 0))
            r = q / np.where(zero, 1.0, p)
            t0 = np.where(~zero & (p < 0), np.maximum(t0, r), t0)
            t1 = np.where(~zero & (p > 0), np.minimum(t1, r), t1)
    return bool((alive & (t0 <= t1)).any())


def _points_in(pts: np.ndarray, box: Bbox, reach: float | np.ndarray = 0.0) -> np.ndarray:
    pts = np.asarray(pts, dtype=float).reshape(-1, 2)
    return ((pts[:, 0] >= box.x0 - reach) & (pts[:, 0] <= box.x1 + reach) & (pts[:, 1] >= box.y0 - reach)
            & (pts[:, 1] <= box.y1 + reach))


def _alpha(artist: Any) -> float:
    alpha = artist.get_alpha()
    if alpha is not None:
        return float(alpha)
    if isinstance(artist, Collection):
        faces = artist.get_facecolor()
        if len(faces):
            return float(np.max(np.asarray(faces)[:, 3]))
        return 1.0
    return 1.0


def _label(artist: Any) -> str:
    label = str(artist.get_label() or "")
    return "" if label.startswith("_") else label


def _covered(ax: Axes, box: Bbox, fig: Figure) -> str | None:
    """What of ``ax``'s data lies in display box ``box`` (clipped to ``ax``'s plot area): a description, or None."""
    inter = Bbox.intersection(box, ax.bbox)
    if inter is None or inter.width <= 0 or inter.height <= 0:
        return None
    px_per_pt = fig.dpi / 72.0
    for line in ax.lines:
        if not line.get_visible() or line.get_transform() is not ax.transData:
            continue  # axhline / axvline (axes-spanning reference lines) and decorations
        xy = line.get_transform().transform(np.asarray(line.get_path().vertices, dtype=float))
        drawn_line = line.get_linestyle() not in ("None", "none", " ", "") and line.get_linewidth() > 0
        has_marker = line.get_marker() not in (None, "None", "none", " ", "")
        if drawn_line and _segments_hit(xy, inter):
            return f"line {_label(line)!r}" if _label(line) else "a line"
        if has_marker:
            reach = line.get_markersize() * px_per_pt / 2
            if _points_in(line.get_transform().transform(line.get_xydata()), inter, reach).any():
                return f"markers of {_label(line)!r}" if _label(line) else "markers"
    for patch in ax.patches:
        if (patch.get_visible() and isinstance(patch, Rectangle) and patch.get_data_transform() is ax.transData
                and _alpha(patch) >= OPAQUE_ALPHA and _overlap(patch.get_window_extent(), inter, 0.0)):
            return "a bar"
    for coll in ax.collections:
        if not coll.get_visible():
            continue
        if isinstance(coll, PathCollection) and len(coll.get_offsets()):
            sizes = np.sqrt(np.asarray(coll.get_sizes(), dtype=float)) * px_per_pt / 2 if len(coll.get_sizes()) else 0.0
            pts = coll.get_offset_transform().transform(np.asarray(coll.get_offsets(), dtype=float))
            reach = sizes if np.ndim(sizes) == 0 or len(sizes) == len(pts) else float(np.max(sizes))
            if _points_in(pts, inter, reach).any():
                return f"points of {_label(coll)!r}" if _label(coll) else "scatter points"
            continue
        filled = not isinstance(coll, LineCollection)
        if filled and _alpha(coll) < OPAQUE_ALPHA:
            continue  # a translucent band: the line it surrounds counts
        transform = coll.get_transform()
        for path in coll.get_paths():
            for poly in path.to_polygons(closed_only=False) or [path.vertices]:
                xy = transform.transform(np.asarray(poly, dtype=float))
                if _segments_hit(xy, inter):
                    return f"area {_label(coll)!r}" if _label(coll) else ("an area" if filled else "error bars")
                if filled and len(xy) > 2:
                    from matplotlib.path import Path
                    if Path(xy).contains_point(((inter.x0 + inter.x1) / 2, (inter.y0 + inter.y1) / 2)):
                        return f"area {_label(coll)!r}" if _label(coll) else "an area"
    return None


def _legends_over_data(fig: Figure, renderer: Any, names: dict[Axes, str]) -> list[str]:
    out = []
    legends = [(ax, ax.get_legend()) for ax in _all_axes(fig)] + [(None, leg) for leg in fig.legends]
    for owner_ax, leg in legends:
        if leg is None or not leg.get_visible():
            continue
        box = leg.get_window_extent(renderer).padded(-TOLERANCE_PX)
        for ax in _all_axes(fig):
            if not ax.get_visible():
                continue
            what = _covered(ax, box, fig)
            if what is not None:
                where = "figure legend" if owner_ax is None else f"panel {names.get(owner_ax, '?')}: legend"
                over = "" if owner_ax is not None and _same_panel(owner_ax, ax) else f" of panel {names.get(ax, '?')}"
                out.append(f"{where} covers {what}{over}")
                break
    return out


# ------------------------------------------------------------------------------------------ (e) same style
def _style_key(line: Line2D) -> tuple[str, str, str]:
    dashes = getattr(line, "_unscaled_dash_pattern", None)
    ls = line.get_linestyle()
    pattern = "none" if ls in ("None", "none", " ", "") else str(dashes if dashes is not None else ls)
    marker = line.get_marker()
    marker = "none" if marker in (None, "None", "none", " ", "") else str(marker)
    return to_hex(line.get_color(), keep_alpha=False), marker, pattern


def _same_styles(fig: Figure, names: dict[Axes, str]) -> list[str]:
    out = []
    for ax in _all_axes(fig):
        seen: dict[tuple[str, str, str], str] = {}
        for line in ax.lines:
            label = _label(line)
            if not line.get_visible() or not label:
                continue
            key = _style_key(line)
            if key in seen and seen[key] != label:
                out.append(f"panel {names.get(ax, '?')}: series {_short(seen[key])!r} and {_short(label)!r} "
                           f"look the same (colour {key[0]}, marker {key[1]}, line {line.get_linestyle()})")
            seen.setdefault(key, label)
    return out


__all__ = ["OPAQUE_ALPHA", "TOLERANCE_PX", "layout_problems"]
