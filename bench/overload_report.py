"""The overload section of docs/benchmarks/overload.md and docs/bench-overload.png, from `bench.overload`'s results."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import cpu_split
from bench.loadgen import log
from bench.overload import (
    FALLBACK_MODEL,
    GOODPUT_SHARE,
    P99_BUDGET_MS,
    RECOVERY_BUDGET_S,
    RSS_GROWTH_LIMIT,
    WIDE_MODEL,
    OverloadSettings,
    RampResult,
)
from bench.report import commit

START, END = "<!-- overload:start -->", "<!-- overload:end -->"
PLOT = "bench-overload.png"
MAX_504_SHARE = 0.005  # issue 19: a 504 means the server's estimate was wrong, so it must be rare


def _f(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _rate(v: float) -> str:
    return f"{v:,.1f}" if 0 < v < 10 else f"{v:,.0f}"


def _share(acc: dict[str, float]) -> str:
    return f"{100 * acc['accuracy']:.1f}% of {acc['answers']:,}" if acc["answers"] else "no answers"


def _secs(v: float | None) -> str:
    return "not within the schedule" if v is None else f"{v:g} s"


def _ok(passed: bool | None) -> str:
    return "n/a" if passed is None else ("PASS" if passed else "FAIL")


def peak_index(r: RampResult) -> int:
    mults = [row["multiplier"] for row in r.steps]
    return mults.index(max(mults))


def checks(r: RampResult) -> list[tuple[str, str, str, bool | None]]:
    """(check, measured, target, passed); passed None where the check is a reading, not a bound."""
    if r.error or not r.steps:
        return [("ramp ran", r.error or "no steps", "", False)]
    out: list[tuple[str, str, str, bool | None]] = []
    worst = max(r.steps, key=lambda row: -1.0 if math.isnan(row["p99_ms"]) else row["p99_ms"])
    out.append((
        "admitted p99 at every step", f"worst {_f(worst['p99_ms'])} ms (at {worst['multiplier']:g}x)",
        f"< {P99_BUDGET_MS:.0f} ms", all(not math.isnan(x["p99_ms"]) and x["p99_ms"] < P99_BUDGET_MS for x in r.steps),
    ))  # fmt: skip
    pk = r.steps[peak_index(r)]
    best = max(row["goodput_rps"] for row in r.steps)
    share = pk["goodput_rps"] / best if best else math.nan
    out.append((
        f"goodput at {pk['multiplier']:g}x vs the best step",
        f"{pk['goodput_rps']:,.1f} / {best:,.1f} = {_f(share, '.2f')}",
        f"≥ {GOODPUT_SHARE:.2f}", None if math.isnan(share) else share >= GOODPUT_SHARE,
    ))  # fmt: skip
    adm = pk["admitted_rps"]
    share_fb = f" ({100 * pk['fallback_rps'] / adm:.0f}%)" if adm else ""
    out.append((
        f"answered by the fallback at {pk['multiplier']:g}x", f"{pk['fallback_rps']:,.1f}/s of {adm:,.1f}/s admitted"
        + share_fb, "reading", None,
    ))  # fmt: skip
    acc = r.accuracy
    out.append((
        "accuracy of the answers, whole ramp",
        f"{r.model} {_share(acc['primary'])}; fallback {FALLBACK_MODEL} {_share(acc['fallback'])}",
        "reading", None,
    ))  # fmt: skip
    before, after = r.memory_before.get("VmRSS"), r.memory_after.get("VmRSS")
    if before and after:
        growth = after / before - 1
        out.append((
            "server RSS before → after the ramp", f"{before / 1024:,.0f} → {after / 1024:,.0f} MiB ({growth:+.1%});"
            f" peak over the process's life {r.memory_after.get('VmHWM', 0) / 1024:,.0f} MiB",
            f"growth ≤ {RSS_GROWTH_LIMIT:.0%}", growth <= RSS_GROWTH_LIMIT,
        ))  # fmt: skip
    else:
        out.append(("server RSS before → after the ramp", "not read", "", None))
    rec = r.recovery_s
    out.append((
        "p99 back to normal after the load drops to ≤ 1x",
        (f"{rec:g} s" if rec is not None else "not within the schedule")
        + f" (from t={_f(r.recovery_from_s, 'g')} s; normal: < {_f(max(1.5 * r.pre_p99_ms, P99_BUDGET_MS), '.0f')} ms,"
        f" pre-overload p99, below 1x, {_f(r.pre_p99_ms)} ms)",
        f"≤ {RECOVERY_BUDGET_S:g} s", rec is not None and rec <= RECOVERY_BUDGET_S,
    ))  # fmt: skip
    g = r.goodput_recovery_s
    out.append((
        "goodput back to ≥ 90% of offered after the drop", f"{g:g} s" if g is not None else "not within the schedule",
        "reading", None,
    ))  # fmt: skip
    out += answer_checks(r)
    return out


def answer_checks(r: RampResult) -> list[tuple[str, str, str, bool | None]]:
    """Issue 19's rows on the answers of the whole ramp: no 500s, 504s under 0.5% of answers (a 504 says the
    server's estimate was wrong), every 503 and 429 with Retry-After. A ramp recorded before these counts
    were kept says so instead."""
    if not r.steps or "answers" not in r.steps[0]:
        return [("500s, 504s and Retry-After", "not recorded by this run", "", None)]
    total = {k: sum(row[k] for row in r.steps) for k in ("answers", "t500", "t504", "t503", "t429")}
    missing = sum(row["refusals_without_retry_after"] for row in r.steps)
    answers = total["answers"]
    share = total["t504"] / answers if answers else math.nan
    refusals = total["t503"] + total["t429"]
    return [
        ("no 500s", f"{total['t500']:,} of {answers:,} answers", "0", total["t500"] == 0),
        ("504s, whole ramp", f"{total['t504']:,} of {answers:,} answers = {_f(100 * share, '.2f')}%",
         f"< {MAX_504_SHARE:.1%}", None if math.isnan(share) else share < MAX_504_SHARE),
        ("every 503 and 429 carries Retry-After",
         f"{refusals - missing:,} of {refusals:,} ({total['t503']:,} × 503, {total['t429']:,} × 429)",
         "all", missing == 0),
    ]  # fmt: skip


def _checks_table(r: RampResult) -> list[str]:
    rows = ["| check | measured | target | result |", "|---|---|---|---|"]
    rows += [f"| {c} | {m} | {t} | {_ok(p)} |" for c, m, t, p in checks(r)]
    return rows


def _step_table(r: RampResult) -> list[str]:
    tiers = sorted({t for row in r.steps for t in row["admitted_share_by_tier"]})
    head = (
        "| step | offered/s | sent/s | admitted/s | by fallback/s | shed/s (reasons) | 504/s | client errors/s"
        " | goodput/s | admitted p50 ms | admitted p99 ms | "
        + " | ".join(f"tier {t} admitted" for t in tiers)
        + " | send lag p99 ms |"
    )
    rows = [head, "|" + "---|" * (12 + len(tiers))]
    for row in r.steps:
        reasons = ", ".join(f"{k} {_rate(v / row['seconds'])}" for k, v in row["shed_by_reason"].items())
        client = ", ".join(f"{k} {_rate(v / row['seconds'])}" for k, v in row["client_by_kind"].items())
        rows.append(
            f"| {row['multiplier']:g}x | {row['offered_rps']:,.0f} | {row['sent_rps']:,.0f}"
            f" | {row['admitted_rps']:,.0f} | {_rate(row['fallback_rps'])}"
            f" | {_rate(row['shed_rps'])}{f' ({reasons})' if reasons else ''}"
            f" | {_rate(row['t504_rps'])} | {_rate(row['client_rps'])}{f' ({client})' if client else ''}"
            f" | {row['goodput_rps']:,.0f} | {_f(row['p50_ms'])} | {_f(row['p99_ms'])} | "
            + " | ".join(f"{100 * row['admitted_share_by_tier'].get(t, math.nan):.0f}%" for t in tiers)
            + f" | {_f(row['send_lag_p99_ms'])} |"
        )
    return rows


def _ramp_section(r: RampResult) -> list[str]:
    L = [f"### {r.label}", ""]
    if r.error and not r.steps:
        return L + [f"Did not run: {r.error}", ""]
    L += [
        f"Capacity {r.capacity:,.1f} req/s ({r.capacity_source}); each step {r.steps[0]['seconds']:g} s;"
        f" at most {r.conns_max} connections open; {r.id_mismatches} answers carried another request's `id`;"
        f" the generator used {_f(r.generator_cores, '.2f')} cores (it shares the machine with the server).",
        "",
        *_step_table(r),
        "",
        *cpu_split.step_lines(r.steps),
    ]
    if r.server_counters:
        L += ["Server counters over the ramp (Δ from `/metrics`): "
              + "; ".join(f"`{k}` {v:,.0f}" for k, v in sorted(r.server_counters.items())) + ".", ""]  # fmt: skip
    return L


def contrast(on: RampResult | None, off: RampResult | None) -> list[str]:
    if not (on and off and on.steps and off.steps):
        return ["Contrast not available: one of the two runs is missing.", ""]
    i, j = peak_index(on), peak_index(off)
    a, b = on.steps[i], off.steps[j]
    rows = [
        "| at the peak step | admission on | admission off |",
        "|---|---|---|",
        f"| offered/s | {a['offered_rps']:,.0f} | {b['offered_rps']:,.0f} |",
        f"| goodput/s | {a['goodput_rps']:,.0f} | {b['goodput_rps']:,.0f} |",
        f"| admitted/s (by fallback) | {a['admitted_rps']:,.0f} ({a['fallback_rps']:,.0f}) |"
        f" {b['admitted_rps']:,.0f} ({b['fallback_rps']:,.0f}) |",
        f"| shed/s | {a['shed_rps']:,.0f} | {b['shed_rps']:,.0f} |",
        f"| 504/s | {a['t504_rps']:,.0f} | {b['t504_rps']:,.0f} |",
        f"| client errors/s | {a['client_rps']:,.1f} | {b['client_rps']:,.1f} |",
        f"| admitted p99 ms | {_f(a['p99_ms'])} | {_f(b['p99_ms'])} |",
        f"| worst step admitted p99 ms | {_f(max(x['p99_ms'] for x in on.steps))} |"
        f" {_f(max(x['p99_ms'] for x in off.steps))} |",
        f"| p99 recovery after the drop to ≤ 1x | {_secs(on.recovery_s)} | {_secs(off.recovery_s)} |",
        f"| goodput ≥ 90% of offered again after the drop | {_secs(on.goodput_recovery_s)}"
        f" | {_secs(off.goodput_recovery_s)} |",
    ]
    return rows + [""]


def section(out: dict[str, Any], s: OverloadSettings, command: str | None = None) -> list[str]:
    ramps: list[RampResult] = out["ramps"]
    by = {r.label: r for r in ramps}
    on, off = by.get(f"{WIDE_MODEL}, admission on"), by.get(f"{WIDE_MODEL}, admission off")
    tiers = ", ".join(f"priority {t} for {share:.0%}" for t, share in s.tiers)
    L = [START, "## Overload: admission, fallback and shedding", ""]
    if command:
        when = f"{datetime.now(UTC):%Y-%m-%d %H:%M UTC}"
        L += [f"This section was generated separately, by `{command}` on {when} in commit {commit()}.", ""]
    L += [
        "Method:",
        "",
        f"- `{WIDE_MODEL}` (a 384-channel convnet on the digits, compute-bound; fallback `{FALLBACK_MODEL}`):"
        " capacity = the highest open-loop rate with p99 < 300 ms and < 0.1% errors (a 503 is an error),"
        f" searched in {s.capacity_step_s:g} s steps from a closed-loop probe.",
        f"- Ramp, open-loop: {', '.join(f'{m:g}x' for m in s.multipliers)} capacity, {s.step_s:g} s each."
        " Every request is one of the 1,797 samples of scikit-learn's digits (its label kept), with"
        + (f" `parameters.timeout` = {s.deadline_ms * 1000:,} µs (a {s.deadline_ms} ms deadline)"
           if s.client_deadline else
           f" **no deadline** (no `parameters.timeout`: the servers run with `FERRY_LATENCY_BUDGET_MS={s.budget_ms}`,"
           " the budget a request without one gets; `--deadline-ms N` sends one instead)")
        + f" and `parameters.priority` drawn at random: {tiers}.",
        "- Latency runs from each request's scheduled send time; each request counts in the second and"
        " step in which it was scheduled. *admitted* = answered 200; *by fallback* = a 200 whose"
        f" `parameters.fallback_from` is set (its `model_name` is `{FALLBACK_MODEL}`); *shed* = 503, with the"
        " reason read from the answer's message; *504* = deadline passed in the server; *client errors* ="
        " no answer within 5 s, a failed connection, or a request that could not leave (all connections"
        f" busy, cap {s.max_connections}); *goodput* = 200s answered within {s.goodput_ms} ms (the deadline,"
        " or the budget without one), measured from the scheduled send time. *sent/s* is what the generator"
        " actually sent: below *offered/s* it is the generator, sharing the cores, that fell behind.",
        "- Accuracy is graded on the answers themselves (top score vs the sample's label); each request's"
        " `id` names its sample, label and tier, and each 200's echoed `id` is checked against it.",
        "- RSS is the server process's VmRSS from /proc before the ramp (after a settle) and 2 s after it.",
        "- Admission off: the server restarted with `FERRY_ADMISSION=false`, same capacity figure and ramp."
        + ("" if out.get("admission_setting_known") else
           " **The server code in this tree has no FERRY_ADMISSION setting: both runs had the same server.**"),
        "",
        "![offered, goodput, shed and admitted p99 over time](../" + PLOT + ")",
        "",
    ]  # fmt: skip
    for r in ramps:
        if r.admission:
            L += [f"### Acceptance checks: {r.label}", "", *_checks_table(r), ""]
    L += [f"### Admission on vs off: {WIDE_MODEL}", "", *contrast(on, off)]
    if off and off.steps:
        L += [f"#### The same checks with admission off: {WIDE_MODEL}", "", *_checks_table(off), ""]
    for r in ramps:
        L += _ramp_section(r)
    L += [END]
    return L


def splice(path: Path, lines: list[str]) -> None:
    """Replace the overload section of an existing report (or append it)."""
    text = path.read_text() if path.exists() else "# Ferry benchmarks\n"
    block = "\n".join(lines)
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text.rstrip("\n") + "\n")
    log(f"[report] wrote the overload section of {path}")


def plot(docs: Path, out: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ramps: list[RampResult] = [r for r in out["ramps"] if r.series]
    cols = max(1, len(ramps))
    fig, axes = plt.subplots(2, cols, figsize=(5.5 * cols, 7.5), constrained_layout=True, squeeze=False)
    for c, r in enumerate(ramps):
        sr = r.series
        t = sr["t"]
        top, bottom = axes[0][c], axes[1][c]
        top.plot(t, [m * r.capacity for m in sr["multiplier"]], "k--", lw=1, label="offered (scheduled)")
        top.plot(t, sr["sent"], color="grey", lw=1, label="sent")
        top.plot(t, sr["goodput"], "g-", lw=2, label="goodput (200 within deadline)")
        top.plot(t, sr["fallback"], "c-", lw=1, label="answered by fallback")
        top.plot(t, sr["shed"], "r-", lw=1, label="shed (503)")
        if any(sr["504"]):
            top.plot(t, sr["504"], "m-", lw=1, label="504")
        if any(sr["client"]):
            top.plot(t, sr["client"], color="orange", lw=1, label="client errors (timeout, unsent)")
        top.axhline(r.capacity, color="grey", ls=":", lw=1, label=f"capacity {r.capacity:.0f}/s")
        top.set_title(r.label)
        top.set_ylabel("requests / s")
        top.legend(fontsize=7, loc="upper left")
        p99 = [x if x == x else float("nan") for x in sr["p99_ms"]]
        bottom.plot(t, p99, "b-", label="admitted p99")
        bottom.plot(t, sr["p50_ms"], "b:", label="admitted p50")
        bottom.axhline(P99_BUDGET_MS, color="red", ls=":", lw=1, label="300 ms")
        bottom.set_yscale("log")
        bottom.set_xlabel("seconds into the ramp (by scheduled send time)")
        bottom.set_ylabel("latency (ms)")
        bottom.legend(fontsize=7, loc="upper left")
    if not ramps:
        axes[0][0].text(0.5, 0.5, "no data", ha="center", transform=axes[0][0].transAxes)
    fig.suptitle("Overload ramps: offered 0.5x → 3x → 0.5x capacity, open-loop")
    path = docs / PLOT
    fig.savefig(path, dpi=100)
    plt.close(fig)
    log(f"[report] wrote {path}")
    return path
