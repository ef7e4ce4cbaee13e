"""The shadow report's charts as inline SVG drawn on the server, in the style of `usage.chart` (whose axis
rounding they share): agreement per minute as a line, a histogram as bars, two latency distributions as
paired bars. Only numbers and formatted times go into the markup, so it needs no escaping."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from usage.chart import _nice

WIDTH, HEIGHT = 760, 220
LEFT, RIGHT, TOP, BOTTOM = 56, 24, 16, 40
BASELINE_COLOUR, CANDIDATE_COLOUR = "#4a7fb0", "#d9822b"


def _frame(css: str, label: str, top_label: str, bottom_label: str = "0") -> list[str]:
    plot_h = HEIGHT - TOP - BOTTOM
    base = TOP + plot_h
    return [
        f'<svg class="{css}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}"'
        f' height="{HEIGHT}" role="img" aria-label="{label}">',
        f'<line x1="{LEFT}" y1="{base}" x2="{WIDTH - RIGHT}" y2="{base}" stroke="#99a"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{base}" stroke="#99a"/>',
        f'<text x="{LEFT - 6}" y="{TOP + 10}" text-anchor="end" font-size="11">{top_label}</text>',
        f'<text x="{LEFT - 6}" y="{base}" text-anchor="end" font-size="11">{bottom_label}</text>',
    ]


def agreement_svg(points: Sequence[tuple[datetime, float | None, int]]) -> str:
    """Agreement (0 to 1) per minute: a line through the minutes that compared anything, a dot at each."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    base = TOP + plot_h
    parts = _frame("shadow-agreement", "agreement between the versions per minute", "100%")
    slot = plot_w / max(len(points), 1)
    line: list[str] = []
    labels_every = max(1, len(points) // 8)
    for i, (minute, share, compared) in enumerate(points):
        x = LEFT + (i + 0.5) * slot
        if share is not None:
            y = base - plot_h * share
            line.append(f"{x:.1f},{y:.1f}")
            parts.append(
                f'<circle class="point" cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{BASELINE_COLOUR}">'
                f"<title>{minute:%H:%M}: {share:.1%} of {compared} rows agree</title></circle>"
            )
        if i % labels_every == 0:
            parts.append(f'<text x="{x:.1f}" y="{base + 16}" text-anchor="middle" font-size="11">{minute:%H:%M}</text>')
    if line:
        parts.append(
            f'<polyline class="agreement" points="{" ".join(line)}" fill="none" stroke="{BASELINE_COLOUR}"'
            ' stroke-width="2"/>'
        )
    parts.append("</svg>")
    return "".join(parts)


def histogram_svg(bins: Sequence[tuple[str, int]], *, css: str, label: str, colour: str = BASELINE_COLOUR) -> str:
    """Bars, one per bin, labelled below (every few when there are many)."""
    return paired_svg(
        [(name, count, None) for name, count in bins],
        css=css,
        label=label,
        colours=(colour, colour),
        names=("rows", "rows"),
    )


def paired_svg(
    bins: Sequence[tuple[str, int, int | None]],
    *,
    css: str,
    label: str,
    colours: tuple[str, str] = (BASELINE_COLOUR, CANDIDATE_COLOUR),
    names: tuple[str, str] = ("baseline", "candidate"),
) -> str:
    """One or two bars per bin (the second None draws one): two distributions over the same bins."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    base = TOP + plot_h
    top = _nice(max((max(a, b or 0) for _, a, b in bins), default=0))
    parts = _frame(css, label, f"{top:g}")
    slot = plot_w / max(len(bins), 1)
    paired = any(b is not None for _, _, b in bins)
    width = max(slot * (0.4 if paired else 0.8), 1.0)
    labels_every = max(1, len(bins) // 8)
    for i, (name, a, b) in enumerate(bins):
        x = LEFT + i * slot + (slot - width * (2 if paired else 1)) / 2
        for j, (count, colour, who) in enumerate(((a, colours[0], names[0]), (b, colours[1], names[1]))):
            if count is None:
                continue
            h = plot_h * count / top
            parts.append(
                f'<rect class="bar {who}" x="{x + j * width:.1f}" y="{base - h:.1f}" width="{width:.1f}"'
                f' height="{h:.1f}" fill="{colour}"><title>{name}: {count} ({who})</title></rect>'
            )
        if i % labels_every == 0:
            parts.append(
                f'<text x="{LEFT + (i + 0.5) * slot:.1f}" y="{base + 16}" text-anchor="middle"'
                f' font-size="10">{name}</text>'
            )
    parts.append("</svg>")
    return "".join(parts)


def number(value: float) -> str:
    """A bin edge, short: 0.0001, 0.05, 1.2, 340."""
    if value == 0:
        return "0"
    if value < 0.01:
        return f"{value:.0e}"
    return f"{value:.3g}"
