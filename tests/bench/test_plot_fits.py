"""Every text of every plot stays inside its figure, with the longest provider list a sweep can
have (every provider of every kernel, several geometries, a CPU run's long title): headlines
that do not fit a title go into the legend."""

from __future__ import annotations

import pytest

from paged_video.bench.providers import PROVIDERS
from tests.bench.rows import STEADY_CEILINGS, measured

pytest.importorskip("matplotlib")


def _every_provider_rows(**overrides: object) -> list[dict]:
    rows = [*STEADY_CEILINGS]
    for block in (8, 16, 64, 520, 1560):
        for index, provider in enumerate(PROVIDERS):
            if provider.role == "oracle":
                continue
            role = provider.role
            time = 2.0 + 0.1 * index + (0.5 if role == "quantized" else 0.0)
            rows.append(
                measured(provider.kernel, provider.name, block, time, role=role, **overrides)
            )
    return rows


def _texts_outside(figure) -> list[str]:
    """The drawn texts whose window extent leaves ``figure``: titles, legends, labels, and each
    axis's tick labels (those drawn: ticks outside the view are not)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    ticks = {id(t) for ax in figure.axes for t in ax.get_xticklabels(which="both")}
    ticks |= {id(t) for ax in figure.axes for t in ax.get_yticklabels(which="both")}
    boxes = [
        (repr(text.get_text()), text.get_window_extent(renderer))
        for text in figure.findobj(Text)
        if text.get_visible() and text.get_text().strip() and id(text) not in ticks
    ]
    for ax in figure.axes:
        if ax.get_visible():
            boxes += [
                (f"{name} tick labels", axis.get_tightbbox(renderer))
                for name, axis in (("x", ax.xaxis), ("y", ax.yaxis))
            ]
    bounds = figure.bbox
    return [
        f"{name} at {box.extents.round(1)} of {bounds.extents}"
        for name, box in boxes
        if box is not None
        and (
            box.x0 < bounds.x0 - 1
            or box.y0 < bounds.y0 - 1
            or box.x1 > bounds.x1 + 1
            or box.y1 > bounds.y1 + 1
        )
    ]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"figures": "cpu-interpreter", "device": "cpu", "noise": "noisy"},
        {"heads": 4, "kv_heads": 2, "figures": "cpu-interpreter", "device": "cpu"},
    ],
    ids=["gpu", "cpu-noisy", "cpu-gqa"],
)
def test_no_text_leaves_any_plot_with_every_provider(overrides):
    from paged_video.bench.plot import LEGEND_WIDTH, draw_kernel, draw_speedup

    rows = _every_provider_rows(**overrides)
    if overrides.get("heads"):  # two geometries: every line names its own
        rows += _every_provider_rows(figures="cpu-interpreter", device="cpu")[4:]
    figures = {"speedup": draw_speedup(rows)}
    for kernel in dict.fromkeys(p.kernel for p in PROVIDERS):
        figures[kernel] = draw_kernel(rows, kernel)
    quantized = figures["speedup"].axes[1]
    labels = [line.get_label() for line in quantized.get_lines()]
    assert any("triton-k8v16" in label and "x at B=1560" in label for label in labels), labels
    for name, figure in figures.items():
        assert not _texts_outside(figure), (name, _texts_outside(figure))
        # Legend entries are wrapped to LEGEND_WIDTH: with few providers a long unwrapped one
        # may still fit a wide figure, so the width is held too.
        for ax in figure.axes:
            legend = ax.get_legend()
            for text in legend.get_texts() if legend else ():
                lines = text.get_text().split("\n")
                assert max(map(len, lines)) <= LEGEND_WIDTH, (name, text.get_text())


def test_the_check_sees_a_title_cut_off():
    from matplotlib.figure import Figure

    figure = Figure(figsize=(3.0, 2.0), layout="constrained")
    figure.subplots().set_title("a headline far too long for a figure three inches wide " * 2)
    assert _texts_outside(figure)
