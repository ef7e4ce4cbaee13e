"""bench.quota_cost against the real Redis: it measures both ways of calling the quota script and records its
section into a page."""

from __future__ import annotations

import os
from pathlib import Path

import redis

from bench import quota_cost
from serving.dataplane.gateway.quota_redis import keys_of

REDIS_URL = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def test_the_bench_records_a_row_per_requests_a_turn_and_leaves_no_keys(tmp_path: Path) -> None:
    page = tmp_path / "rate-limits.md"
    page.write_text("# Rate limits\n")
    assert quota_cost.main(["--admits", "64", "--redis-url", REDIS_URL, "--record", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Rate limits\n")
    rows = [line for line in text.splitlines() if line.startswith("| ") and line.split(" | ")[0][2:].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 4", "| 16"]
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert not client.exists(*keys_of(quota_cost.TENANT))
    finally:
        client.close()
