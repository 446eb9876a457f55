"""Issue 28 item 16b: every metric docs/grafana-dashboard.json queries exists under that name in ops/metrics.py's registry."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from tiered_progcache import TieredProgramCache, metrics  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
#: Counted by the flight's decisions (issue 27), added on another branch; the dashboard queries it already.
NOT_YET_HERE = {"tiered_progcache_flight_decisions_total"}


def _queried() -> set[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in doc["templating"]["list"] if v.get("type") == "query"]
    return {name for e in exprs for name in re.findall(r"\btiered_progcache_[a-z_]+", e)}


def _exported(tmp_path) -> set[str]:
    """The sample names the registry can give: a counter's ``_total``, a histogram's ``_bucket``/``_sum``/``_count``."""
    registry = prometheus_client.CollectorRegistry()
    with TieredProgramCache(tmp_path / "c") as cache:
        stop = metrics.register(cache, registry)
        families = list(registry.collect())
        stop()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {f.name + s for f in families for s in suffixes[f.type]}


def test_every_metric_the_dashboard_queries_exists(tmp_path):
    queried, exported = _queried(), _exported(tmp_path)
    assert len(queried) >= 10  # hit rate, saved seconds, NVRTC runs, errors, timeouts, flight decisions, ...
    absent = queried - exported
    # The flight helper's counter lands with its branch; until then skip that one name (and only while it is absent).
    assert absent - NOT_YET_HERE == set(), f"the dashboard queries metrics the registry does not export: {absent}"


def test_the_dashboard_has_the_panels_operators_look_for():
    titles = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert titles[:5] == ["Hit rate per tier", "Compile seconds saved", "NVRTC runs", "Remote errors and timeouts",
                          "Flight decisions"]  # fmt: skip
