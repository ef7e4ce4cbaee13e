"""The console's usage chart as inline SVG, drawn on the server (no script, nothing fetched).

Bars: requests per period, the errors in each bar drawn over it in red. Line: p99 latency on its own
scale at the right. Only numbers and times go into the markup, so it needs no escaping.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

WIDTH, HEIGHT = 760, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 64, 16, 36


@dataclass(frozen=True)
class Point:
    start: datetime
    requests: int
    errors: int
    p99_ms: float | None


def _nice(top: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above `top` (at least 1)."""
    if top <= 1:
        return 1.0
    scale = 1.0
    while scale * 10 < top:
        scale *= 10
    for step in (1, 2, 5):
        if step * scale >= top:
            return step * scale
    return 10 * scale  # scale * 10 >= top, from the loop above


def usage_svg(points: list[Point], *, time_format: str = "%H:%M") -> str:
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    base = TOP + plot_h
    top_requests = _nice(max((p.requests for p in points), default=0))
    top_ms = _nice(max((p.p99_ms or 0 for p in points), default=0))
    slot = plot_w / max(len(points), 1)
    bar = max(slot * 0.8, 1.0)
    parts = [
        f'<svg class="usage-chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}"'
        f' width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="requests, errors and p99 latency per period">',
        f'<line x1="{LEFT}" y1="{base}" x2="{LEFT + plot_w}" y2="{base}" stroke="#99a"/>',
        f'<text x="{LEFT - 6}" y="{TOP + 10}" text-anchor="end" font-size="11">{top_requests:g}</text>',
        f'<text x="{LEFT - 6}" y="{base}" text-anchor="end" font-size="11">0</text>',
        f'<text x="{LEFT + plot_w + 6}" y="{TOP + 10}" font-size="11" fill="#7a3fbf">{top_ms:g} ms</text>',
        f'<text x="{LEFT + plot_w + 6}" y="{base}" font-size="11" fill="#7a3fbf">0 ms</text>',
    ]
    line: list[str] = []
    labels_every = max(1, len(points) // 8)
    for i, p in enumerate(points):
        x = LEFT + i * slot + (slot - bar) / 2
        h = plot_h * p.requests / top_requests
        e = plot_h * p.errors / top_requests
        title = f"{p.start:%Y-%m-%d %H:%M}: {p.requests} requests, {p.errors} errors"
        if p.p99_ms is not None:
            title += f", p99 {p.p99_ms:g} ms"
        parts.append(
            f'<g class="period"><title>{title}</title>'
            f'<rect class="requests" x="{x:.1f}" y="{base - h:.1f}" width="{bar:.1f}" height="{h:.1f}" fill="#4a7fb0"/>'
            f'<rect class="errors" x="{x:.1f}" y="{base - e:.1f}" width="{bar:.1f}" height="{e:.1f}" fill="#c0392b"/>'
            "</g>"
        )
        if p.p99_ms is not None:
            line.append(f"{x + bar / 2:.1f},{base - plot_h * p.p99_ms / top_ms:.1f}")
        if i % labels_every == 0:
            parts.append(
                f'<text x="{x + bar / 2:.1f}" y="{base + 16}" text-anchor="middle" font-size="11">'
                f"{p.start.strftime(time_format)}</text>"
            )
    if line:
        parts.append(f'<polyline class="p99" points="{" ".join(line)}" fill="none" stroke="#7a3fbf" stroke-width="2"/>')
    parts.append("</svg>")
    return "".join(parts)
