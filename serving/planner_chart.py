"""The capacity lab's pictures as inline SVG, drawn on the server from the analytic answer (`sim.planner`): the
architecture path, the p99 budget bar, and p99 and throughput against the request rate with the current point
and any simulated points. Only numbers and fixed labels go into the markup, so nothing needs escaping beyond
what `escape` is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from django.utils.html import escape

from sim.planner import CANARY_WEIGHT, Answer, WhatIf

# --- the architecture path ----------------------------------------------------------------------------------

COLUMNS = ("Clients", "Gateway", "Model servers", "Registry + GPU", "Async")
COL_W, NODE_W, NODE_H, ROW_H, HEAD_H = 152, 136, 50, 62, 22
DIAGRAM_W = COL_W * len(COLUMNS)


@dataclass(frozen=True)
class Node:
    key: str
    column: int
    title: str
    detail: str
    row: int = 0
    dashed: bool = False  # off the hot path


def path_nodes(w: WhatIf, a: Answer) -> list[Node]:
    """What the design holds, column by column: the diagram grows as the inputs ask for more."""
    nodes = [
        Node("clients", 0, "Clients", f"{w.rate:,.0f} req/s"),
        Node("gateway", 1, "Inference gateway", "routes, timeouts"),
    ]
    if w.canary:
        nodes.append(Node("split", 1, "Traffic split", f"{CANARY_WEIGHT:.0%} to the canary", 1))
    row = 0
    if w.batching:
        nodes.append(Node("batcher", 2, "Dynamic batcher", f"{w.batch_window_ms:g} ms, batches of {a.running_batch}"))
        row = 1
    packed = f"{w.models} models packed" if w.models > 1 else ""
    if a.replicas > 1:
        nodes.append(Node("replicas", 2, f"Server replicas x{a.replicas:,}", packed or "load-balanced", row))
    else:
        nodes.append(Node("replicas", 2, "Model server", packed or "one process", row))
    if w.canary:
        nodes.append(Node("registry", 3, "Model registry", f"{a.versions} versions"))
    if w.device == "accelerator":
        count = f"{a.replicas:,} accelerator{'s' if a.replicas > 1 else ''}"
        nodes.append(Node("gpu", 3, "GPU pool", count, 1 if w.canary else 0))
    if w.autoscale or a.replicas > 1:  # the autoscaler reads them; with one fixed server nothing does
        nodes.append(Node("metrics", 4, "Metrics + latency", "p99 per version", row, True))
    if w.canary:
        nodes.append(Node("shadow", 4, "Shadow traffic", "mirrored to the canary", 1 - row, True))
    return nodes


EDGES = (  # (from, to): drawn where both are in the design
    ("clients", "gateway"),
    ("gateway", "split"),
    ("gateway", "batcher"),
    ("split", "batcher"),
    ("batcher", "replicas"),
    ("registry", "replicas"),
    ("replicas", "gpu"),
    ("replicas", "metrics"),
    ("split", "shadow"),
)


def _box(n: Node) -> tuple[float, float]:
    return n.column * COL_W + (COL_W - NODE_W) / 2, HEAD_H + 8 + n.row * ROW_H


def diagram_svg(w: WhatIf, a: Answer) -> str:
    nodes = path_nodes(w, a)
    by_key = {n.key: n for n in nodes}
    edges = list(EDGES)
    if "batcher" not in by_key:  # without a batcher the gateway (or its split) hands requests to the servers
        edges.append(("split" if "split" in by_key else "gateway", "replicas"))
    rows = 1 + max(n.row for n in nodes)
    edges = [(src, dst) for src, dst in edges if src in by_key and dst in by_key]
    long = [e for e in edges if abs(by_key[e[0]].column - by_key[e[1]].column) > 1]
    height = HEAD_H + 8 + rows * ROW_H + 8 * len(long)  # room for the long edges under the boxes
    path = " → ".join(n.title for n in nodes if not n.dashed)
    side = ", ".join(n.title for n in nodes if n.dashed)
    label = f"architecture path: {path}" + (f"; off the hot path: {side}" if side else "")
    parts = [
        f'<svg class="lab-diagram" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {DIAGRAM_W} {height}"'
        f' role="img" aria-label="{escape(label)}" data-nodes="{len(nodes)}">',
        '<defs><marker id="lab-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7"'
        ' orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#5b6577"/></marker></defs>',
    ]
    for i, name in enumerate(COLUMNS):
        parts.append(
            f'<text class="col-head" x="{i * COL_W + COL_W / 2}" y="15" text-anchor="middle">{escape(name)}</text>'
        )
    for src, dst in edges:
        s, d = by_key[src], by_key[dst]
        gutter = height - 4 - 8 * long.index((src, dst)) if (src, dst) in long else 0.0
        (sx, sy), (dx, dy) = _box(s), _box(d)
        dash = ' stroke-dasharray="4 3"' if d.dashed else ""
        if s.column == d.column:  # one above the other
            route = f"M{sx + NODE_W / 2:.1f},{sy + NODE_H:.1f} L{dx + NODE_W / 2:.1f},{dy:.1f}"
        elif abs(s.column - d.column) > 1:  # past the columns between: along the bottom, under their boxes
            x1, x2 = sx + NODE_W / 2 + 12, dx + NODE_W / 2
            route = (
                f"M{x1:.1f},{sy + NODE_H:.1f} L{x1:.1f},{gutter:.1f} L{x2:.1f},{gutter:.1f} L{x2:.1f},{dy + NODE_H:.1f}"
            )
        elif s.column < d.column:
            route = f"M{sx + NODE_W:.1f},{sy + NODE_H / 2:.1f} L{dx:.1f},{dy + NODE_H / 2:.1f}"
        else:  # the registry feeds the servers from the right
            route = f"M{sx:.1f},{sy + NODE_H / 2:.1f} L{dx + NODE_W:.1f},{dy + NODE_H / 2:.1f}"
        parts.append(
            f'<path class="edge" data-edge="{src}-{dst}" d="{route}" fill="none" stroke="#5b6577"'
            f' stroke-width="1.4"{dash} marker-end="url(#lab-arrow)"/>'
        )
    for n in nodes:
        x, y = _box(n)
        dash = ' stroke-dasharray="5 3"' if n.dashed else ""
        parts.append(
            f'<g class="node" data-node="{n.key}"><rect x="{x:.1f}" y="{y:.1f}" width="{NODE_W}" height="{NODE_H}"'
            f' rx="7" fill="{"#f4f6fa" if n.dashed else "#fff"}" stroke="#12324a" stroke-width="1.3"{dash}/>'
            f'<text x="{x + NODE_W / 2:.1f}" y="{y + 20:.1f}" text-anchor="middle" class="node-title">'
            f"{escape(n.title)}</text>"
            f'<text x="{x + NODE_W / 2:.1f}" y="{y + 37:.1f}" text-anchor="middle" class="node-detail">'
            f"{escape(n.detail)}</text></g>"
        )
    parts.append("</svg>")
    return "".join(parts)


# --- the p99 budget bar -------------------------------------------------------------------------------------

BAR_W, BAR_H = 720, 30
SEGMENTS = (  # (answer field, label, colour)
    ("compute_ms", "compute", "#4a7fb0"),
    ("window_ms", "batch window", "#d9822b"),
    ("turn_ms", "waiting for a turn", "#8e6bb8"),
    ("queue_ms", "queueing", "#c4493f"),
)


def budget_parts(a: Answer) -> list[dict[str, Any]]:
    return [{"key": k, "label": label, "ms": getattr(a, k), "colour": c} for k, label, c in SEGMENTS]


def budget_svg(w: WhatIf, a: Answer) -> str:
    """p99 split into its parts against the target (the dashed line); past saturation, queueing is unbounded."""
    parts_ = budget_parts(a)
    finite = [p["ms"] for p in parts_ if math.isfinite(p["ms"])]
    unbounded = not math.isfinite(a.p99_ms)
    scale_ms = max(w.p99_ms, sum(finite)) * (1.25 if unbounded else 1.0)
    px = BAR_W / scale_ms
    out = [
        f'<svg class="lab-budget" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {BAR_W} {BAR_H + 16}" role="img"'
        f' aria-label="p99 budget: {escape(_budget_label(a, w))}">'
    ]
    x = 0.0
    for p in parts_:
        ms = p["ms"]
        width = (BAR_W - x) if not math.isfinite(ms) else ms * px
        if width <= 0:
            continue
        out.append(
            f'<rect class="seg" data-part="{p["key"]}" x="{x:.1f}" y="0" width="{width:.1f}" height="{BAR_H}"'
            f' fill="{p["colour"]}"><title>{p["label"]}: {_ms(ms)}</title></rect>'
        )
        x += width
    tx = w.p99_ms * px
    out.append(
        f'<line class="target" x1="{tx:.1f}" y1="-2" x2="{tx:.1f}" y2="{BAR_H + 2}" stroke="#1d2330"'
        ' stroke-width="2" stroke-dasharray="4 2"/>'
        f'<text x="{min(tx, BAR_W - 4):.1f}" y="{BAR_H + 14}" text-anchor="end" class="axis">target'
        f" {w.p99_ms:,.0f} ms</text></svg>"
    )
    return "".join(out)


def _ms(ms: float) -> str:
    return "unbounded" if not math.isfinite(ms) else f"{ms:,.1f} ms"


def _budget_label(a: Answer, w: WhatIf) -> str:
    inner = ", ".join(f"{label} {_ms(getattr(a, k))}" for k, label, _ in SEGMENTS)
    return f"p99 {_ms(a.p99_ms)} of a {w.p99_ms:,.0f} ms target: {inner}"


# --- p99 and throughput against the rate -----------------------------------------------------------------------

PLOT_W, PLOT_H = 760, 300
LEFT, RIGHT, TOP, BOTTOM = 60, 70, 30, 40
P99_COLOUR, TPUT_COLOUR, SIM_COLOUR = "#4a7fb0", "#2f8f57", "#d9822b"


def _nice(top: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above `top`."""
    if top <= 0:
        return 1.0
    scale = 10 ** math.floor(math.log10(top))
    for step in (1, 2, 5, 10):
        if step * scale >= top * (1 - 1e-9):
            return step * scale
    return 10 * scale


def _fmt(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:g}M"
    if v >= 1e3:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def plot_svg(w: WhatIf, a: Answer, curve: list[dict[str, Any]], simulated: list[dict[str, Any]] | None = None) -> str:
    """The analytic curve of p99 (left scale) and throughput (right scale) against the rate; the what-if's
    own rate marked; `simulated` points (sim.planner's Check.points) drawn over it. A p99 off the scale
    (or unbounded) is drawn at its top edge."""
    simulated = simulated or []
    x_top = max(p["rate"] for p in curve)
    finite = [p["p99_ms"] for p in curve if p["p99_ms"] is not None]
    sim_p99 = [p["p99_ms"] for p in simulated if p["p99_ms"] is not None]
    y_top = _nice(min(max([1.2 * w.p99_ms, *finite, *sim_p99]), 3 * w.p99_ms))
    t_top = _nice(max([p["throughput"] for p in curve] + [p["throughput"] for p in simulated] + [1e-9]))
    pw, ph = PLOT_W - LEFT - RIGHT, PLOT_H - TOP - BOTTOM
    base = TOP + ph

    def X(rate: float) -> float:  # noqa: N802
        return LEFT + pw * rate / x_top

    def Y(ms: float | None) -> float:  # noqa: N802
        return TOP if ms is None else TOP + ph * (1 - min(ms, y_top) / y_top)

    def T(tput: float) -> float:  # noqa: N802
        return TOP + ph * (1 - tput / t_top)

    current_p99 = None if not math.isfinite(a.p99_ms) else a.p99_ms
    out = [
        f'<svg class="lab-plot" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {PLOT_W} {PLOT_H}" role="img"'
        f' aria-label="p99 and throughput against the request rate; now {w.rate:,.0f} req/s, p99'
        f' {_ms(a.p99_ms)}; {len(simulated)} simulated points" data-rate="{w.rate:g}"'
        f' data-simulated="{len(simulated)}">',
        f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="#fff" stroke="#c9ced8"/>',
    ]
    for i in range(1, 5):  # grid and scales
        y = TOP + ph * (1 - i / 4)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + pw}" y2="{y:.1f}" stroke="#eef1f5"/>')
        out.append(f'<text class="axis" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(y_top * i / 4)}</text>')
        out.append(f'<text class="axis" x="{LEFT + pw + 6}" y="{y + 4:.1f}">{_fmt(t_top * i / 4)}</text>')
    for i in range(0, 5):
        x = LEFT + pw * i / 4
        out.append(f'<text class="axis" x="{x:.1f}" y="{base + 16}" text-anchor="middle">{_fmt(x_top * i / 4)}</text>')
    out.append(
        f'<text class="axis" x="{LEFT + pw / 2}" y="{PLOT_H - 4}" text-anchor="middle">request rate (req/s)</text>'
        f'<text class="axis" x="14" y="{TOP + ph / 2}" transform="rotate(-90 14 {TOP + ph / 2})"'
        f' text-anchor="middle" fill="{P99_COLOUR}">p99 (ms)</text>'
        f'<text class="axis" x="{PLOT_W - 12}" y="{TOP + ph / 2}" transform="rotate(90 {PLOT_W - 12} {TOP + ph / 2})"'
        f' text-anchor="middle" fill="{TPUT_COLOUR}">throughput (req/s)</text>'
    )
    ty = Y(w.p99_ms)
    out.append(
        f'<line class="target" x1="{LEFT}" y1="{ty:.1f}" x2="{LEFT + pw}" y2="{ty:.1f}" stroke="#1d2330"'
        f' stroke-dasharray="5 3"/><text class="axis" x="{LEFT + 4}" y="{ty - 4:.1f}">p99 target</text>'
    )
    if not w.autoscale and a.capacity < x_top:
        cx = X(a.capacity)
        out.append(
            f'<line class="capacity" x1="{cx:.1f}" y1="{TOP}" x2="{cx:.1f}" y2="{base}" stroke="#c4493f"'
            f' stroke-dasharray="3 3"/><text class="axis" x="{cx + 4:.1f}" y="{TOP + 12}" fill="#c4493f">'
            "capacity</text>"
        )
    p99_line = " ".join(f"{X(p['rate']):.1f},{Y(p['p99_ms']):.1f}" for p in curve if p["p99_ms"] is not None)
    tput_line = " ".join(f"{X(p['rate']):.1f},{T(p['throughput']):.1f}" for p in curve)
    out.append(
        f'<polyline class="p99-curve" points="{p99_line}" fill="none" stroke="{P99_COLOUR}" stroke-width="2"/>'
        f'<polyline class="throughput-curve" points="{tput_line}" fill="none" stroke="{TPUT_COLOUR}"'
        ' stroke-width="2"/>'
    )
    nx = X(w.rate)
    out.append(
        f'<g class="current" data-rate="{w.rate:g}"><line x1="{nx:.1f}" y1="{TOP}" x2="{nx:.1f}" y2="{base}"'
        ' stroke="#12324a" stroke-width="1"/>'
        f'<circle cx="{nx:.1f}" cy="{Y(current_p99):.1f}" r="6" fill="{P99_COLOUR}" stroke="#12324a"'
        f' stroke-width="2"><title>now: p99 {_ms(a.p99_ms)}</title></circle>'
        f'<circle cx="{nx:.1f}" cy="{T(min(w.rate, a.capacity)):.1f}" r="6" fill="{TPUT_COLOUR}" stroke="#12324a"'
        f' stroke-width="2"><title>now: {min(w.rate, a.capacity):,.0f} req/s served</title></circle></g>'
    )
    for p in simulated:
        sx = X(p["rate"])
        sy = Y(p["p99_ms"])
        st = T(p["throughput"])
        out.append(
            f'<g class="sim-point" data-rate="{p["rate"]:g}">'
            f'<rect x="{sx - 5:.1f}" y="{sy - 5:.1f}" width="10" height="10" fill="{SIM_COLOUR}" stroke="#1d2330"'
            f' transform="rotate(45 {sx:.1f} {sy:.1f})"><title>simulated at {p["rate"]:,.0f} req/s: p99'
            f" {_ms(p['p99_ms'] if p['p99_ms'] is not None else math.inf)}</title></rect>"
            f'<path d="M{sx - 5:.1f},{st - 5:.1f} L{sx + 5:.1f},{st + 5:.1f} M{sx - 5:.1f},{st + 5:.1f}'
            f' L{sx + 5:.1f},{st - 5:.1f}" stroke="{SIM_COLOUR}" stroke-width="3"><title>simulated at'
            f" {p['rate']:,.0f} req/s: {p['throughput']:,.0f} req/s served</title></path></g>"
        )
    legend = [("p99, analytic", P99_COLOUR, "line"), ("throughput, analytic", TPUT_COLOUR, "line")]
    if simulated:
        legend.append(("simulated: p99 ◆, throughput ✕", SIM_COLOUR, "dot"))
    lx = LEFT
    for text, colour, kind in legend:  # above the plot, where no curve goes
        if kind == "line":
            out.append(f'<line x1="{lx}" y1="10" x2="{lx + 18}" y2="10" stroke="{colour}" stroke-width="3"/>')
        else:
            out.append(f'<rect x="{lx + 4}" y="5" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text class="axis" x="{lx + 22}" y="14">{escape(text)}</text>')
        lx += 22 + 7 * len(text) + 16
    out.append("</svg>")
    return "".join(out)
