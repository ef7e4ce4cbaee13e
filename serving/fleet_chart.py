"""A node's packing bar as inline SVG, drawn on the server: its memory budget, with each version it holds as a
segment as wide as its footprint.

Hot versions (on the device) fill the bar from the left, against the device budget; warm versions (in host
memory) go in a thinner row under it on the same scale, since they do not use the device's budget. A version
of a tenant the viewer may not see keeps its place and size, grey and unnamed. Names are escaped.
"""

from __future__ import annotations

import zlib
from typing import Any

from django.utils.html import escape

WIDTH = 560
HOT_H, WARM_H, GAP = 22, 10, 4


def _colour(key: str) -> str:
    """A stable colour per version key, so a version keeps its colour across nodes and updates."""
    hue = zlib.crc32(key.encode()) % 360
    return f"hsl({hue}, 55%, 55%)"


def size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def packing_svg(node: dict[str, Any]) -> str:
    """`node` is one of `serving.fleet_state`'s node documents."""
    budget = max(1, int(node["memory_budget"]))
    hot = [r for r in node["resident"] if r["tier"] == "hot"]
    warm = [r for r in node["resident"] if r["tier"] != "hot"]
    # Past the budget (a footprint measured larger than estimated), the scale stretches so nothing is cut off.
    scale = WIDTH / max(budget, sum(r["bytes"] for r in hot), sum(r["bytes"] for r in warm), 1)
    height = HOT_H + (GAP + WARM_H if warm else 0)
    parts = [
        f'<svg class="packing-bar" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}"'
        f' height="{height}" role="img" aria-label="memory of {escape(node["name"])}: versions held against the'
        f' budget" data-node="{escape(node["name"])}">',
        f'<rect class="budget" x="0" y="0" width="{budget * scale:.1f}" height="{HOT_H}" fill="#eef1f5"'
        f' stroke="#99a"/>',
    ]
    for tier, rows, y, h in (("hot", hot, 0, HOT_H), ("warm", warm, HOT_H + GAP, WARM_H)):
        x = 0.0
        for r in rows:
            w = r["bytes"] * scale
            hidden = r.get("hidden", False)
            name = "another tenant's version" if hidden else r["key"]
            fill = "#b8bcc6" if hidden else _colour(r["key"])
            opacity = ' fill-opacity="0.55"' if tier != "hot" else ""
            parts.append(
                f'<rect class="segment {tier}" data-key="{escape(r["key"])}" data-tier="{tier}" x="{x:.1f}" y="{y}"'
                f' width="{max(w, 1.0):.1f}" height="{h}" fill="{fill}" stroke="#fff"'
                f"{opacity}>"
                f"<title>{escape(name)} ({tier}): {size(r['bytes'])}</title></rect>"
            )
            x += w
    parts.append("</svg>")
    return "".join(parts)


SPARK_W, SPARK_H, SPAN_S = 160, 28, 600.0  # the utilisation chart: the last ten minutes


def utilisation_svg(node: dict[str, Any]) -> str:
    """A node's busy share and work utilisation over the last ten minutes, two lines on one 0-100% scale, from
    the heartbeat's samples (`node["utilisation"]`: [epoch seconds, busy, work], oldest first). Busy time reads
    high on a batching device at any load; the work line is the rows served at their best batch's cost.

    A live node's chart ends at its last heartbeat (its latest samples, seconds old); a lost node's ends now, so
    its lines stop where its heartbeats did and leave the chart as they age. No sample in the ten minutes: the
    chart says "no data" rather than draw an empty frame that reads as an idle device."""
    end = float(node["heartbeat_at"])
    if node.get("state") == "lost":
        end += float(node.get("heartbeat_age", 0.0))
    samples = [s for s in node.get("utilisation") or [] if end - float(s[0]) <= SPAN_S]
    name = escape(node["name"])
    parts = [
        f'<svg class="utilisation" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {SPARK_W} {SPARK_H}"'
        f' width="{SPARK_W}" height="{SPARK_H}" role="img" data-node="{name}" data-samples="{len(samples)}"'
        f' aria-label="busy and work utilisation of {name}, last ten minutes">',
        f'<rect x="0" y="0" width="{SPARK_W}" height="{SPARK_H}" fill="#f6f7f9" stroke="#dde"/>',
    ]
    if not samples:
        parts.append(
            f'<text class="no-data" x="{SPARK_W / 2:.0f}" y="{SPARK_H / 2 + 4:.0f}" text-anchor="middle"'
            ' font-size="11" fill="#667">no data</text>'
        )
    else:
        for index, series, colour in ((1, "busy", "#9aa3b5"), (2, "work", "#2b7a4b")):
            points = " ".join(
                f"{SPARK_W * (1 - (end - float(s[0])) / SPAN_S):.1f},"
                f"{SPARK_H - SPARK_H * min(1.0, max(0.0, float(s[index]))):.1f}"
                for s in samples
            )
            parts.append(
                f'<polyline class="{series}" points="{points}" fill="none" stroke="{colour}" stroke-width="1.5">'
                f"<title>{series}: last {round(float(samples[-1][index]) * 100)}%</title></polyline>"
            )
    parts.append("</svg>")
    return "".join(parts)
