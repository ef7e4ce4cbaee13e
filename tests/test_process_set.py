"""/metrics for several web processes on one port: serving.dataplane.metrics.process_set.

In-process, with a registry of its own for each stand-in process; `tests/test_node_host_processes.py` scrapes a
real `serve --workers 2`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serving.dataplane.gateway.pipeline import PipelineStats, live
from serving.dataplane.metrics import metrics, process_set
from serving.dataplane.metrics.history import HourHistory
from serving.dataplane.metrics.metrics import LiveWindow, SaturationWindow
from serving.dataplane.metrics.process_set import ProcessSet, merge, to_families
from usage import sketch


def registry() -> tuple[CollectorRegistry, Counter, Gauge, Histogram]:
    reg = CollectorRegistry()
    requests = Counter("t_requests", "answered", ["status"], registry=reg)
    lag = Gauge("t_lag_seconds", "late", registry=reg)
    wait = Histogram("t_wait_seconds", "waited", buckets=(0.1, 1.0), registry=reg)
    return reg, requests, lag, wait


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_counters_and_histograms_are_summed_and_gauges_are_each_processes() -> None:
    # given two processes' registries
    a, a_requests, a_lag, a_wait = registry()
    b, b_requests, b_lag, b_wait = registry()
    a_requests.labels("200").inc(3)
    b_requests.labels("200").inc(4)
    b_requests.labels("503").inc()
    a_lag.set(0.25)
    b_lag.set(0.5)
    a_wait.observe(0.05)
    b_wait.observe(0.5)
    b_wait.observe(0.07)
    # when process 1 answers for both
    merged = merge(to_families(a.collect()), 1, [(2, True, to_families(b.collect()))])
    reg = CollectorRegistry()
    reg.register(type("Fixed", (), {"collect": lambda self: iter(merged)})())
    got = samples(generate_latest(reg))
    # then the counts are the sums, series by series, and the gauge is one series per process
    assert got[("t_requests_total", (("status", "200"),))] == 7
    assert got[("t_requests_total", (("status", "503"),))] == 1
    assert got[("t_wait_seconds_bucket", (("le", "0.1"),))] == 2
    assert got[("t_wait_seconds_bucket", (("le", "1.0"),))] == 3
    assert got[("t_wait_seconds_count", ())] == 3
    assert abs(got[("t_wait_seconds_sum", ())] - 0.62) < 1e-9
    assert got[("t_lag_seconds", (("pid", "1"),))] == 0.25
    assert got[("t_lag_seconds", (("pid", "2"),))] == 0.5
    assert ("t_lag_seconds", ()) not in got
    # and a series' creation time is the earliest
    created = [
        v for (name, labels), v in got.items() if name == "t_requests_created" and labels == (("status", "200"),)
    ]
    firsts = [
        s.value
        for r in (a, b)
        for f in r.collect()
        for s in f.samples
        if s.name == "t_requests_created" and s.labels == {"status": "200"}
    ]
    assert created == [min(firsts)]


def test_an_exited_process_keeps_its_counts_and_loses_its_gauges() -> None:
    a, a_requests, a_lag, _ = registry()
    b, b_requests, b_lag, _ = registry()
    a_requests.labels("200").inc(2)
    b_requests.labels("200").inc(5)
    b_lag.set(9.0)
    merged = {m.name: m for m in merge(to_families(a.collect()), 1, [(2, False, to_families(b.collect()))])}
    values = {(s.name, tuple(s.labels.items())): s.value for s in merged["t_requests"].samples}
    assert values[("t_requests_total", (("status", "200"),))] == 7
    assert [s.labels for s in merged["t_lag_seconds"].samples] == [{"pid": "1"}]


def test_files_in_the_folder_answer_for_every_process(tmp_path: Path) -> None:
    # given this process and another live one (pid 1 stands in: it exists and is not this), each writing its file
    mine, my_requests, _, _ = registry()
    theirs, their_requests, their_lag, _ = registry()
    my_requests.labels("200").inc(1)
    their_requests.labels("200").inc(10)
    their_lag.set(0.125)
    other = ProcessSet(tmp_path, theirs, pid=1)
    other.write()
    here = ProcessSet(tmp_path, mine)
    # an exited process with a file (its counts stay), and a stray file (skipped)
    gone_reg, gone_requests, gone_lag, _ = registry()
    gone_requests.labels("200").inc(100)
    gone_lag.set(7.0)
    ProcessSet(tmp_path, gone_reg, pid=dead_pid()).write()
    (tmp_path / "notes.json").write_text("{")
    # when this process answers a scrape
    got = samples(generate_latest(here))
    # then it counts its own (read now), the other's and the exited one's
    assert got[("t_requests_total", (("status", "200"),))] == 111
    assert got[("t_lag_seconds", (("pid", "1"),))] == 0.125
    assert got[("t_lag_seconds", (("pid", str(os.getpid())),))] == 0.0
    assert len([k for k in got if k[0] == "t_lag_seconds"]) == 2  # the exited process's gauge is gone
    # and what it answered is in its file, so another process answering next reads at least as much of it
    assert samples(generate_latest(other))[("t_requests_total", (("status", "200"),))] == 111
    # and its own count is live, not its last file's
    my_requests.labels("200").inc(5)
    assert samples(generate_latest(here))[("t_requests_total", (("status", "200"),))] == 116


def test_a_reused_pid_does_not_replace_an_exited_processes_counts(tmp_path: Path) -> None:
    # given an exited process's file, and a later process the kernel gave the same pid
    old_reg, old_requests, old_lag, _ = registry()
    old_requests.labels("200").inc(4)
    old_lag.set(3.0)
    ProcessSet(tmp_path, old_reg, pid=1).write()
    new_reg, new_requests, _, _ = registry()
    new_requests.labels("200").inc(1)
    ProcessSet(tmp_path, new_reg, pid=1).write()
    mine, _, _, _ = registry()
    got = samples(generate_latest(ProcessSet(tmp_path, mine)))
    # then both are counted, and only the newer one's gauge is live
    assert got[("t_requests_total", (("status", "200"),))] == 5
    assert got[("t_lag_seconds", (("pid", "1"),))] == 0.0


def test_the_consoles_figures_are_every_web_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (processes that have run for longer than the live window, whose rates divide by all of it)
    monkeypatch.setattr(metrics, "STARTED", metrics.STARTED - 60)

    # given another web process (pid 1 stands in for a live one) that answered 30 requests of a version in
    # 40 ms and passed 10 to the fallback, and an exited one that answered 5 in 400 ms a minute ago
    def figures(n: int, seconds: float, fallback: int) -> dict:
        hour = HourHistory()
        live, kinds = LiveWindow(hour=hour), SaturationWindow(hour=hour)
        for _ in range(n):
            live.request(seconds, True)
            kinds.mark("served")
        for _ in range(fallback):
            kinds.mark("fallback")
        live.batch(n)
        return {"live": live.doc(), "kinds": kinds.totals(), "minutes": [m.to_doc() for m in hour.last_hour()]}

    other = figures(30, 0.040, 10)
    gone = figures(5, 0.400, 0)
    for pid, doc in ((1, other), (dead_pid(), gone)):
        figures_of = {"versions": lambda only, d=doc: {"console-m:1": d}}
        ProcessSet(tmp_path, CollectorRegistry(), pid=pid, console=figures_of).write()  # type: ignore[misc]
    # and this process, which answered 10 of the same version in 10 ms
    vm = metrics.for_version("console-m", 1)
    for _ in range(10):
        vm.answered(200, 0.010)
        vm.saturation.mark("served")
    process_set.install(str(tmp_path), console={"versions": metrics.console_doc})
    try:
        # when the console asks this process for the version's figures
        live = metrics.live_stats("console-m", 1)
        shares = metrics.saturation_shares("console-m", 1)
        hour = metrics.hour_history("console-m", 1)
    finally:
        process_set.install("")
    # then the live window and the kinds are the live processes' (40 answers over 30 s), p50 within the sketch's
    # bucket width (about 9%) of the 40 ms most answers took, and the hour counts the exited process's too
    assert live is not None and live.rate == 40 / 30 and live.errors == 0
    assert live.p50_ms is not None and abs(live.p50_ms - 40) < 40 * 0.05
    assert live.p99_ms is not None and abs(live.p99_ms - 40) < 40 * 0.05
    assert live.mean_batch == 30  # only the other process ran a batch (30 rows)
    assert shares == {"served": 40 / 50, "fallback": 10 / 50, "shed": 0.0, "error": 0.0}
    assert sum(sum(m.latency.values()) for m in hour) == 45
    assert sum(m.latency.get(sketch.bucket_of(0.400), 0) for m in hour) == 5  # the exited process's answers
    # and with no other process, they are this process's alone, exact
    assert metrics.live_stats("console-m", 1).p50_ms == 10.0  # type: ignore[union-attr]


def test_a_live_windows_document_summarises_each_answer_once_and_drops_what_left_the_window() -> None:
    live = LiveWindow(window=30)
    for t in range(60):  # an answer a second for a minute, in 10 ms
        live.request(0.010, True, now=float(t))
    first = live.doc(now=59.5)
    # to the second: the seconds 29 to 59 (the second that began at 29 ends inside the window)
    assert first["answers"] == 31 and first["errors"] == 0 and sum(first["latency"].values()) == 31
    # when an error and a batch follow, and the window moves on
    live.request(0.5, False, now=60.0)
    live.batch(4, now=60.0)
    later = live.doc(now=60.5)
    # (every answer's time in the sketch, the error's too)
    assert later["answers"] == 31 and later["errors"] == 1 and sum(later["latency"].values()) == 31
    assert (later["batches"], later["rows"]) == (1, 4)
    # and asked again with nothing new, the same figures
    assert live.doc(now=60.5) == later


def test_a_pipelines_console_figures_are_every_web_processes(tmp_path: Path) -> None:
    # given another web process (pid 1 stands in) whose pipeline ran 3 calls of 20 ms steps, one refused
    theirs, mine = PipelineStats(), PipelineStats()
    for refused in (False, False, True):
        theirs.call("cascade", fell_back=False)
        theirs.step("cascade", "small", 0.020, 4, refused)
    ProcessSet(tmp_path, CollectorRegistry(), pid=1, console={"pipelines": theirs.docs}).write()
    # and this one, 2 calls of 20 ms, one of which fell back
    for fell_back in (False, True):
        mine.call("cascade", fell_back)
        mine.step("cascade", "small", 0.020, 4, False)
    process_set.install(str(tmp_path), console={"pipelines": mine.docs})
    try:
        merged = live("cascade")
    finally:
        process_set.install("")
    # then the console shows both processes' calls and steps
    assert (merged["calls"], merged["fallbacks"]) == (5, 1)
    small = merged["steps"]["small"]
    assert (small["calls"], small["rows"], small["refused"]) == (5, 16, 1)
    assert small["p50_ms"] is not None and abs(small["p50_ms"] - 20) < 20 * 0.05
    # and without other processes, this one's alone (`stats.of`)
    assert live("no-such-pipeline") == {"calls": 0, "fallbacks": 0, "steps": {}}
