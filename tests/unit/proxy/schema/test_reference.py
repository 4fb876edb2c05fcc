"""docs/api.md lists the fields each route accepts: exactly the schema's (made by its reference module)."""

from __future__ import annotations

from pathlib import Path

from proxy.schema.reference import tables

API = Path(__file__).resolve().parents[4] / "docs" / "api.md"


def test_the_api_doc_lists_the_schema_as_it_is() -> None:
    text = API.read_text()
    start = text.index("<!-- request-schema: generated")
    start = text.index("\n", start) + 1
    end = text.index("<!-- request-schema: end -->")
    assert text[start:end] == tables(), (
        "run: python -c 'from proxy.schema.reference import tables; print(tables())'"
    )


def test_the_security_doc_lists_every_advisory_as_the_data_says() -> None:
    from proxy.schema.reference import advisories_table

    text = (API.parent / "security.md").read_text()
    start = text.index("<!-- advisories: generated")
    start = text.index("\n", start) + 1
    end = text.index("<!-- advisories: end -->")
    assert text[start:end] == advisories_table()


def test_the_security_doc_lists_every_cost_as_the_table_says() -> None:
    from proxy.schema.reference import costs_table

    text = (API.parent / "security.md").read_text()
    start = text.index("<!-- costs: generated")
    start = text.index("\n", start) + 1
    end = text.index("<!-- costs: end -->")
    assert text[start:end] == costs_table(), (
        "run: python -c 'from proxy.schema.reference import costs_table; print(costs_table())'"
    )
