"""The stream meter reads llama-server's real event shapes (copied from the pinned server's output)."""

from __future__ import annotations

import pytest

from proxy.streams.openai import StreamMeter, count_tokens_in_body

CHUNK = b'"object":"chat.completion.chunk"}\n\n'
ROLE = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],'
    + CHUNK
)
TOKEN = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"hi"}}],' + CHUNK
EMPTY = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":""}}],' + CHUNK
FINAL = b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],' + CHUNK
USAGE = (
    b'data: {"choices":[],"object":"chat.completion.chunk","usage":{"completion_tokens":4,"prompt_tokens":25,'
    b'"total_tokens":29},"timings":{"predicted_n":4,"predicted_ms":143.0}}\n\n'
)
DONE = b"data: [DONE]\n\n"
TEXT = (
    b'data: {"choices":[{"text":",","index":0,"logprobs":null,"finish_reason":null}],'
    b'"object":"text_completion"}\n\n'
)
TEXT_LAST = (
    b'data: {"choices":[{"text":"","index":0,"finish_reason":"length"}],"object":"text_completion",'
    b'"usage":{"completion_tokens":3,"prompt_tokens":2,"total_tokens":5},"timings":{"predicted_n":3}}\n\n'
)


def test_chat_stream_first_token_tokens_and_tpot() -> None:
    m = StreamMeter()
    assert m.feed(ROLE, 1.0) is False  # the role-only chunk is not a token
    assert m.first_at is None
    assert m.feed(TOKEN, 2.0) is True
    for i, t in enumerate((2.1, 2.2, 2.3)):
        assert m.feed(TOKEN, t) is False, i
    m.feed(FINAL, 2.3)
    m.feed(USAGE, 2.31)
    m.feed(DONE, 2.32)
    assert m.first_at == 2.0
    assert m.tokens == 4  # the child's own count wins
    assert m.tpot() == pytest.approx((2.3 - 2.0) / 3)
    assert m.ttft_from(0.5) == pytest.approx(1.5)


def test_empty_content_is_not_a_first_token() -> None:
    m = StreamMeter()
    m.feed(EMPTY, 1.0)
    assert m.first_at is None


def test_completions_stream() -> None:
    m = StreamMeter()
    m.feed(TEXT, 1.0)
    m.feed(TEXT, 1.5)
    m.feed(TEXT_LAST, 2.0)
    m.feed(DONE, 2.0)
    assert m.first_at == 1.0 and m.tokens == 3


def test_counts_events_when_the_child_reports_nothing() -> None:
    m = StreamMeter()
    m.feed(ROLE + TOKEN, 1.0)  # coalesced in one read
    m.feed(TOKEN + TOKEN, 1.2)
    m.feed(DONE, 1.3)
    assert m.reported is None
    assert m.tokens >= 3


def test_usage_split_across_two_reads_is_still_found() -> None:
    m = StreamMeter()
    m.feed(TOKEN, 1.0)
    cut = USAGE.index(b"completion_tokens") + 5
    m.feed(USAGE[:cut], 1.1)
    m.feed(USAGE[cut:] + DONE, 1.2)
    assert m.tokens == 4


def test_no_tpot_for_a_single_token() -> None:
    m = StreamMeter()
    m.feed(TOKEN, 1.0)
    assert m.tpot() is None


def test_count_tokens_in_a_whole_body() -> None:
    assert count_tokens_in_body(b'{"usage":{"completion_tokens":12,"prompt_tokens":3}}') == 12
    assert count_tokens_in_body(b'{"error":{"code":400}}') == 0
