"""bench.profile_models writes what the simulator reads: its CPU dry run (--quick) on small shapes."""

from __future__ import annotations

import json

from bench import profile_models
from sim import profiles


def test_the_quick_run_writes_a_profile_file_the_simulator_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_DEVICE", "cpu")
    monkeypatch.setenv("FERRY_TORCH_THREADS", "1")
    out = tmp_path / "profiles.json"
    # when the script measures two of its models in its quick mode
    args = [str(out), "--quick", "--only", "wide-mlp", "bert-base", "--scratch", str(tmp_path)]
    assert profile_models.main(args) == 0
    doc = json.loads(out.read_text())
    # then the file names its command, commit and device, and each model's profile reaches its largest batch
    assert doc["command"].startswith("python -m bench.profile_models") and doc["commit"]
    assert "quick" in doc["device"] and set(doc["models"]) == {"wide-mlp", "bert-base"}
    points, source = profiles.read(out, "bert-base")
    assert sorted(points) == [1, 2, 4] and all(ms > 0 for ms in points.values())
    assert source["kind"] == "measured" and "bench.profile_models" in source["command"]
    # and the cold start was timed twice over the same artifacts: in-process, and as a node loads a replica (a
    # sandboxed runtime process forked from the zygote), which is the line a fleet reads
    cold = doc["cold_start"]
    assert "isolated_error" not in cold, cold.get("isolated_error")
    models = [p["model"] for p in cold["points"]]
    isolated = cold["isolated"]
    assert [p["model"] for p in isolated["points"]] == models
    assert all(p["seconds"] > 0 for p in isolated["points"]) and isolated["first_load_s"] > 0
    seconds, per_gb, cited = profiles.cold_start(out)
    assert (seconds, per_gb) == (isolated["fit"]["seconds"], isolated["fit"]["per_gb"])
    assert "IsolatedRuntime.load" in cited
    # and no artifact is left behind
    assert not list(tmp_path.glob("ferry-cold-start-*"))
