"""Prompt-cache detail removed from whole answers and streams, rewriting only the events carrying it."""

from __future__ import annotations

import json

from proxy.streams.privacy import SseRewriter, carries_detail, strip, strip_json

USAGE = {
    "completion_tokens": 2,
    "prompt_tokens": 60,
    "total_tokens": 62,
    "prompt_tokens_details": {"cached_tokens": 58},
}
TIMINGS = {"cache_n": 58, "prompt_n": 2, "prompt_ms": 61.0, "predicted_n": 2}


def test_whole_answers_lose_cache_hits_only() -> None:
    answer = {"choices": [{"text": "hi"}], "usage": USAGE, "timings": TIMINGS, "id": "x"}
    out = json.loads(strip_json(json.dumps(answer).encode()))
    assert out == {
        "choices": [{"text": "hi"}],
        "usage": {"completion_tokens": 2, "prompt_tokens": 60, "total_tokens": 62},
        "id": "x",
    }
    plain = b'{"choices":[{"text":"timings"}]}'  # a value, not a field: kept
    assert strip_json(plain) == plain
    responses = {"usage": {"input_tokens_details": {"cached_tokens": 3, "other": 1}}}
    assert strip(responses) == {"usage": {"input_tokens_details": {"other": 1}}}
    assert strip({"usage": {"cache_read_input_tokens": 5, "input_tokens": 9}}) == {
        "usage": {"input_tokens": 9}
    }


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def test_streams_are_rewritten_event_by_event() -> None:
    token = _event({"choices": [{"delta": {"content": "a"}}]})
    last = _event({"choices": [{"delta": {}, "finish_reason": "stop"}], "timings": TIMINGS})
    usage = _event({"choices": [], "usage": USAGE})
    r = SseRewriter()
    assert r.feed(token) is token  # untouched events are passed on as they came, not copied
    out = r.feed(last + usage + b"data: [DONE]\n\n") + r.flush()
    assert not carries_detail(out)
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[1][6:])["usage"] == {
        "completion_tokens": 2,
        "prompt_tokens": 60,
        "total_tokens": 62,
    }


def test_an_event_split_across_reads_is_held_until_whole() -> None:
    last = _event({"choices": [], "timings": TIMINGS})
    r = SseRewriter()
    cut = last.index(b"tim") + 2  # the marker itself is split
    assert r.feed(last[:cut]) == b""
    out = r.feed(last[cut:])
    assert out.endswith(b"\n\n") and not carries_detail(out) and b'"choices":[]' in out
    assert r.flush() == b""
