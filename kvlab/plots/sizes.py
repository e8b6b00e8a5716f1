"""The print limits every saved figure keeps, in one place: :mod:`kvlab.plots.style` draws and saves within
them and :mod:`kvlab.plots.layout_check` checks them (both import them from here; ``style`` publishes them as
``kvlab.plots.style.MAX_WIDTH`` etc.).

Units: inches for widths and margins, pt at print size for fonts.
"""

from __future__ import annotations

#: no saved figure is wider than this (inches): the full text width of a two-column paper
MAX_WIDTH = 7.2
#: no text of a saved figure is smaller than this (pt at print size)
MIN_FONT_PT = 7.0
#: white margin around a saved figure (inches; matplotlib's default is 0.1)
SAVE_PAD = 0.02

__all__ = ["MAX_WIDTH", "MIN_FONT_PT", "SAVE_PAD"]
