"""The per-request JSONL record: round trip, schema, and clear errors on foreign files."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest

from supervisor.bench.records import (
    RECORD_SCHEMA,
    RequestRecord,
    ServerTimings,
    read_records,
    write_record,
    write_records,
)
from supervisor.errors import UsageError

FULL = RequestRecord(
    seq=3,
    warmup=False,
    prompt_id="gen:512:3",
    outcome="ok",
    t_submit=1.0,
    t_send=1.001,
    t_first_content=1.3,
    t_last_content=2.2,
    t_end=2.21,
    ttft_ms=300.0,
    tpot_ms=29.0,
    e2e_ms=1210.0,
    prompt_tokens=512,
    completion_tokens=32,
    content_events=32,
    status=200,
    error=None,
    retry_after_s=None,
    met_ttft=True,
    met_tpot=True,
    met_gates=True,
    server=ServerTimings(prompt_n=512, prompt_ms=250.0, predicted_n=32, predicted_ms=880.0, cache_n=0),
)
REJECTED = RequestRecord(
    seq=4,
    warmup=False,
    prompt_id="builtin:1",
    outcome="rejected",
    t_submit=1.5,
    t_send=1.5,
    t_end=1.51,
    e2e_ms=10.0,
    status=429,
    error="queue full",
    retry_after_s=2.0,
    met_ttft=False,
    met_tpot=False,
    met_gates=False,
)


@pytest.mark.parametrize("record", [FULL, REJECTED])
def test_round_trip(record: RequestRecord) -> None:
    assert RequestRecord.from_dict(json.loads(record.to_json())) == record


def test_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    write_records(path, [FULL, REJECTED])
    assert read_records(path) == [FULL, REJECTED]


def test_write_record_is_one_line_and_flushed() -> None:
    stream = io.StringIO()
    write_record(stream, FULL)
    text = stream.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1


def test_every_field_is_written() -> None:
    data = json.loads(FULL.to_json())
    assert set(data) == {f.name for f in dataclasses.fields(RequestRecord)}
    assert data["schema"] == RECORD_SCHEMA
    for name in ("t_submit", "t_send", "t_first_content", "t_end", "ttft_ms", "tpot_ms", "e2e_ms"):
        assert isinstance(data[name], float)
    assert data["server"]["prompt_n"] == 512


def test_flags_follow_outcome() -> None:
    assert FULL.completed and not FULL.rejected and not FULL.failed
    assert REJECTED.rejected and not REJECTED.completed
    for outcome in ("failed", "timeout", "cancelled"):
        assert dataclasses.replace(REJECTED, outcome=outcome).failed  # type: ignore[arg-type]


def test_wrong_schema_is_refused() -> None:
    data = json.loads(FULL.to_json())
    data["schema"] = "something/9"
    with pytest.raises(ValueError, match="schema"):
        RequestRecord.from_dict(data)


def test_unknown_field_is_refused() -> None:
    data = json.loads(FULL.to_json())
    data["prompt_text"] = "secret"
    with pytest.raises(ValueError, match="prompt_text"):
        RequestRecord.from_dict(data)


def test_unknown_outcome_is_refused() -> None:
    data = json.loads(FULL.to_json())
    data["outcome"] = "meh"
    with pytest.raises(ValueError, match="outcome"):
        RequestRecord.from_dict(data)


def test_missing_required_field_is_refused() -> None:
    data = json.loads(FULL.to_json())
    del data["seq"]
    with pytest.raises(ValueError, match="seq"):
        RequestRecord.from_dict(data)


def test_bad_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text(FULL.to_json() + "\n\n" + '{"schema": "nope"}\n', encoding="utf-8")
    with pytest.raises(UsageError, match=r"records\.jsonl:3"):
        read_records(path)
