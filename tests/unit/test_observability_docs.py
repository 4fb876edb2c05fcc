"""docs/observability.md's series tables and /metrics agree both ways: every exported series is
documented (an operator can look it up) and every documented series is exported (the page promises
nothing that is not there), with the type the table gives it."""

from __future__ import annotations

import asyncio
import re
import tempfile
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.conversations.tier import DiskTier
from proxy.metrics.proxy import ProxyMetrics
from proxy.metrics.tier import TierCollector
from proxy.source import SlotStates
from tests.helpers.exposition import full_exposition

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
# A row of a series table: | `name` | type | ...
ROW = re.compile(r"^\| `(llama(?:gate|cpp)_[a-z0-9_]+)` \| ([a-z]+)", re.M)


def exported() -> dict[str, str]:
    """Series name (counters with their ``_total``) -> type, from the complete exposition."""
    families: dict[str, str] = {}
    for family in text_string_to_metric_families(asyncio.run(full_exposition())):
        if family.name.endswith("_created"):
            continue  # prometheus-client's timestamps beside counters and histograms, documented as such
        families[family.name + ("_total" if family.type == "counter" else "")] = family.type
    return families


def documented() -> dict[str, str]:
    return dict(ROW.findall(DOC.read_text()))


def test_every_exported_series_is_documented() -> None:
    families = exported()
    assert len(families) >= 40
    missing = sorted(set(families) - set(documented()))
    assert not missing, f"not in docs/observability.md: {missing}"


def test_every_documented_series_is_exported_with_its_type() -> None:
    families, doc = exported(), documented()
    assert len(doc) >= 40  # the tables were found
    phantom = sorted(set(doc) - set(families))
    assert not phantom, f"documented in docs/observability.md but not exported: {phantom}"
    wrong = {name: (kind, families[name]) for name, kind in doc.items() if families[name] != kind}
    assert not wrong, f"documented type differs from the exported one: {wrong}"


def documented_labels() -> dict[str, set[str]]:
    """Series name -> the labels its row lists, from the tables that have a labels column."""
    out: dict[str, set[str]] = {}
    with_labels = False
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells[:2] == ["series", "type"]:
            with_labels = cells[2] == "labels"
        elif with_labels and cells and (name := re.fullmatch(r"`(llamagate_[a-z0-9_]+)`", cells[0])):
            out[name[1]] = {label.strip() for label in cells[2].split(",") if label.strip()}
    return out


def _tier_exposition() -> str:
    """The disk tier's series with one sample each (a tenant's saves, restores and refusals)."""
    tier = DiskTier("chat")
    s = tier.stats
    s.prompt_tokens["team", "disk"] = 5
    for counter in (s.saves, s.save_bytes, s.restores, s.restore_bytes, s.misses, s.evicted, s.save_failures):
        counter["team"] = 1
    s.save_seconds["team"] = s.restore_seconds["team"] = 0.1
    s.save_child_seconds["team"] = s.restore_child_seconds["team"] = 0.01
    s.refused["team", "changed"] = 1
    s.skipped["team", "one_shot"] = 1
    tier.writes.reason("a" * 32, "team")  # a first-turn state left a slot: the tenant has a return rate
    registry = CollectorRegistry()
    registry.register(TierCollector(lambda: {"chat": tier}))
    with tempfile.TemporaryDirectory() as folder:
        tier.configure(SlotStates(folder, "id", 1 << 20), 0)
        return generate_latest(registry).decode()


def exported_labels() -> dict[str, set[str]]:
    """Series name (as documented) -> the label names its samples carry (a histogram's ``le`` aside)."""
    labels: dict[str, set[str]] = {}
    # The request series of one request that went everywhere, replayed too (the full exposition has no
    # inference request).
    request = ProxyMetrics(CollectorRegistry())
    request.observe_request("team", "chat", "/v1/chat/completions", 429, 0.5, "queue_full", 0.1, 0.2, 0.01, 3)
    request.observe_replay("chat", "closed")
    request.observe_cancel("chat", "running")  # an operator cancelled it
    request.observe_usage("team", "chat", 8, 3, 4)  # and its usage, charged to the ledger
    request.observe_poison("chat", "team", "0123456789ab")  # another one killed two children
    request.observe_poison_refusal("chat", "team", "0123456789ab", "key_cooling_down")  # and its key cools
    text = asyncio.run(full_exposition()) + request.render().decode() + _tier_exposition()
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        for sample in family.samples:
            labels.setdefault(name, set()).update(k for k in sample.labels if k != "le")
    return labels


def test_every_documented_label_set_is_the_exported_one() -> None:
    doc, exported_sets = documented_labels(), exported_labels()
    assert len(doc) >= 25  # the tables with a labels column were found
    assert doc["llamagate_requests_total"] == {"tenant", "model", "route", "status"}  # the parser reads rows
    wrong = {
        name: (labels, exported_sets.get(name))
        for name, labels in doc.items()
        if exported_sets.get(name) != labels
    }
    assert not wrong, f"documented labels (left) differ from the exported ones (right): {wrong}"
    # Every series carries the served model, but the host's own memory figures, the usage ledger's
    # queue (one store for the whole daemon) and the shared limits' mode (one limiter for the daemon).
    unlabelled = sorted(name for name, labels in exported_sets.items() if "model" not in labels)
    assert [n for n in unlabelled if n.startswith(("llamagate_", "llamacpp_"))] == [
        "llamagate_cluster_leases",
        "llamagate_cluster_mode",
        "llamagate_cluster_redis_errors_total",
        "llamagate_host_memory_available_bytes",
        "llamagate_ledger_dropped_records_total",
        "llamagate_ledger_pending_records",
        "llamagate_ledger_unwritten_records_total",
        "llamagate_ledger_write_errors_total",
        "llamagate_ledger_written_records_total",
        "llamagate_memory_headroom_bytes",
    ]
