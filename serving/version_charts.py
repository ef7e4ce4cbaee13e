"""The model page's last hour per version, from this process's data plane (`metrics.hour_history`; with several
web processes on one port, all of theirs: `serving.dataplane.metrics.process_set`): p50 and
p99 latency per minute of every answer (failures included: a timeout's wait is what its caller saw), the
batch-size histogram, and the answers per minute by kind (served, passed to the fallback, shed, error), as
inline SVG drawn on the server in the style of `usage.chart` and `rollout.charts`.

The gateway here sees every answer it gave (latency, fallbacks, sheds, errors). Batches run where the node is:
in this process only in embedded mode with one web process (its node is in-process, `Node`). With
`serve --workers N` they run in the node host, and in distributed mode on the nodes: the page says so instead of
"0 batches" (Prometheus' `ferry_batch_size` has them). Only numbers and formatted times go into the markup, so
it needs no escaping.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from django.utils.safestring import SafeString, mark_safe

from rollout.charts import histogram_svg
from serving.dataplane import plane as dataplane
from serving.dataplane.metrics import metrics
from serving.dataplane.metrics.history import BATCH_BINS, KINDS, Minute
from serving.dataplane.node.node import Node
from usage import sketch
from usage.chart import _nice

WIDTH, HEIGHT = 760, 200
LEFT, RIGHT, TOP, BOTTOM = 56, 24, 16, 36
P50_COLOUR, P99_COLOUR = "#4a7fb0", "#7a3fbf"
KIND_COLOURS = {"served": "#4a7fb0", "fallback": "#d9822b", "shed": "#c0392b", "error": "#5b2333"}


@dataclass(frozen=True)
class VersionHour:
    answers: int  # answers counted by kind over the hour
    shares: dict[str, float]  # kind -> share of those, in percent (empty when there were none)
    errors: int  # answers other than a 200 (sheds included)
    p50_ms: float | None  # over the whole hour, every answer
    p99_ms: float | None
    batches: int | None  # None: this process runs no batch (they run on the nodes or the node host)
    latency_chart: SafeString
    batch_chart: SafeString
    answers_chart: SafeString


def _slots(minutes: list[Minute], now: datetime, span: int) -> list[tuple[datetime, Minute | None]]:
    """The hour's `span` minutes, oldest first, each with its counts or None."""
    by_start = {m.start: m for m in minutes}
    last = int(now.timestamp() // 60)
    return [
        (datetime.fromtimestamp(start * 60, UTC), by_start.get(start)) for start in range(last - span + 1, last + 1)
    ]


def _frame(css: str, label: str, top_label: str) -> list[str]:
    base = HEIGHT - BOTTOM
    return [
        f'<svg class="{css}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}"'
        f' height="{HEIGHT}" role="img" aria-label="{label}">',
        f'<line x1="{LEFT}" y1="{base}" x2="{WIDTH - RIGHT}" y2="{base}" stroke="#99a"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{base}" stroke="#99a"/>',
        f'<text x="{LEFT - 6}" y="{TOP + 10}" text-anchor="end" font-size="11">{top_label}</text>',
        f'<text x="{LEFT - 6}" y="{base}" text-anchor="end" font-size="11">0</text>',
    ]


def _time_labels(slots: list[tuple[datetime, Minute | None]], slot: float) -> list[str]:
    every = max(1, len(slots) // 6)
    base = HEIGHT - BOTTOM
    return [
        f'<text x="{LEFT + (i + 0.5) * slot:.1f}" y="{base + 16}" text-anchor="middle"'
        f' font-size="11">{start:%H:%M}</text>'
        for i, (start, _) in enumerate(slots)
        if i % every == 0
    ]


def latency_svg(slots: list[tuple[datetime, Minute | None]]) -> str:
    """p50 and p99 of every answer, per minute: two lines, a dot where a minute had answers."""
    points = []
    for start, minute in slots:
        latency = minute.latency if minute is not None else {}
        p50, p99 = sketch.quantile(latency, 0.5), sketch.quantile(latency, 0.99)
        points.append((start, None if p50 is None else p50 * 1000, None if p99 is None else p99 * 1000))
    top = _nice(max((p99 for _, _, p99 in points if p99 is not None), default=0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    base = TOP + plot_h
    slot = plot_w / max(len(points), 1)
    parts = _frame("version-latency", "p50 and p99 latency per minute over the last hour", f"{top:g} ms")
    for css, colour, index in (("p50", P50_COLOUR, 1), ("p99", P99_COLOUR, 2)):
        line = []
        for i, point in enumerate(points):
            value = point[index]
            if value is None:
                continue
            x, y = LEFT + (i + 0.5) * slot, base - plot_h * min(value / top, 1.0)
            line.append(f"{x:.1f},{y:.1f}")
            parts.append(
                f'<circle class="point {css}" cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{colour}">'
                f"<title>{point[0]:%H:%M}: {css} {value:.1f} ms</title></circle>"
            )
        if len(line) > 1:
            parts.append(
                f'<polyline class="{css}" points="{" ".join(line)}" fill="none" stroke="{colour}" stroke-width="2"/>'
            )
    parts += _time_labels(slots, slot)
    parts.append("</svg>")
    return "".join(parts)


def answers_svg(slots: list[tuple[datetime, Minute | None]]) -> str:
    """Answers per minute as stacked bars: served, passed to the fallback, shed, error."""
    counts = [(start, {k: (m.kinds.get(k, 0) if m else 0) for k in KINDS}) for start, m in slots]
    top = _nice(max((sum(c.values()) for _, c in counts), default=0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    base = TOP + plot_h
    slot = plot_w / max(len(counts), 1)
    bar = max(slot * 0.8, 1.0)
    parts = _frame("version-answers", "answers per minute: served, passed to the fallback, shed, error", f"{top:g}")
    for i, (start, by_kind) in enumerate(counts):
        x, y = LEFT + i * slot + (slot - bar) / 2, float(base)
        total = sum(by_kind.values())
        if not total:
            continue
        title = f"{start:%H:%M}: " + ", ".join(f"{n} {kind}" for kind, n in by_kind.items())
        parts.append(f'<g class="minute"><title>{title}</title>')
        for kind, n in by_kind.items():
            h = plot_h * n / top
            y -= h
            if n:
                parts.append(
                    f'<rect class="{kind}" x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{h:.1f}"'
                    f' fill="{KIND_COLOURS[kind]}"/>'
                )
        parts.append("</g>")
    parts += _time_labels(slots, slot)
    parts.append("</svg>")
    return "".join(parts)


def _bin_label(i: int) -> str:
    """Rows of the i-th batch bin: "1", "2", "3-4", ..., "129+" (the last holds the larger batches too)."""
    low = BATCH_BINS[i - 1] + 1 if i else 1
    if i == len(BATCH_BINS) - 1:
        return f"{low}+"
    return str(low) if low == BATCH_BINS[i] else f"{low}-{BATCH_BINS[i]}"


def batches_run_here() -> bool:
    """Whether this process runs batches: its node is in-process (or it has no data plane to say otherwise)."""
    plane = dataplane.current()
    return plane is None or isinstance(plane.node, Node)


def version_hour(model: str, version: int, now: datetime | None = None) -> VersionHour | None:
    """The last hour of `model` `version` in this process; None when it answered nothing and ran no batch."""
    minutes = metrics.hour_history(model, version)
    if not minutes:
        return None
    here = batches_run_here()
    now = now or datetime.now(UTC)
    slots = _slots(minutes, now, 60)
    total = Minute(0)
    for minute in minutes:
        total.add(minute)
    answers = sum(total.kinds.values())
    p50, p99 = sketch.quantile(total.latency, 0.5), sketch.quantile(total.latency, 0.99)
    bins = [(_bin_label(i), total.batches.get(edge, 0)) for i, edge in enumerate(BATCH_BINS)]
    batch_chart = histogram_svg(bins, css="version-batches", label="batches by size, last hour") if here else ""
    return VersionHour(
        answers=answers,
        shares={k: round(100 * total.kinds.get(k, 0) / answers, 1) for k in KINDS} if answers else {},
        errors=total.errors,
        p50_ms=None if p50 is None else round(p50 * 1000, 1),
        p99_ms=None if p99 is None else round(p99 * 1000, 1),
        batches=sum(total.batches.values()) if here else None,
        # Numbers and formatted times only (the module's docstring): nothing to escape.
        latency_chart=mark_safe(latency_svg(slots)),  # noqa: S308
        batch_chart=mark_safe(batch_chart),  # noqa: S308
        answers_chart=mark_safe(answers_svg(slots)),  # noqa: S308
    )
