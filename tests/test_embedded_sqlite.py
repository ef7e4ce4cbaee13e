"""Embedded mode's SQLite takes concurrent writers in turn (config/settings.py): two transactions that each read and
then write, at once, both commit. With SQLite's default (deferred) transactions the second writer is refused at
once with "database is locked", which an admin's approval met in CI while the demo's tasks were writing.

Run in a process of its own: the suite's settings are PostgreSQL's, and these are what `make run` gets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TWO_WRITERS = """
import threading
import django
from django.db import connection, connections, transaction
django.setup()

with connection.cursor() as c:
    c.execute("CREATE TABLE IF NOT EXISTS t (n INTEGER)")
connection.close()
both_read = threading.Barrier(2)
errors = []

def writer(n):
    try:
        with transaction.atomic():
            with connection.cursor() as c:
                c.execute("SELECT COUNT(*) FROM t")
                try:
                    # each has read before either writes (deferred: both hold a read lock); under IMMEDIATE the other
                    # waits at its BEGIN meanwhile, within the settings' 10 s busy timeout
                    both_read.wait(timeout=3)
                except threading.BrokenBarrierError:
                    pass  # the other waits for the write lock at its BEGIN: it cannot have read yet
                c.execute("INSERT INTO t VALUES (%s)", [n])
    except Exception as exc:
        errors.append(repr(exc))
    finally:
        connections.close_all()

threads = [threading.Thread(target=writer, args=(n,)) for n in (1, 2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with connection.cursor() as c:
    c.execute("SELECT COUNT(*) FROM t")
    rows = c.fetchone()[0]
    c.execute("PRAGMA journal_mode")
    mode = c.fetchone()[0]
print(connection.vendor, rows, mode, errors)
"""


def run(tmp_path: Path, *, deferred: bool = False) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_", "FERRY_", "REDIS_URL"))}
    env |= {"FERRY_DATA_DIR": str(tmp_path), "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONPATH": str(ROOT)}
    script = TWO_WRITERS
    if deferred:  # SQLite's default, for contrast: what the settings were before
        script = script.replace(
            "django.setup()\n", 'django.setup()\nconnections.settings["default"]["OPTIONS"].pop("transaction_mode")\n'
        )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_two_transactions_that_read_then_write_at_once_both_commit(tmp_path: Path) -> None:
    assert run(tmp_path) == "sqlite 2 wal []"


def test_with_deferred_transactions_the_second_writer_is_refused_at_once(tmp_path: Path) -> None:
    line = run(tmp_path, deferred=True)
    assert line.startswith("sqlite 1 wal ") and "database is locked" in line, line
