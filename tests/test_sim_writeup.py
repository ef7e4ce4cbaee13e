"""docs/simulation.md's inputs table labels each scaling input production's default or an assumption."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import yaml

import serving.policies.placement as placement
from autoscaling.models import ScalingPolicy
from serving.models import ModelVersion
from serving.policies.autoscale import Autoscaler
from sim import scenario as scenarios
from sim.writeup import PRODUCTION, _assumptions


def _setting(name: str) -> int:
    """The default config/settings.py gives a setting (the environment of the tests may set another)."""
    tree = ast.parse((Path(__file__).resolve().parents[1] / "config" / "settings.py").read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == name
        ):
            return ast.literal_eval(node.args[1])
    raise LookupError(name)


def _default(model: type, field: str) -> float:
    return model._meta.get_field(field).default  # type: ignore[attr-defined]


def _autoscaler(parameter: str) -> float:
    return inspect.signature(Autoscaler.__init__).parameters[parameter].default


# Where each value in sim.writeup.PRODUCTION comes from, read from the code that holds it, in the Scaling field's units.
SOURCES = {
    "FERRY_AUTOSCALE_SECONDS": lambda: _setting("FERRY_AUTOSCALE_SECONDS"),
    "ScalingPolicy.target_utilisation": lambda: _default(ScalingPolicy, "target_utilisation"),
    "ScalingPolicy.warm_pool": lambda: _default(ScalingPolicy, "warm_pool"),
    "FERRY_LATENCY_BUDGET_MS": lambda: _setting("FERRY_LATENCY_BUDGET_MS") / 1000,
    "FERRY_LATENCY_BUDGET_MS: the default and the cap": lambda: _setting("FERRY_LATENCY_BUDGET_MS") / 1000,
    "ScalingPolicy.cool_down_seconds": lambda: _default(ScalingPolicy, "cool_down_seconds"),
    "FERRY_AUTOSCALE_SCHEDULING_DELAY_S": lambda: _setting("FERRY_AUTOSCALE_SCHEDULING_DELAY_S"),
    "ModelVersion.max_queue_size": lambda: _default(ModelVersion, "max_queue_size"),
    "placement.MAX_LOAD": lambda: placement.MAX_LOAD,
    "placement.CONSOLIDATE_BELOW": lambda: placement.CONSOLIDATE_BELOW,
    "FERRY_CONSOLIDATE_HOLD_SECONDS": lambda: _setting("FERRY_CONSOLIDATE_HOLD_SECONDS"),
    "FERRY_CONSOLIDATE_MOVES": lambda: _setting("FERRY_CONSOLIDATE_MOVES"),
    "placement.RELIEVE_ABOVE": lambda: placement.RELIEVE_ABOVE,
    "FERRY_RELIEVE_MOVES": lambda: _setting("FERRY_RELIEVE_MOVES"),
    "Autoscaler's rise_quantile": lambda: _autoscaler("rise_quantile"),
    "Autoscaler's rise_history": lambda: _autoscaler("rise_history"),
}


def _headline() -> tuple[scenarios.Scenario, str]:
    path = next(p for p in scenarios.shipped() if p.stem == "steady-50k")
    sc = scenarios.load(path)
    # The inputs table alone: it reads the scenario, not its runs.
    return sc, "\n".join(_assumptions([{"name": sc.name, "file": path.name, "scenario": sc}]))


def test_each_production_value_is_the_one_production_sets():
    # Given the defaults the page compares scenarios with, then each is what its setting or field holds
    assert {p.where for p in PRODUCTION} == set(SOURCES)
    for p in PRODUCTION:
        assert p.value == SOURCES[p.where](), p.where


def test_every_scaling_input_the_headline_scenario_sets_is_labelled():
    # Given the headline scenario's file, then every scaling value it sets has a row that compares it
    path = next(p for p in scenarios.shipped() if p.stem == "steady-50k")
    set_there = set(yaml.safe_load(path.read_text())["scaling"])
    assert set_there <= {p.field for p in PRODUCTION}


def test_a_value_that_departs_from_production_is_an_assumption_naming_production():
    # Given the headline scenario, whose cool-down, tick and queue bound are not production's
    sc, page = _headline()
    assert (sc.scaling.cool_down, sc.scaling.tick, sc.scaling.max_queue_size) == (60, 1, 4096)
    # then the page says so, with production's value, and calls none of its scaling values "settings"
    assert (
        "| scaling: scale-in cool-down | 60 s | assumption, production: 300 s (ScalingPolicy.cool_down_seconds)" in page
    )
    assert "| scaling: autoscaling tick | 1 s | assumption, production: 5 s (FERRY_AUTOSCALE_SECONDS)" in page
    assert "| scaling: queue bound (rows per version) | 4096 | assumption, production: 1024" in page
    assert "| scaling: consolidation: moves in flight | 64 | assumption, production: 2" in page
    assert "| settings" not in page
    # and a value that is production's is labelled production's default
    assert "| scaling: target utilisation | 0.7 | production default (ScalingPolicy.target_utilisation) |" in page
