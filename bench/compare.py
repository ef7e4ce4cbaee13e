"""Compare one model's served capacity between two git revisions, back to back on this machine.

    .venv/bin/python -m bench.compare REV_A REV_B [--model digits] [--rounds 1] [--quick] [--keep]

Each revision is checked out with `git worktree add` under /tmp and served from there with this
checkout's .venv (a worktree's own `serving`, `config` and `manage.py` come first on the path; checked
before measuring), from its own fresh data dir (its migrations, its `build_demo_models`). The sweep
itself is this checkout's (bench.run's capacity sweep: open-loop, p99 < 300 ms, < 0.1% errors), so
only the server differs. With `--rounds N` the revisions alternate A B A B ...; the median of each
is compared. Prints both figures and B / A.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import loadgen
from bench.report import COMPARE_END, COMPARE_START, Settings, splice_section
from bench.run import digits_body, mlp_body, sweep
from bench.server import ROOT, Server, free_port, manage, say, unbind_quota, use_key


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


class Checkout:
    """A detached worktree of `rev` under /tmp with its own data dir; removed on exit unless kept."""

    def __init__(self, rev: str, keep: bool) -> None:
        self.rev, self.keep = rev, keep
        self.sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
        self.base = Path(tempfile.mkdtemp(prefix=f"ferry-compare-{self.sha[:8]}-"))
        self.tree = self.base / "tree"
        self.data = self.base / "data"

    def __enter__(self) -> Checkout:
        say(f"{self.rev} = {self.sha[:12]}: git worktree add {self.tree}")
        git("worktree", "add", "--detach", str(self.tree), self.sha)
        self.data.mkdir()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.keep:
            say(f"kept {self.base}")
            return
        try:
            git("worktree", "remove", "--force", str(self.tree))
        except subprocess.CalledProcessError as err:
            say(f"git worktree remove failed: {err.stderr.strip()}")
        shutil.rmtree(self.base, ignore_errors=True)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}  # embedded mode
        # The editable install's finder maps Ferry's packages to this checkout, and it answers for any module
        # a worktree lacks: an older revision's `rollout` would find this checkout's `rollout.migrations`.
        # A sitecustomize (run after the .pth files that install the finder) takes it out.
        hook = self.base / "no-editable"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(
            "import sys\n"
            "def keep(f):\n"
            "    return not getattr(f, '__module__', '').startswith('__editable__')\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if keep(f)]\n"
            "sys.path_hooks[:] = [h for h in sys.path_hooks if keep(h)]\n"
        )
        path = os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH", "")) if p)
        return {**env, "FERRY_DATA_DIR": str(self.data), "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}

    def check_imports(self) -> None:
        """The worktree's own code must be what runs, not the editable install's checkout."""
        code = (
            "import serving, config, importlib.util as u; print(serving.__file__); print(config.__file__);"
            " [print(s.origin) for s in [u.find_spec('rollout.migrations')] if s]"
        )
        out = subprocess.run([sys.executable, "-c", code], cwd=self.tree, env=self.env(), check=True,
                             capture_output=True, text=True).stdout.split()  # fmt: skip
        for path in out:
            if not Path(path).resolve().is_relative_to(self.tree.resolve()):
                raise RuntimeError(f"{self.rev}: {path} is imported from outside its worktree {self.tree}")

    def prepare(self) -> None:
        self.check_imports()
        manage(["migrate", "--noinput", "-v0"], self.env(), cwd=self.tree)
        manage(["build_demo_models"], self.env(), cwd=self.tree)
        # Its demo API key, where the revision has API keys (older ones write none and need none).
        manage(["ensure_demo_user"], self.env(), cwd=self.tree)
        unbind_quota(self.env(), cwd=self.tree)


def measure(co: Checkout, model: str, s: Settings) -> float | None:
    body = mlp_body() if model.startswith("wide") else digits_body()
    use_key(co.data)  # this revision's key (or none) on every request of the sweep
    with Server(co.env(), free_port(), co.base / "server.log", cwd=co.tree) as server:
        server.wait_ready((model,))
        result = loadgen.arun(sweep(server.base, model, body, s))
    for step in result.steps:  # what failed each failing step: a shed (503), a deadline (504) or a timeout
        if step.errors:
            kinds = {**{f"HTTP {k}": v for k, v in step.errors_by_status.items()}, **step.client_errors_by_kind}
            say(
                f"{co.rev}: {step.offered_rate:,.1f} req/s: {step.errors} errors of {step.count}"
                f" ({', '.join(f'{k} x{v}' for k, v in kinds.items())}), p99 {step.p99_ms:.1f} ms"
            )
    if result.best is None:
        say(f"{co.rev}: no rate passed ({result.error or 'see the steps above'})")
        return None
    say(f"{co.rev}: {model} {result.best.achieved_rate:,.1f} req/s at p99 {result.best.p99_ms:.1f} ms")
    return result.best.achieved_rate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("rev_a")
    p.add_argument("rev_b")
    p.add_argument("--model", default="digits", help="a demo model both revisions build (default digits)")
    p.add_argument("--rounds", type=int, default=1, help="alternate A and B this many times each")
    p.add_argument("--quick", action="store_true", help="short steps: a smoke run, not numbers to publish")
    p.add_argument("--keep", action="store_true", help="keep the worktrees and data dirs under /tmp")
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    p.add_argument(
        "--record",
        type=Path,
        help="write the result into this report's compare section "
        "(e.g. docs/benchmarks/revisions.md; `make bench` leaves that page alone)",
    )
    a = p.parse_args(argv)
    s = Settings.for_mode(a.quick)
    figures: dict[str, list[float | None]] = {"a": [], "b": []}
    with Checkout(a.rev_a, a.keep) as co_a, Checkout(a.rev_b, a.keep) as co_b:
        for co in (co_a, co_b):
            say(f"===== preparing {co.rev} ({co.sha[:12]}) =====")
            co.prepare()
        for rnd in range(a.rounds):
            for key, co in (("a", co_a), ("b", co_b)):
                say(f"===== round {rnd + 1}/{a.rounds}: {co.rev} ({co.sha[:12]}) =====")
                try:
                    figures[key].append(measure(co, a.model, s))
                except RuntimeError as exc:  # e.g. that revision's server does not start: say so, go on
                    say(f"{co.rev}: {exc}")
                    figures[key].append(None)
        shas = {"a": co_a.sha, "b": co_b.sha}
    med = {k: statistics.median([v for v in vs if v is not None]) if any(v is not None for v in vs) else None
           for k, vs in figures.items()}  # fmt: skip
    ratio = med["b"] / med["a"] if med["a"] and med["b"] else None
    print(f"{a.model} capacity at p99 < 300 ms, < 0.1% errors{' (quick: smoke only)' if a.quick else ''}:")
    for key, rev in (("a", a.rev_a), ("b", a.rev_b)):
        runs = ", ".join("n/a" if v is None else f"{v:,.1f}" for v in figures[key])
        print(f"  {rev} ({shas[key][:12]}): {'n/a' if med[key] is None else f'{med[key]:,.1f}'} req/s  [{runs}]")
    print(f"  ratio {a.rev_b} / {a.rev_a}: {'n/a' if ratio is None else f'{ratio:.3f}'}")
    if a.json:
        doc = {"model": a.model, "quick": a.quick, "revs": {a.rev_a: shas["a"], a.rev_b: shas["b"]},
               "runs": figures, "median": med, "ratio": ratio}  # fmt: skip
        a.json.write_text(json.dumps(doc, indent=2))
    if a.record:
        record(a.record, a, shas, figures, med, ratio, " ".join(["python -m bench.compare", *(argv or sys.argv[1:])]))
    return 0 if ratio is not None else 1


def record(path: Path, a: argparse.Namespace, shas: dict[str, str], figures: dict[str, list[float | None]],
           med: dict[str, float | None], ratio: float | None, command: str) -> None:  # fmt: skip
    import datetime

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:,.1f}"

    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        COMPARE_START,
        "## Two revisions back to back",
        "",
        f"`{command}` on {when}, alternating the revisions round by round on this machine, each from a fresh data"
        f" dir, each with this checkout's open-loop sweep ({a.model}, p99 < 300 ms, < 0.1% errors). Median of the"
        " rounds:",
        "",
        "| revision | commit | req/s per round | median |",
        "|---|---|---|---|",
    ]
    for key, rev in (("a", a.rev_a), ("b", a.rev_b)):
        lines.append(f"| {rev} | {shas[key][:12]} | {', '.join(fmt(v) for v in figures[key])} | **{fmt(med[key])}** |")
    lines += ["", f"Ratio {a.rev_b} / {a.rev_a}: **{'n/a' if ratio is None else f'{ratio:.3f}'}**.", "", COMPARE_END]
    splice_section(path, COMPARE_START, COMPARE_END, "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
