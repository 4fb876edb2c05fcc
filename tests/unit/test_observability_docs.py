"""docs/observability.md names every series /metrics exports, so an operator can look any of them up."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.exposition import full_exposition

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


def test_every_exported_series_is_documented() -> None:
    exposition = asyncio.run(full_exposition())
    documented = set(re.findall(r"`([a-z_:]+)`", DOC.read_text()))
    families = set()
    for family in text_string_to_metric_families(exposition):
        if family.name.endswith("_created"):
            continue  # prometheus-client's timestamps beside counters and histograms, documented as such
        families.add(family.name + ("_total" if family.type == "counter" else ""))
    assert len(families) >= 40
    missing = sorted(families - documented)
    assert not missing, f"not in docs/observability.md: {missing}"
