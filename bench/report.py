"""The benchmark report: acceptance ratios, docs/benchmarks/served.md and the two plots, from measured results."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import loadgen, raw
from bench.loadgen import LoadResult, log

P99_BUDGET_MS = 300.0
MAX_ERROR_RATIO = 0.001
TARGET_RATIO = 0.70
WIDE = "wide-mlp"
WIDE_OFF = "wide-mlp-unbatched"
DIGITS_MODELS = ("digits", "digits-small")
SERVED_MODELS = (*DIGITS_MODELS, WIDE, WIDE_OFF)
SERVED_HEADER = "| model | max req/s (p99 < 300 ms, < 0.1% errors) | p50 ms | p99 ms | mean batch | send lag p99 ms |"


@dataclass
class Settings:
    step: float  # measured seconds per load step
    warmup: float
    raw_seconds: float
    ceiling_step: float
    refine_steps: int
    probe_seconds: float

    @classmethod
    def for_mode(cls, quick: bool) -> Settings:
        if quick:
            return cls(step=3.0, warmup=0.5, raw_seconds=0.5, ceiling_step=2.0, refine_steps=1, probe_seconds=1.0)
        return cls(step=8.0, warmup=1.0, raw_seconds=2.0, ceiling_step=5.0, refine_steps=2, probe_seconds=2.0)


@dataclass
class Sweep:
    model: str
    best: LoadResult | None = None
    steps: list[LoadResult] = field(default_factory=list)
    probe_rps: float = 0.0
    error: str = ""

    @property
    def mean_batch(self) -> float | None:
        return self.best.extra.get("mean_batch") if self.best else None


def nearest_size(mean_batch: float, sizes: list[int] | None = None) -> int:
    return min(sizes or raw.BATCH_SIZES, key=lambda b: abs(b - mean_batch))


def ratios(raw_rows: list[raw.RawRow], sweeps: dict[str, Sweep]) -> dict[str, Any]:
    by_size = {r.batch_size: r.rows_per_s for r in raw_rows}
    on, off = sweeps.get(WIDE), sweeps.get(WIDE_OFF)
    out: dict[str, Any] = {"raw_1": by_size.get(1), "raw_32": by_size.get(32)}
    if not (on and on.best and off and off.best and on.mean_batch):
        out["missing"] = "served wide-MLP figures or the batch-size metric are missing"
        return out
    size = nearest_size(on.mean_batch, sorted(by_size))
    served_on, served_off = on.best.achieved_rate, off.best.achieved_rate
    out.update(
        mean_batch=on.mean_batch,
        size=size,
        raw_at_mean=by_size[size],
        served_on=served_on,
        served_off=served_off,
        efficiency=served_on / by_size[size],
        speedup_ratio=(served_on / served_off) / (by_size[size] / by_size[1]),
    )
    return out


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def verdict(v: float | None) -> str:
    return "n/a — FAIL" if v is None else f"{v:.2f} — {'PASS' if v >= TARGET_RATIO else 'FAIL'}"


COMPARE_START, COMPARE_END = "<!-- compare:start -->", "<!-- compare:end -->"

# The page under docs/ that holds each writer's section. docs/benchmarks.md is the index, kept by hand: one
# page for every result would pass the 300 lines a docs page may have. Each writer splices its marked section
# into its page and leaves the rest of the page (the hand-written notes around it) alone; bench.run rewrites
# only the served page whole. The plots stay in docs/, one level above the pages (hence "../" in the links).
PAGES = {
    "served": "benchmarks/served.md",
    "tracingcost": "benchmarks/tracing.md",
    "tracinghooks": "benchmarks/tracing.md",
    "responsecache": "benchmarks/response-cache.md",
    "overload": "benchmarks/overload.md",
    "ratelimit": "benchmarks/rate-limits.md",
    "compare": "benchmarks/revisions.md",
    "authcost": "benchmarks/request-path.md",
    "redishop": "benchmarks/request-path.md",
    "packing": "benchmarks/fleet.md",
    "fleet200": "benchmarks/fleet.md",
    "websocket": "benchmarks/websocket.md",
    "grpc": "benchmarks/grpc.md",
    "pipelines": "benchmarks/pipelines.md",
    "failures": "benchmarks/failures.md",
}


def page(docs: Path, section: str) -> Path:
    """The page under `docs` (the docs/ folder) that holds `section`, a key of PAGES."""
    return docs / PAGES[section]


def splice_section(path: Path, start: str, end: str, section: str) -> None:
    """Put `section` (which begins with `start` and ends with `end`) into the report at `path`: in place of
    the one already there, else before "## Every step", else at the end."""
    text = path.read_text() if path.exists() else ""
    i, j = text.find(start), text.find(end)
    if 0 <= i < j:
        text = text[:i] + section + text[j + len(end) :]
    else:
        marker = "\n## Every step"
        text = text.replace(marker, f"\n{section}\n{marker}", 1) if marker in text else f"{text}\n{section}\n"
    path.write_text(text)


def command_line(module: str, argv: list[str] | None) -> str:
    """How a page names a run: `python -m <module>` and its arguments (this process's when `argv` is None)."""
    return " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)])


def publish(text: str, record: Path | None, start: str, end: str) -> None:
    """Print a bench's section, and splice it into the page `record` names, if any."""
    print(text)
    if record:
        splice_section(record, start, end, text)


def kept_section(text: str, start: str, end: str) -> str:
    """The section between the markers `start` and `end` (included) of an existing report, to keep when
    the page is rewritten; "" when there is none."""
    i, j = text.find(start), text.find(end)
    return text[i : j + len(end)] if 0 <= i < j else ""


def compare_section(text: str) -> str:
    """The section `bench.compare --record` wrote into an existing report, to keep when the page is rewritten."""
    return kept_section(text, COMPARE_START, COMPARE_END)


SHARED_CORES = 0.25  # other processes' use during a run past which a page says other work shared the machine


def others_used(others: float | None) -> str:
    """What other processes used during the runs (bench.server.OtherCpu), as a page says it."""
    if others is None:
        return "other processes used an unknown share during the runs"
    shared = " (other work shared the machine)" if others >= SHARED_CORES else ""
    return f"other processes used {others:.2f} cores during the runs{shared}"


def commit() -> str:
    """The checkout's commit, short, with "+ uncommitted changes" when the tree differs from it."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def write_report(
    path: Path,
    facts: dict[str, str],
    s: Settings,
    ceiling: LoadResult | None,
    ceiling_steps: list[LoadResult],
    raw_rows: list[raw.RawRow],
    sweeps: dict[str, Sweep],
    rt: dict[str, Any],
    phases: dict[str, float],
    quick: bool,
    command: str,
    elapsed: float,
    only: tuple[str, ...] = ("ceiling", "batching", "digits", "overload", "ratelimit"),
    extra_sections: list[str] | None = None,
) -> None:
    """The whole page. `only`: the phases that ran (the others say so); `extra_sections`: lines placed
    before "Every step"."""
    ceil = ceiling.achieved_rate if ceiling else None
    not_run = "Not run in this invocation (`--only " + ",".join(only) + "`)."
    L: list[str] = [
        "# Served throughput (`make bench`)",
        "",
        f"Generated by `{command}` on {datetime.now(UTC):%Y-%m-%d %H:%M UTC} in commit {commit()}"
        f" in {elapsed / 60:.1f} min."
        + (
            " Every figure on this page comes from that one run."
            if not extra_sections
            else " Every figure comes from that one run except in the sections that name their own."
        )
        + (" **Quick mode: short steps, smoke-test only.**" if quick else "")
        + ("" if len(only) == 5 else f" Phases run: {', '.join(only)}."),
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in facts.items()),
        "",
        "Run time by phase: " + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()) + ".",
        "",
        "## Method",
        "",
        "- Load is **open-loop**: request *i* is sent at *t0 + i/rate* whatever the server does, over a pool"
        f" of keep-alive HTTP/1.1 connections that grows (to {loadgen.MAX_CONNECTIONS}) rather than delay a"
        " send."
        " Latency runs from each request's *scheduled* send time to the end of its response, so server stalls"
        " show up as latency (no coordinated omission).",
        f"- Each step: {s.warmup:g} s warm-up (not counted) + {s.step:g} s measured; 5 s request timeout"
        " (a timeout"
        " is an error with latency 5 s). Percentiles cover every request, errors included.",
        f"- A rate **passes** when p99 < {P99_BUDGET_MS:.0f} ms and errors (non-2xx + timeouts + connection"
        f" failures + requests that could not be sent) are < {MAX_ERROR_RATIO:.1%} of requests."
        " The sweep starts at"
        " 0.4 x a closed-loop probe's throughput, climbs in ×1.3 steps to the first failure, then bisects"
        f" {s.refine_steps}× between the last pass and the first fail. Reported: the highest passing step.",
        "- *mean batch* = Δ`ferry_batch_size_sum` / Δ`ferry_batch_size_count` from `/metrics` around the step.",
        "- Raw model throughput is a tight `torch.inference_mode()` loop over the same TorchScript file, run"
        " **before** the server starts (and at the served mean batch size once it has stopped), under the"
        " same `FERRY_TORCH_THREADS`, on the device the server picks (`FERRY_DEVICE`; on CUDA each call is"
        " synchronised); median call time.",
        "- The generator shares this machine's cores with the server, so served figures include its CPU cost;"
        " *send lag p99* (actual minus scheduled send time) shows when the generator itself fell behind.",
        "",
        "## Load generator ceiling",
        "",
    ]
    if "ceiling" not in only:
        L += [not_run, ""]
    elif ceiling:
        L += [
            "Against a trivial built-in HTTP server (fixed 200 JSON, its own process) under the same"
            " pass rule,"
            f" **the generator itself tops out at {ceil:,.0f} req/s here** (p50 {ceiling.p50_ms:.1f} ms,"
            f" p99 {ceiling.p99_ms:.1f} ms, send lag p99 {ceiling.send_lag_p99_ms:.1f} ms)."
            " Served figures well"
            " below this are the server's, not the generator's.",
            "",
        ]
    else:
        L += ["The ceiling measurement failed.", ""]

    L += ["## Demo classifier", ""]
    if "digits" in only:
        L += [SERVED_HEADER, "|---|---|---|---|---|---|"]
        L += [_served_row(sweeps.get(m), m, ceil) for m in DIGITS_MODELS]
    else:
        L += [not_run]
    L += [""]

    L += ["## Compute-bound model: wide MLP 64 → 4096×4 → 10", ""]
    if "batching" not in only:
        L += [not_run, ""]
    else:
        L += _batching_section(raw_rows, sweeps, rt, ceil)
    L += [
        "## Plots",
        "",
        "![p50/p99 vs offered rate](../bench-latency.png)",
        "",
        "![raw rows/s vs batch size, served points overlaid](../bench-batching.png)",
        "",
        *(extra_sections or []),
        "",
        "## Every step",
        "",
    ]
    for m in SERVED_MODELS:
        sw = sweeps.get(m)
        if sw is None:
            continue
        L += [f"### {m}", ""]
        if not sw.steps:
            L += [f"No steps ran{': ' + sw.error if sw.error else ''}.", ""]
            continue
        L += [f"Closed-loop probe (seed only): {sw.probe_rps:,.1f} req/s.", "", *_step_table(sw.steps), ""]
    if ceiling_steps:
        L += ["### load generator vs echo server", "", *_step_table(ceiling_steps), ""]
    path.write_text("\n".join(L) + "\n")
    log(f"[report] wrote {path}")


def _batching_section(
    raw_rows: list[raw.RawRow], sweeps: dict[str, Sweep], rt: dict[str, Any], ceil: float | None
) -> list[str]:
    L: list[str] = [
        "Raw (no server, no HTTP):",
        "",
        "| batch | ms / call | rows/s |",
        "|---|---|---|",
        *(f"| {r.batch_size} | {r.ms_per_call:.2f} | {r.rows_per_s:,.1f} |" for r in raw_rows),
        "",
        "Served (one row per request):",
        "",
        SERVED_HEADER,
        "|---|---|---|---|---|---|",
        _served_row(sweeps.get(WIDE), f"{WIDE} (max batch 32, 10 ms delay)", ceil),
        _served_row(sweeps.get(WIDE_OFF), f"{WIDE_OFF} (max batch 1)", ceil),
        "",
    ]
    if "missing" in rt:
        L += [
            f"Ratios: not computed — {rt['missing']}.",
            "",
            f"- served_batched / raw(mean batch): {verdict(None)}",
            f"- (served_on / served_off) / (raw(mean batch) / raw(1)): {verdict(None)}",
            "",
        ]
    else:
        b = rt["size"]
        L += [
            f"Served mean batch {rt['mean_batch']:.2f} → raw measured at **{b}**"
            f" (raw {rt['raw_at_mean']:,.1f} rows/s; raw at 1: {rt['raw_1']:,.1f},"
            f" at 32: {rt['raw_32']:,.1f}).",
            "",
            "| acceptance ratio | value | target |",
            "|---|---|---|",
            f"| served_batched / raw(batch {b}) = {rt['served_on']:,.1f} / {rt['raw_at_mean']:,.1f}"
            f" | {verdict(rt['efficiency'])} | ≥ {TARGET_RATIO:.2f} |",
            f"| (served_on / served_off) / (raw({b}) / raw(1))"
            f" = ({rt['served_on']:,.1f} / {rt['served_off']:,.1f})"
            f" / ({rt['raw_at_mean']:,.1f} / {rt['raw_1']:,.1f}) | {verdict(rt['speedup_ratio'])}"
            f" | ≥ {TARGET_RATIO:.2f} |",
            "",
        ]
    return L


def _served_row(sw: Sweep | None, label: str, ceiling: float | None) -> str:
    if sw is None or sw.best is None:
        why = sw.error if sw and sw.error else "no rate passed"
        return f"| {label} | n/a ({why}) | | | | |"
    b = sw.best
    note = " ⚠ near generator ceiling" if ceiling and b.achieved_rate > 0.5 * ceiling else ""
    return (
        f"| {label} | **{b.achieved_rate:,.1f}**{note} | {b.p50_ms:.1f} | {b.p99_ms:.1f} |"
        f" {fmt(sw.mean_batch, '.2f')} | {b.send_lag_p99_ms:.1f} |"
    )


def _step_table(steps: list[LoadResult]) -> list[str]:
    rows = [
        "| offered/s | achieved/s | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | errors | mean batch"
        " | send lag p99 ms | conns | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(steps, key=lambda r: r.offered_rate):
        errs = (
            ", ".join(
                [f"{k}×{v}" for k, v in r.errors_by_status.items()]
                + [f"{k}×{v}" for k, v in r.client_errors_by_kind.items()]
            )
            or "0"
        )
        rows.append(
            f"| {r.offered_rate:,.1f} | {r.achieved_rate:,.1f} | {r.p50_ms:.1f} | {r.p90_ms:.1f}"
            f" | {r.p99_ms:.1f} | {r.p999_ms:.1f} | {r.max_ms:.1f} | {errs} of {r.count}"
            f" | {fmt(r.extra.get('mean_batch'), '.2f')} |"
            f" {r.send_lag_p99_ms:.1f} | {r.max_connections} |"
            f" {'pass' if r.extra.get('passed') else 'fail'}{' (aborted)' if r.aborted else ''} |"
        )
    return rows


def plot(docs: Path, raw_rows: list[raw.RawRow], sweeps: dict[str, Sweep]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    for ax, m in zip(axes.flat, SERVED_MODELS, strict=True):
        sw = sweeps.get(m)
        ax.set_title(m)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("latency (ms)")
        ax.set_yscale("log")
        ax.axhline(P99_BUDGET_MS, color="grey", ls=":", lw=1, label="p99 budget")
        if sw and sw.steps:
            st = sorted(sw.steps, key=lambda r: r.offered_rate)
            x = [r.offered_rate for r in st]
            ax.plot(x, [r.p50_ms for r in st], "o-", label="p50")
            ax.plot(x, [r.p99_ms for r in st], "s-", label="p99")
            fails = [r for r in st if not r.extra.get("passed")]
            ax.plot(
                [r.offered_rate for r in fails],
                [r.p99_ms for r in fails],
                "x",
                color="red",
                ms=10,
                label="failed step",
            )
        else:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
        ax.legend(fontsize=8)
    fig.suptitle("Open-loop latency vs offered rate (latency from scheduled send time)")
    fig.savefig(docs / "bench-latency.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    ax.plot([r.batch_size for r in raw_rows], [r.rows_per_s for r in raw_rows], "o-", label="raw (no server)")
    ax.plot(
        [r.batch_size for r in raw_rows],
        [TARGET_RATIO * r.rows_per_s for r in raw_rows],
        ":",
        color="grey",
        label=f"{TARGET_RATIO:.0%} of raw",
    )
    for m, marker in ((WIDE, "*"), (WIDE_OFF, "D")):
        sw = sweeps.get(m)
        if sw and sw.best:
            mb = sw.mean_batch if sw.mean_batch is not None else 1.0
            ax.plot([mb], [sw.best.achieved_rate], marker, ms=14, label=f"served {m} (mean batch {mb:.1f})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(raw.BATCH_SIZES), [str(b) for b in raw.BATCH_SIZES])
    ax.set_xlabel("batch size")
    ax.set_ylabel("rows/s")
    ax.set_title("Wide MLP 64→4096×4→10: raw throughput vs batch size, served points overlaid")
    ax.legend()
    fig.savefig(docs / "bench-batching.png", dpi=110)
    plt.close(fig)
    log(f"[report] wrote {docs / 'bench-latency.png'} and {docs / 'bench-batching.png'}")
