"""Every series the Grafana dashboard and the alert rules query is one llamagate actually exports, with
the labels the queries match on. A renamed series or label fails here, not on an operator's empty panel
or a silent alert."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.helpers.exposition import exported_series, full_exposition

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "llamagate-dashboard.json"
RULES = REPO / "deploy" / "prometheus" / "llamagate.rules.yml"
# Labels Prometheus adds to every scraped series; and series Prometheus itself synthesizes.
TARGET_LABELS = {"job", "instance", "exported_instance"}
SYNTHETIC = {"up"}

_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "inf", "nan",
}  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_GRAFANA_VAR = re.compile(r"\$\w+")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?")
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names matched) for every series selector in a PromQL expression."""
    text = _GROUPING.sub(" ", _GRAFANA_VAR.sub("x", expr))
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range durations
    out = []
    for match in _SELECTOR.finditer(text):
        name, braces = match.group(1), match.group(2) or ""
        following = text[match.end(1) :].lstrip()
        if name.lower() in _KEYWORDS or (following.startswith("(") and not braces):
            continue  # an operator or a function call
        out.append((name, set(_MATCHER_LABEL.findall(_STRING.sub('""', braces)))))
    return out


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", variable["query"]["query"]))
    return exprs


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str] | None]:
    import asyncio

    return exported_series(asyncio.run(full_exposition()))


def test_the_selector_parser_finds_names_and_labels() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (tenant, le) (rate(a_bucket{job="$job", tenant=~"x|y"}[5m])))'
        ' > 1.5 and on (job) b_total{route!~"/m"} == 0 or max by (x) (c)'
    )
    assert selectors(expr) == [("a_bucket", {"job", "tenant"}), ("b_total", {"route"}), ("c", set())]


@pytest.mark.parametrize(("source", "exprs"), [("dashboard", dashboard_exprs), ("rules", rule_exprs)])
def test_every_queried_series_and_label_is_exported(source: str, exprs, exported) -> None:  # type: ignore[no-untyped-def]
    used = [sel for expr in exprs() for sel in selectors(expr)]
    assert len(used) >= 8, f"{source}: suspiciously few selectors found: {used}"
    problems = []
    for name, labels in used:
        if name in SYNTHETIC:
            continue
        if name not in exported:
            problems.append(f"{name}: not exported")
            continue
        known = exported[name]
        if known is not None and labels - known - TARGET_LABELS:
            problems.append(f"{name}: labels {sorted(labels - known - TARGET_LABELS)} not on the series")
    assert not problems, f"{source}: " + "; ".join(problems)


def test_every_rule_has_a_runbook_section_in_operations_md() -> None:
    operations = (REPO / "docs" / "operations.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 _-]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in operations.splitlines()
        if line.startswith("#")
    }
    groups = yaml.safe_load(RULES.read_text())["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        runbook = rule["annotations"]["runbook"]
        path, _, anchor = runbook.partition("#")
        assert path == "docs/operations.md", rule["alert"]
        assert anchor in anchors, f"{rule['alert']}: no heading for #{anchor} in docs/operations.md"
