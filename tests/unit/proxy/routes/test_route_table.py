"""docs/api.md's two route tables are the code's table, row by row; the table is consistent with itself."""

from __future__ import annotations

import re
from pathlib import Path

from proxy.routes.build import ENDPOINTS
from proxy.routes.table import REFUSED, ROUTES
from proxy.streams.formats import ANTHROPIC, NATIVE, OPENAI, RESPONSES, SILENT

DOC = Path(__file__).resolve().parents[4] / "docs" / "api.md"
_CREDENTIALS = {"none": "none", "inference key": "inference", "admin key": "admin", "any key": "any key"}


def doc_table(marker: str) -> list[list[str]]:
    """The rows (cells stripped, backticks removed) of the first table after ``marker`` in docs/api.md."""
    lines = DOC.read_text().splitlines()
    start = lines.index(marker)
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        rows.append(cells)
    assert len(rows) > 2, f"no table after {marker}"
    return rows[2:]  # header and separator


def test_doc_served_table_is_the_code_table() -> None:
    documented = [
        (path, tuple(m.strip() for m in methods.split(",")), kind, _CREDENTIALS[cred], admission)
        for path, methods, kind, cred, admission, *_ in doc_table("<!-- route-table:served -->")
    ]
    code = [(r.path, r.methods, r.kind, r.access, "yes" if r.takes_slots else "no") for r in ROUTES]
    assert documented == code


def test_doc_refused_table_is_the_code_table() -> None:
    documented = [
        (path, tuple(m.strip() for m in methods.split(",")), reason)
        for path, methods, reason in doc_table("<!-- route-table:refused -->")
    ]
    assert documented == [(r.path, r.methods, r.reason) for r in REFUSED]


def test_a_path_is_served_once_and_refused_only_for_other_methods() -> None:
    paths = [r.path for r in ROUTES]
    assert len(paths) == len(set(paths))
    served = {r.path: set(r.methods) for r in ROUTES}
    for refused in REFUSED:
        assert not served.get(refused.path, set()) & set(refused.methods), refused.path


GENERATION = {"chat", "completions", "completion", "infill", "responses", "messages", "embeddings", "rerank"}
# Kinds whose answer may be a stream of generated tokens (embeddings and rerank never are).
STREAMING = GENERATION - {"embeddings", "rerank"}


def test_every_generation_row_has_a_stream_format_and_a_cost_and_takes_admission() -> None:
    for r in ROUTES:
        assert r.takes_slots == (r.kind in GENERATION) == (r.stream is not None) == (r.cost is not None), r
        assert r.generates == (r.kind in STREAMING), r
        assert r.assembled is None or r.generates, r
        # Generation is never open without a key; "/" stays free for the status page.
        assert r.access != "none" or r.kind in {"health", "liveness", "readiness"}
        # A segment may be a ``{name}`` parameter, on admin rows only (an operator's act on one model).
        assert r.path != "/" and re.fullmatch(r"(/([a-z0-9_\-]+|\{[a-z_]+\}))+", r.path), r.path
        assert not r.parameterized or r.access == "admin", r.path


def test_each_generation_kind_has_its_stream_format_cost_and_assembled_answer() -> None:
    # One stream format, one cost and one assembled answer per kind, whatever the alias.
    expected = {
        "chat": (OPENAI, "chat", "chat"),
        "completions": (OPENAI, "completion", "completion"),
        "completion": (NATIVE, "completion", None),  # the native answer has another shape
        "infill": (NATIVE, "completion", None),
        "responses": (RESPONSES, "chat", None),
        "messages": (ANTHROPIC, "chat", None),
        "embeddings": (SILENT, "embedding", None),
        "rerank": (SILENT, "rerank", None),
    }
    for r in ROUTES:
        if r.kind in expected:
            assert (r.stream, r.cost, r.assembled) == expected[r.kind], r.path


def test_the_routes_the_issue_asks_for_exist() -> None:
    """All of them are registered by the pinned llama-server (server.cpp at 0c1e570)."""
    paths = {r.path for r in ROUTES}
    assert {
        "/v1/responses",
        "/v1/messages",
        "/completion",
        "/infill",
        "/v1/rerank",
        "/v1/embeddings",
        "/v1/chat/completions/input_tokens",
        "/v1/responses/input_tokens",
        "/v1/messages/count_tokens",
        "/apply-template",
        "/tokenize",
        "/detokenize",
        "/props",
        "/chat/completions",
        "/completions",
        "/models",
        "/responses",
        "/embeddings",
        "/health",
    } <= paths


def test_every_row_kind_has_one_endpoint_factory_and_no_factory_is_left_over() -> None:
    """``proxy.routes.build``: generation rows go through ``Inference``; every other row's kind has its
    entry in ``ENDPOINTS`` (a missing one would fail the app's build), and no entry outlives its rows."""
    assert {spec.kind for spec in ROUTES if not spec.takes_slots} == set(ENDPOINTS)
