"""One `/metrics` for several web processes on one port (`serve --workers N`).

The kernel hands each scrape to whichever web process accepts it. Answered from that process's registry alone,
two scrapes read two processes, each counting only its own requests: a counter goes backwards between them,
and a rate computed from it is noise. So each web process writes its families every `INTERVAL_S` (and at a
clean stop) to a file of its own in FERRY_METRICS_DIR, which `serve` makes afresh for each run, and answers
`/metrics` with its own registry, read now, merged with the others' last files:

- counters, histograms and summaries are summed series by series, a process that has exited included, with
  what it last wrote: its requests were served and stay counted (a restarted process starts from zero beside
  them, and the sum does not fall);
- gauges (and gauge histograms) get a `pid` label, live processes only, as prometheus_client's multiprocess
  mode does by default ("all"): a loop's lag or a process's held body bytes is that process's, and summing
  them would mean nothing;
- `_created` samples take the earliest, info and state sets the answering process's.

The file also holds the process's console figures: by version (`metrics.console_doc`: the model page's live
window, its answers by kind, its last hour), which `metrics.live_stats`, `saturation_shares` and
`hour_history` merge the same way (the live window and the kinds over the live processes, the hour over all),
and by pipeline (`pipeline.PipelineStats.docs`: calls and each step's figures), which `pipeline.live` merges
over all.

Why not prometheus_client's multiprocess mode: it counts through its own value classes in mmapped files, so
the custom collectors that keep the request path cheap (`fastmetrics`) would be left out of it.

What a scrape may miss: what another process counted since its last write (at most `INTERVAL_S`), and, for a
process killed without a clean stop, that part for good. A counter still never goes backwards from one scrape
to the next: each file only grows, and the process answering a scrape writes what it answers first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
SUMMED = frozenset({"counter", "histogram", "summary"})
PER_PROCESS = frozenset({"gauge", "gaugehistogram", "unknown"})
PID_LABEL = "pid"

# (name, type, documentation, unit, [(sample name, labels, value), ...]): one family as a file holds it
Family = tuple[str, str, str, str, list[tuple[str, dict[str, str], float]]]


def to_families(metrics: Iterable[Metric]) -> list[Family]:
    return [
        (m.name, m.type, m.documentation, m.unit, [(s.name, dict(s.labels), float(s.value)) for s in m.samples])
        for m in metrics
    ]


def merge(own: list[Family], own_pid: int, others: list[tuple[int, bool, list[Family]]]) -> list[Metric]:
    """The families of this process (`own`, pid `own_pid`) merged with those of `others`: (pid, alive,
    families) each. Families and series keep the order in which they are first seen, this process's first."""
    order: list[str] = []
    heads: dict[str, tuple[str, str, str]] = {}
    series: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for pid, alive, families in [(own_pid, True, own), *others]:
        for name, kind, doc, unit, samples in families:
            head = heads.get(name)
            if head is None:
                heads[name] = (kind, doc, unit)
                order.append(name)
                series[name] = {}
            elif head[0] != kind:  # another version of the code, mid-deploy: not summed with a stranger
                continue
            into = series[name]
            per_process = kind in PER_PROCESS
            if per_process and not alive:
                continue
            for sample, labels, value in samples:
                if per_process:
                    labels = {**labels, PID_LABEL: str(pid)}
                key = (sample, tuple(labels.items()))
                seen = into.get(key)
                if seen is None:
                    into[key] = value
                elif sample.endswith("_created"):
                    into[key] = min(seen, value)
                elif kind in SUMMED:
                    into[key] = seen + value
                # info, stateset: the first process's (this one's) stands
    out = []
    for name in order:
        kind, doc, unit = heads[name]
        metric = Metric(name, doc, kind, unit)
        for (sample, labels), value in series[name].items():
            metric.add_sample(sample, dict(labels), value)
        out.append(metric)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ProcessSet:
    """This web process's file in `directory`, and the registry that answers `/metrics` for all of them."""

    def __init__(
        self,
        directory: Path,
        registry: Any = REGISTRY,
        pid: int | None = None,
        console: Mapping[str, Callable[[str | None], dict[str, dict]]] | None = None,
    ) -> None:
        self.directory = directory
        self.registry = registry
        # This process's console figures, by section ("versions": `metrics.console_doc`, "pipelines"), each a
        # function of a key (None: every key) to the documents by key.
        self.sections = dict(console or {})
        self._parsed: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}  # file name -> (its version, document)
        self.pid = os.getpid() if pid is None else pid
        # pid and start: a pid the kernel reuses for a later process does not overwrite an exited one's counts
        self.name = f"{self.pid}-{time.time_ns()}.json"
        self.path = directory / self.name

    def write(self, families: list[Family] | None = None) -> None:
        """Write this process's families (now, unless given) and its console figures: atomically, a reader
        sees the last file or this one."""
        self.directory.mkdir(parents=True, exist_ok=True)
        doc = {
            "families": to_families(self.registry.collect()) if families is None else families,
            "console": {section: figures(None) for section, figures in self.sections.items()},
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS))
        os.replace(tmp, self.path)

    def _files(self) -> list[tuple[int, bool, dict[str, Any]]]:
        """The other processes' last files: (pid, alive, document) each."""
        found: list[tuple[int, int, dict[str, Any]]] = []
        try:
            entries = list(self.directory.glob("*.json"))
        except OSError:
            return []
        for path in entries:
            if path.name == self.name:
                continue
            try:
                pid, started = (int(part) for part in path.stem.split("-", 1))
                doc = self._read(path)
            except (OSError, ValueError, TypeError) as exc:  # a stray file, or one being replaced right now
                log.debug("metrics file %s skipped: %s", path, exc)
                continue
            found.append((pid, started, doc))
        for gone in self._parsed.keys() - {path.name for path in entries}:
            del self._parsed[gone]
        newest: dict[int, int] = {}
        for pid, started, _ in found:
            newest[pid] = max(newest.get(pid, 0), started)
        return [
            (pid, started == newest[pid] and pid != self.pid and alive(pid), doc)
            for pid, started, doc in sorted(found, key=lambda f: (f[0], f[1]))
        ]

    def _read(self, path: Path) -> dict[str, Any]:
        """A file's document, parsed again only when the file was replaced since (each is, once a second): the
        models page asks `console` once per version, and would otherwise parse every file that many times."""
        info = path.stat()
        version = (info.st_ino, info.st_mtime_ns)
        cached = self._parsed.get(path.name)
        if cached is not None and cached[0] == version:
            return cached[1]
        doc = orjson.loads(path.read_bytes())
        if not isinstance(doc, dict):
            raise TypeError("not a metrics file")
        self._parsed[path.name] = (version, doc)
        return doc

    def others(self) -> list[tuple[int, bool, list[Family]]]:
        # lists where `Family` has tuples: `merge` unpacks both
        return [(pid, live, doc.get("families", [])) for pid, live, doc in self._files()]

    def console(self, section: str, key: str, alive_only: bool) -> list[dict]:
        """Every process's console figures of `key` in `section` (a version's "model:version" in "versions", a
        pipeline's name in "pipelines"): this one's as they are now, the others' from their last files
        (`alive_only`: not those of processes that have exited)."""
        docs = []
        figures = self.sections.get(section)
        own = figures(key) if figures is not None else {}
        if key in own:
            docs.append(own[key])
        for _, live, doc in self._files():
            if live or not alive_only:
                found = doc.get("console", {}).get(section, {}).get(key)
                if found is not None:
                    docs.append(found)
        return docs

    def collect(self) -> Iterator[Metric]:
        """This process's families as they are now, merged with every other process's last file. What it
        answers it writes first: a later scrape answered by another process reads at least as much of this
        one, so no counter goes backwards from one scrape to the next, whichever process answers each."""
        own = to_families(self.registry.collect())
        try:
            self.write(own)
        except OSError as exc:
            log.warning("could not write this process's metrics to %s: %s", self.path, exc)
        yield from merge(own, self.pid, self.others())

    async def write_forever(self) -> None:
        while True:
            try:
                self.write()
            except OSError as exc:
                log.warning("could not write this process's metrics to %s: %s", self.path, exc)
            except Exception:  # a bug: logged, and the next second tries again rather than the task dying quietly
                log.exception("writing this process's metrics to %s failed", self.path)
            await asyncio.sleep(INTERVAL_S)


_current: ProcessSet | None = None


def install(
    directory: str, console: Mapping[str, Callable[[str | None], dict[str, dict]]] | None = None
) -> ProcessSet | None:
    """This process's set when `directory` (FERRY_METRICS_DIR) is set: `/metrics`, and the console's figures
    (`console`: this process's, by section), answer for every process."""
    global _current
    _current = ProcessSet(Path(directory), console=console) if directory else None
    return _current


def current() -> ProcessSet | None:
    return _current


def registry() -> Any:
    """What `/metrics` reads: every web process's families when this is one of several, else this process's."""
    return _current if _current is not None else REGISTRY
