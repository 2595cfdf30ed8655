"""The results of `quantobs compare` as figures (PNG files).

Three plots of a `Comparison` (`report/results.py`), each written to a
path and returned, or None when the comparison holds nothing to plot:

=======================  ==================================================
function                 what it shows
=======================  ==================================================
`plot_layer_sqnr`        per-layer weight SQNR of each observer, one row
                         of subplots per scheme; input SQNR beside it
                         where a scheme quantizes inputs
`plot_quality_vs_time`   the task's main metric (cos mean; next-token KL
                         for a causal LM) against calibration seconds, one
                         marker per scheme, each point labelled with its
                         observer
`plot_worst_layer`       the worst layer's held-out input histogram (log
                         counts) and each observer's range as two lines
=======================  ==================================================

Figures are built on `matplotlib.figure.Figure` and written by the Agg
renderer that `savefig` picks for a `.png`; pyplot is never imported, so no
display is needed, no global figure list grows, and the caller's backend
(a notebook's, say) is left alone, which calling `matplotlib.use` from a
library would not do. An observer keeps one colour across the figures.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from quantobs.report.render import scheme_order
from quantobs.report.results import Cell, Comparison
from quantobs.report.tasks import main_metric

__all__ = [
    "DPI",
    "plot_layer_sqnr",
    "plot_quality_vs_time",
    "plot_worst_layer",
    "short_layer_names",
]

#: Resolution of every figure written.
DPI = 110

_Colour = tuple[float, float, float, float]  # RGBA in [0, 1]

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
_LINESTYLES: tuple[str | tuple[int, tuple[int, ...]], ...] = (
    "--",
    "-.",
    ":",
    (0, (5, 1)),
    (0, (3, 1, 1, 1, 1, 1)),
    (0, (1, 2)),
    (0, (8, 2, 2, 2)),
)


# An infinite SQNR has no y: a triangle at the top (bottom) of the axes.
_INFINITE_MARKS = ((math.inf, 0.97, "^"), (-math.inf, 0.03, "v"))


def _plain(text: str) -> str:
    """`text` shown literally by matplotlib (a `$` would start math)."""
    return text.replace("$", r"\$")


def _observer_styles(comparison: Comparison) -> dict[str, tuple[_Colour, str]]:
    """One (colour, marker) per observer row, stable across the figures."""
    names = [
        *comparison.observers,
        *(cell.observer for cell in comparison.cells),
        *(comparison.histogram.ranges if comparison.histogram else ()),
    ]
    palette = matplotlib.colormaps["tab10"]
    return {
        # the marker changes with each round of the palette: no two of the
        # first palette.N * len(_MARKERS) rows look alike
        name: (
            palette(index % palette.N),
            _MARKERS[(index + index // palette.N) % len(_MARKERS)],
        )
        for index, name in enumerate(dict.fromkeys(names))
    }


def _save(figure: Figure, path: str | os.PathLike[str]) -> Path:
    try:
        figure.savefig(path, dpi=DPI, format="png")
    finally:
        figure.clear()  # drop the artists now rather than at collection
    return Path(path)


def short_layer_names(names: Sequence[str]) -> list[str]:
    """Layer names without the dotted prefix they all share.

    `["encoder.layer.0.attention.self.query", "encoder.layer.1.output.dense"]`
    -> `["0.attention.self.query", "1.output.dense"]`. The last part of a
    name is always kept; a name still longer than 28 characters keeps its
    end, after an ellipsis.
    """
    parts = [name.split(".") for name in names]
    shared = 0
    if parts:
        shortest = min(len(split) for split in parts) - 1  # keep the last part
        while shared < shortest and len({split[shared] for split in parts}) == 1:
            shared += 1
    short = [".".join(split[shared:]) for split in parts]
    return [name if len(name) <= 28 else "…" + name[-27:] for name in short]


# ---------------------------------------------------------------- layer SQNR


def _layers(cells: Sequence[Cell], kind: str) -> list[str]:
    """The layers of `kind` ("weight_sqnr" / "input_sqnr") in first-seen order."""
    names: dict[str, None] = {}
    for cell in cells:
        names.update(dict.fromkeys(getattr(cell, kind)))
    return list(names)


def _plot_sqnr_axes(
    ax: Axes,
    cells: Sequence[Cell],
    kind: str,
    styles: dict[str, tuple[_Colour, str]],
) -> None:
    """One observer line per cell on `ax`: x the layer index, y its SQNR;
    an infinite SQNR is a triangle at the top (bottom for -inf)."""
    layers = _layers(cells, kind)
    positions = range(len(layers))
    infinite: set[str] = set()
    for cell in cells:
        sqnr: dict[str, float] = getattr(cell, kind)
        values = [sqnr.get(layer, math.nan) for layer in layers]
        colour, marker = styles[cell.observer]
        finite = [value if math.isfinite(value) else math.nan for value in values]
        ax.plot(
            positions, finite, marker=marker, markersize=4, linewidth=1.2, color=colour
        )
        for value, y, triangle in _INFINITE_MARKS:
            xs = [x for x, v in zip(positions, values, strict=True) if v == value]
            if xs:
                infinite.add(triangle)
                ax.plot(
                    xs,
                    [y] * len(xs),
                    linestyle="none",
                    marker=triangle,
                    markersize=6,
                    color=colour,
                    transform=ax.get_xaxis_transform(),  # x data, y axes
                    clip_on=False,
                )
    ax.set_xticks(list(positions))
    ax.set_xticklabels(
        [_plain(name) for name in short_layer_names(layers)],
        rotation=90,
        fontsize=7 if len(layers) <= 48 else 5,
    )
    ax.set_xlim(-0.5, len(layers) - 0.5)
    ax.set_ylabel("SQNR (dB)")
    ax.grid(True, alpha=0.3)
    if infinite:
        ax.margins(y=0.15)  # headroom: the triangles and the note above the data
        notes = {"^": "▲ inf: represented exactly", "v": "▼ -inf: zero signal"}
        ax.text(
            0.01,
            0.99,
            "   ".join(notes[mark] for mark in sorted(infinite)),
            transform=ax.transAxes,
            va="top",
            fontsize=7,
        )


def plot_layer_sqnr(
    comparison: Comparison, path: str | os.PathLike[str]
) -> Path | None:
    """Per-layer SQNR of every observer, a row of subplots per scheme.

    Left: the weight SQNR of each quantized layer (x: the layer, in model
    order, named without the prefix all layers share), one line per
    observer. Right, when any scheme quantizes inputs: the input SQNR of
    each layer on the held-out sentences ("no quantized inputs" where the
    scheme has none).

    Args:
        comparison: the results.
        path: the PNG to write.

    Returns:
        `path`, or None when no cell holds a per-layer SQNR.
    """
    schemes = [
        scheme
        for scheme in scheme_order(comparison)
        if any(
            cell.weight_sqnr or cell.input_sqnr for cell in comparison.cells_of(scheme)
        )
    ]
    if not schemes:
        return None
    kinds = [("weight_sqnr", "weight")]
    if any(cell.input_sqnr for cell in comparison.cells):
        kinds.append(("input_sqnr", "input"))
    most_layers = max(
        len(_layers(comparison.cells_of(scheme), kind))
        for scheme in schemes
        for kind, _ in kinds
    )
    width = max(6.0, 1.5 + 0.2 * most_layers)
    figure = Figure(
        figsize=(width * len(kinds), 1.0 + 3.6 * len(schemes)),
        layout="constrained",
    )
    axes = figure.subplots(len(schemes), len(kinds), squeeze=False)
    styles = _observer_styles(comparison)
    for row, scheme in enumerate(schemes):
        cells = comparison.cells_of(scheme)
        for column, (kind, title) in enumerate(kinds):
            ax = axes[row][column]
            ax.set_title(_plain(f"{scheme}: {title} SQNR"), loc="left", fontsize=10)
            if any(getattr(cell, kind) for cell in cells):
                _plot_sqnr_axes(ax, cells, kind, styles)
            else:
                ax.text(0.5, 0.5, f"no quantized {title}s", ha="center", va="center")
                ax.set_axis_off()
    ran = {cell.observer for cell in comparison.cells}
    handles = {
        _plain(observer): Line2D([], [], color=colour, marker=marker, markersize=4)
        for observer, (colour, marker) in styles.items()
        if observer in ran
    }
    figure.legend(
        list(handles.values()),
        list(handles),
        loc="outside upper center",
        ncols=min(len(handles), 8),
        title="observer",
    )
    return _save(figure, path)


# ---------------------------------------------------------------- quality / time


def plot_quality_vs_time(
    comparison: Comparison, path: str | os.PathLike[str]
) -> Path | None:
    """The task's main metric (`quantobs.report.tasks.main_metric`: cos
    mean, or next-token KL for a causal LM) against calibration seconds, one
    point per cell.

    One colour and marker per scheme, each point labelled with its
    observer; the x axis is logarithmic when the times span more than a
    factor of 20.

    Args:
        comparison: the results.
        path: the PNG to write.

    Returns:
        `path`, or None when no cell has finite values to plot.
    """
    metric = main_metric(comparison.task)

    def quality(cell: Cell) -> float:
        value = getattr(cell, metric.key)
        return math.nan if value is None else float(value)

    points = [
        cell
        for cell in comparison.cells
        if math.isfinite(quality(cell)) and math.isfinite(cell.calibration_seconds)
    ]
    if not points:
        return None
    figure = Figure(figsize=(8.0, 5.5), layout="constrained")
    ax = figure.subplots()
    palette = matplotlib.colormaps["tab10"]
    for index, scheme in enumerate(scheme_order(comparison)):
        cells = [cell for cell in points if cell.scheme == scheme]
        if not cells:
            continue
        ax.scatter(
            [cell.calibration_seconds for cell in cells],
            [quality(cell) for cell in cells],
            color=palette(index % palette.N),
            marker=_MARKERS[index % len(_MARKERS)],
            s=36,
            label=_plain(scheme),
            zorder=3,
        )
        for order, cell in enumerate(cells):
            ax.annotate(
                _plain(cell.observer),
                (cell.calibration_seconds, quality(cell)),
                xytext=(5, 3 if order % 2 == 0 else -9),  # alternate: less overlap
                textcoords="offset points",
                fontsize=7,
            )
    seconds = [cell.calibration_seconds for cell in points]
    if min(seconds) > 0 and max(seconds) > 20 * min(seconds):
        ax.set_xscale("log")
    ax.set_xlabel("calibration seconds")
    direction = "lower is better" if metric.lower_is_better else "higher is better"
    ax.set_ylabel(f"{metric.title} (held-out; {direction})")
    ax.set_title("Quality against calibration time", loc="left")
    ax.grid(True, alpha=0.3)
    ax.legend(title="scheme", fontsize=8)
    return _save(figure, path)


# ---------------------------------------------------------------- worst layer


def plot_worst_layer(
    comparison: Comparison, path: str | os.PathLike[str]
) -> Path | None:
    """The worst layer's input histogram and each observer's range.

    Bars: the held-out input values of `comparison.histogram.layer` under
    the unquantized model (log counts). Each observer's chosen range is a
    pair of vertical lines (its low and high) in its colour and line
    style; a range that is not finite is listed in the legend only.

    Args:
        comparison: the results.
        path: the PNG to write.

    Returns:
        `path`, or None when there is no histogram or it counts nothing.

    Raises:
        ValueError: when the histogram's edges are not one more than its
            counts.
    """
    histogram = comparison.histogram
    if histogram is None or sum(histogram.counts) == 0:
        return None
    edges, counts = histogram.edges, histogram.counts
    if len(edges) != len(counts) + 1:
        raise ValueError(
            f"histogram of {histogram.layer!r} has {len(edges)} edges for "
            f"{len(counts)} counts; it needs counts + 1 edges"
        )
    figure = Figure(figsize=(10.0, 5.0), layout="constrained")
    ax = figure.subplots()
    widths = [high - low for low, high in itertools.pairwise(edges)]
    ax.bar(
        edges[:-1],
        counts,
        width=widths,
        align="edge",
        color="0.7",
        log=True,
        label="held-out inputs",
    )
    styles = _observer_styles(comparison)
    shown = [edges[0], edges[-1]]
    for index, (observer, (low, high)) in enumerate(histogram.ranges.items()):
        colour = styles[observer][0]
        style = _LINESTYLES[index % len(_LINESTYLES)]
        label = _plain(f"{observer}  [{low:.4g}, {high:.4g}]")
        finite = [value for value in (low, high) if math.isfinite(value)]
        if not finite:
            ax.plot([], [], color=colour, linestyle=style, label=label)
        for number, value in enumerate(finite):
            ax.axvline(
                value,
                color=colour,
                linestyle=style,
                linewidth=1.5,
                label=label if number == 0 else None,
            )
        shown.extend(finite)
    margin = 0.03 * (max(shown) - min(shown) or 1.0)
    ax.set_xlim(min(shown) - margin, max(shown) + margin)
    ax.set_xlabel("input value")
    ax.set_ylabel("count (log scale)")
    ax.set_title(
        _plain(f"{histogram.scheme}: inputs of {histogram.layer}"),
        loc="left",
        fontsize=10,
    )
    figure.legend(fontsize=8, title="observer range", loc="outside right upper")
    return _save(figure, path)
