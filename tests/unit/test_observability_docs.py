"""docs/observability.md's series tables and /metrics agree both ways: every exported series is
documented (an operator can look it up) and every documented series is exported (the page promises
nothing that is not there), with the type the table gives it."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

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
