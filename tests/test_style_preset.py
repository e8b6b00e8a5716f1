"""The paper preset of kvlab.plots.style (print sizes, fonts >= 7 pt, one look per policy that survives
greyscale) and the layout checks (kvlab.plots.layout_check): each problem kind is caught on a figure built to
have it, and a clean figure gives none, so the checks can fail."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvlab.plots import style  # noqa: E402
from kvlab.plots.layout_check import layout_problems  # noqa: E402
from kvlab.policies import available_policies  # noqa: E402

BASELINES = ["infinite cache", "belady", "flop ideal"]


@pytest.fixture(autouse=True)
def _restore_rc():
    """style.figure() makes the preset matplotlib's default; keep other tests' defaults as they were."""
    with matplotlib.rc_context():
        yield
    plt.close("all")


def _grey(key):
    marker, linestyle = key
    return marker, str(linestyle)


# ------------------------------------------------------------------------------------------------ the preset
def test_every_registered_policy_and_baseline_has_its_own_fixed_style():
    from kvlab.policies.base import _REGISTRY

    # kvlab's own policies: a test (tests/test_replay.py's test-mru) may register a plugin in the same process
    builtin = {n for n in available_policies() if getattr(_REGISTRY[n], "__module__", "").startswith("kvlab.")}
    names = sorted(builtin | set(BASELINES))
    assert set(names) <= set(style.POLICY_STYLES), "a registered policy has no fixed style"
    looks = {n: style.policy_style(n) for n in names}
    triples = [(s["color"], s["marker"], str(s["linestyle"])) for s in looks.values()]
    assert len(set(triples)) == len(triples)
    for (a, sa), (b, sb) in itertools.combinations(looks.items(), 2):  # greyscale: marker or dash differs
        assert _grey((sa["marker"], sa["linestyle"])) != _grey((sb["marker"], sb["linestyle"])), (a, b)
    colours = {s["color"].upper() for s in looks.values()}
    assert "#F0E442" not in colours  # Okabe-Ito's yellow: too pale for a line on white
    assert colours <= {c.upper() for c in style.PALETTE}
    assert looks["lru"]["color"] == "#0072B2"  # LRU stays blue, as in the notebooks
    assert style.policy_style(" LRU ") == looks["lru"]
    for name in BASELINES:
        assert looks[name]["color"] == "#000000" and looks[name]["marker"] == ""
        assert looks[name]["linestyle"] == style.baseline_style(name)["linestyle"]


def test_the_docs_table_of_policy_looks_matches_the_map():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "plots.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| [a-z ]+ `(#[0-9A-F]{6})` \| (?:`([^`]+)`|none) \| ([^|]+) \|$", doc, re.M)
    dashes = {"-": "solid", "--": "dashed", ":": "dotted"}
    documented = {name: (colour, marker, line.strip()) for name, colour, marker, line in rows}
    expected = {name: (c, m, dashes[ls] if isinstance(ls, str) else f"dashes {ls[1]}")
                for name, (c, m, ls) in style.POLICY_STYLES.items()}
    assert documented == expected


def test_an_unregistered_policy_gets_a_stable_style_no_registered_policy_uses():
    taken = {_grey((s[1], s[2])) for s in style.POLICY_STYLES.values()}
    for name in ("my-policy", "lru-with-twist", "x"):
        look = style.policy_style(name)
        assert look == style.policy_style(name)
        assert _grey((look["marker"], look["linestyle"])) not in taken
        assert look["color"].upper() != "#F0E442"


def test_series_style_first_eight_differ_by_colour_and_by_marker():
    looks = [style.series_style(i) for i in range(style.MAX_SERIES)]
    assert len({s["color"] for s in looks}) == style.MAX_SERIES
    assert len({s["marker"] for s in looks}) == style.MAX_SERIES
    assert "#F0E442" not in {s["color"].upper() for s in looks}
    assert style.series_style(0) != style.series_style(8)


def test_print_sizes_and_figure():
    assert 3.3 <= style.COLUMN[0] <= 3.5 and 7.0 <= style.DOUBLE[0] <= 7.2
    assert style.MAX_WIDTH == 7.2 and style.MAX_SERIES == 8
    assert style.SINGLE == style.COLUMN and style.WIDE == style.DOUBLE
    fig, axes = style.figure("double", 1, 2)
    assert tuple(fig.get_size_inches()) == pytest.approx(style.DOUBLE) and len(axes) == 2
    fig, ax = style.figure("column", 2, 1, height=4.0, sharex=True)
    assert tuple(fig.get_size_inches()) == pytest.approx((style.COLUMN[0], 4.0))
    with pytest.raises(ValueError, match="column"):
        style.figure("page")
    with pytest.raises(ValueError, match="positive"):
        style.figure("column", height=0)


def test_every_font_of_the_preset_is_at_least_7_pt():
    sizes = {k: v for k, v in style.RC.items() if k == "font.size" or k.endswith(("titlesize", "labelsize",
                                                                                  "fontsize"))}
    assert {"font.size", "xtick.labelsize", "ytick.labelsize", "legend.fontsize", "axes.titlesize"} <= set(sizes)
    assert all(float(v) >= style.MIN_FONT_PT == 7.0 for v in sizes.values()), sizes


# ----------------------------------------------------------------------------------------- a clean figure
def _clean_figure():
    """Two panels at double width: four policies with bands and a baseline, labels, titles, a suptitle,
    legends where there is room; stacked bars with the legend outside in a second figure row."""
    fig, axes = style.figure("double", 1, 2)
    x = np.array([1, 2, 4, 8, 16, 32])
    for ax, title in zip(axes, ("trace A", "trace B"), strict=True):
        for i, name in enumerate(["lru", "arc", "s3fifo", "lfu"]):
            y = 0.1 + 0.1 * i + 0.02 * np.log2(x)
            ax.plot(x, y, label=name, **style.policy_style(name))
            style.band(ax, x, y - 0.01, y + 0.01, style.policy_style(name)["color"])
        ax.axhline(0.95, label="infinite cache", **style.baseline_style("infinite cache"))
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.3)
        ax.set_xlabel("capacity (GiB)")
        ax.set_ylabel("token hit rate")
        ax.set_title(title)
    axes[0].legend(loc="upper left", ncol=3)
    fig.suptitle("hit rate against capacity")
    return fig


def _clean_bars():
    fig, ax = style.figure("column")
    bottom = np.zeros(3)
    for i, tier in enumerate(["device", "dram", "ssd"]):
        share = np.array([0.5, 0.3, 0.2]) / (i + 1)
        ax.bar(["a", "b", "c"], share, bottom=bottom, color=style.tier_color(tier, i), label=tier)
        bottom += share
    ax.set_ylim(0, 1.6)
    ax.set_ylabel("share of hits")
    ax.legend(loc="upper center", ncol=3)
    return fig


def test_a_clean_figure_has_no_layout_problems():
    assert layout_problems(_clean_figure()) == []
    assert layout_problems(_clean_bars()) == []
    assert style.layout_problems is layout_problems  # re-exported


# ---------------------------------------------------------------------------------------- each problem kind
def test_legend_over_a_line_and_over_bars_is_caught_and_a_translucent_band_is_not():
    fig, ax = style.figure("column")
    x = np.linspace(0, 1, 50)
    ax.plot(x, x, label="lru", **style.policy_style("lru"))
    ax.legend(loc="center")
    assert any("legend covers line 'lru'" in p for p in layout_problems(fig))

    fig, ax = style.figure("column")
    ax.bar(["a", "b", "c"], [1, 1, 1], label="device")
    ax.legend(loc="center")
    assert any("legend covers a bar" in p for p in layout_problems(fig))

    fig, ax = style.figure("column")
    ax.plot([0, 0.2], [0.9, 1.0], label="lru", **style.policy_style("lru"))
    style.band(ax, [0, 1], [0, 0], [1, 1], style.PALETTE[0])  # a translucent band under the legend
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    assert layout_problems(fig) == []


def test_a_legend_outside_its_panel_over_the_neighbours_data_is_caught():
    fig, (left, right) = plt.subplots(1, 2, figsize=style.DOUBLE)  # no constrained layout to make room
    x = np.linspace(0, 1, 20)
    left.plot(x, x, label="lru", **style.policy_style("lru"))
    right.plot(x, np.full_like(x, 0.5), label="arc", **style.policy_style("arc"))
    left.legend(loc="center left", bbox_to_anchor=(1.3, 0.5))
    assert any("covers line 'arc' of panel 2" in p for p in layout_problems(fig))


def test_overlapping_tick_labels_are_caught():
    fig, ax = style.figure("column")
    ticks = [16384, 32768, 65536, 131072, 262144, 524288, 1048576]
    ax.plot(ticks, range(len(ticks)), **style.series_style(0))
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
    problems = layout_problems(fig)
    assert any("x tick labels overlap" in p for p in problems), problems
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks[::3], [f"{t // 1024:,}k" for t in ticks[::3]])
    assert layout_problems(fig) == []


def test_slanted_tick_labels_are_judged_by_their_own_rectangles():
    from kvlab.plots.layout_check import _overlap

    def slanted(n):
        fig, ax = style.figure("column")
        ax.plot(range(n), range(n), **style.series_style(0))
        ax.set_xticks(range(n), [f"{1048576 + k * 100000:,}" for k in range(n)], rotation=45, ha="right",
                      rotation_mode="anchor")
        return fig, ax

    fig, ax = slanted(12)
    assert layout_problems(fig) == []  # the slanted texts keep apart ...
    first, second = (t.get_window_extent() for t in ax.get_xticklabels()[:2])
    assert _overlap(first, second)  # ... though their upright bounding boxes overlap
    fig, ax = slanted(30)
    problems = layout_problems(fig)
    assert any("x tick labels overlap ('1,048,576' and '1,148,576')" in p for p in problems), problems


def test_a_title_and_tick_labels_running_into_the_neighbour_panel_are_caught():
    fig, (top, bottom) = plt.subplots(2, 1, figsize=style.COLUMN)
    fig.subplots_adjust(hspace=0.05)
    for ax, title in ((top, "upper panel"), (bottom, "lower panel: the title runs under the ticks above")):
        ax.plot([0, 1], [0, 1], **style.series_style(0))
        ax.set_title(title, fontsize=8)
        ax.tick_params(labelsize=7)
    problems = layout_problems(fig)
    assert any(p.startswith("panel 'upper panel' x tick label") and "the plot area of panel 'lower panel" in p
               for p in problems), problems
    assert any("title 'lower panel" in p and "lies over the plot area of panel 'upper panel'" in p
               for p in problems), problems
    fig.subplots_adjust(hspace=0.6)
    assert layout_problems(fig) == []


def test_text_over_other_text_is_caught():
    fig, ax = style.figure("column")
    ax.plot([0, 1], [0, 1], **style.series_style(0))
    ax.set_title("hit rate by capacity")
    fig.canvas.draw()
    box = ax.title.get_window_extent().transformed(fig.transFigure.inverted())
    fig.suptitle("a suptitle placed on the title", y=(box.y0 + box.y1) / 2, va="center", in_layout=False)
    problems = layout_problems(fig)
    assert any("title 'hit rate by capacity' overlaps figure suptitle" in p for p in problems), problems


def test_text_cut_by_the_figure_edge_or_clipped_by_its_axes_is_caught():
    fig, ax = style.figure("column")
    ax.plot([0, 1], [0, 1], **style.series_style(0))
    outside = fig.text(1.5, 0.5, "lost note")
    outside.set_in_layout(False)  # not counted by the tight bounding box the figure is saved with
    ax.text(0.98, 0.5, "cut at the right edge of the axes", clip_on=True)
    problems = layout_problems(fig)
    assert any("figure text 'lost note' is cut by the figure edge" in p for p in problems), problems
    assert any("'cut at the right edge of the axes' is clipped by its axes" in p for p in problems), problems


def test_text_under_7_pt_and_a_figure_wider_than_7_2_in_are_caught():
    fig, ax = plt.subplots(figsize=(9.0, 2.5))
    ax.plot([0, 1], [0, 1], **style.series_style(0))
    ax.set_title("too wide", fontsize=8)
    ax.tick_params(labelsize=6)
    ax.set_ylabel("rate", fontsize=5)
    problems = layout_problems(fig)
    assert any("x tick labels are 6 pt" in p for p in problems), problems
    assert any("y label 'rate' is 5 pt" in p for p in problems), problems
    assert any("wider than 7.2 in" in p for p in problems), problems


def test_a_column_figure_whose_text_spills_past_its_print_width_is_caught():
    fig, ax = style.figure("column")
    ax.plot([0, 1], [0, 1], **style.series_style(0))
    ax.set_xlabel("mean orphan blocks held at 10,000 blocks by every policy of both traces (blocks)")
    problems = layout_problems(fig)
    assert any("drawn at 3.40 in: text spills out of the print width" in p for p in problems), problems

    fig, ax = style.figure("column")
    ax.plot([0, 1], [0, 1], **style.series_style(0))
    ax.set_xlabel("mean orphans (blocks)")
    assert not [p for p in layout_problems(fig) if "spills" in p]


def test_two_series_with_one_style_are_caught_and_unlabelled_rest_lines_are_not():
    fig, ax = style.figure("column")
    ax.plot([0, 1], [0, 0.2], label="lru", **style.policy_style("lru"))
    ax.plot([0, 1], [0.3, 0.5], label="my lru", **style.policy_style("lru"))
    problems = layout_problems(fig)
    assert any("series 'lru' and 'my lru' look the same" in p for p in problems), problems

    fig, ax = style.figure("column")
    ax.plot([0, 1], [0.8, 0.9], label="lru", **style.policy_style("lru"))
    for k in range(5):  # the rest, in one grey, one legend entry
        ax.plot([0, 1], [0.1 * k, 0.1 * k + 0.05], color=style.REST_COLOR, label="others" if k == 0 else "_rest")
    ax.set_ylim(0, 1.4)
    ax.legend(loc="upper left", ncol=2)
    assert layout_problems(fig) == []


# ------------------------------------------------------------------------------------------------ style.save
def test_save_records_the_problems_in_the_caption_and_never_raises(tmp_path):
    fig, ax = style.figure("column")
    ax.plot([0, 1], [0, 1], label="a", **style.series_style(0))
    ax.plot([0, 1], [1, 0], label="b", **style.series_style(0))
    style.save(fig, tmp_path / "nb", "bad", caption={"finding": "x"})
    record = json.loads((tmp_path / "nb" / "bad.json").read_text())
    assert record["layout_problems"] == style.last_problems
    assert any("look the same" in p for p in record["layout_problems"])

    style.save(_clean_bars(), tmp_path / "nb", "good", caption={"finding": "y"})
    assert json.loads((tmp_path / "nb" / "good.json").read_text())["layout_problems"] == []
    assert style.last_problems == []
