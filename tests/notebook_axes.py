"""Run a notebook script and record, for every figure it saves, what each axis shows.

``python tests/notebook_axes.py NOTEBOOK.py`` runs the script as ``__main__`` with
``Figure.savefig`` wrapped: before each save it records, per axes, both axes' scale, the span of
the data drawn in data coordinates (lines, scatter points, bars) and whether the axis is an
index axis (integer or explicitly placed ticks: frames, block ids, forwards), and writes the
records to the JSON file named by ``AXES_JSON`` when the script ends. ``tests/test_notebooks.py``
reads them.
"""

from __future__ import annotations

import json
import math
import os
import runpy
import sys

from matplotlib.collections import PathCollection
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FixedLocator, MaxNLocator


def _data(ax) -> dict[str, list[float]]:
    """The values drawn in data coordinates along x and along y."""
    values: dict[str, list[float]] = {"x": [], "y": []}
    for line in ax.get_lines():
        transform = line.get_transform()
        if transform in (ax.transData, ax.get_xaxis_transform()):
            values["x"] += [float(v) for v in line.get_xdata()]
        if transform in (ax.transData, ax.get_yaxis_transform()):
            values["y"] += [float(v) for v in line.get_ydata()]
    for collection in ax.collections:
        if isinstance(collection, PathCollection):
            for x, y in collection.get_offsets():
                values["x"].append(float(x))
                values["y"].append(float(y))
    for patch in ax.patches:
        if isinstance(patch, Rectangle) and patch.get_transform() == ax.transData:
            values["y"].append(float(patch.get_y() + patch.get_height()))
    return values


def _index_axis(axis) -> bool:
    locator = axis.get_major_locator()
    return isinstance(locator, FixedLocator) or (
        isinstance(locator, MaxNLocator) and locator._integer
    )


def describe(figure: Figure) -> list[dict[str, object]]:
    """Per axes (colour bars left out): title, and per axis its scale, data span, index-ness."""
    described = []
    for ax in figure.axes:
        if hasattr(ax, "_colorbar"):
            continue
        data = _data(ax)
        entry: dict[str, object] = {"title": ax.get_title() or ax.get_ylabel()}
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            positive = [v for v in data[name] if v > 0 and math.isfinite(v)]
            span = max(positive) / min(positive) if positive else 1.0
            entry[name] = {
                "scale": axis.get_scale(),
                "span": span,
                "index": _index_axis(axis),
                "label": axis.get_label_text(),
            }
        described.append(entry)
    return described


def main() -> None:
    script = sys.argv[1]
    records: list[dict[str, object]] = []
    save = Figure.savefig

    def recording_savefig(self, fname, *args, **kwargs):
        records.append({"file": os.path.basename(str(fname)), "axes": describe(self)})
        return save(self, fname, *args, **kwargs)

    Figure.savefig = recording_savefig
    sys.argv = [script]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        with open(os.environ["AXES_JSON"], "w") as stream:
            json.dump(records, stream, indent=1)


if __name__ == "__main__":
    main()
