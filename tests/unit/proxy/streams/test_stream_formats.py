"""Each route kind's meter, fed the bytes the pinned llama-server sent (recorded from the real binary with
the demo model: /v1/responses, /v1/messages and /completion with stream=true and 4 or 3 tokens)."""

from __future__ import annotations

import json

import pytest

from proxy.errors import NotReady, UpstreamFailure
from proxy.streams.formats import ANTHROPIC, NATIVE, OPENAI, RESPONSES, StreamFormat


def _ev(name: str, data: dict[str, object]) -> bytes:
    return (
        b"event: " + name.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
    )


MSG = "msg_2Abg2gwgDU8cQd3dalH9l3hkkWwdu5Zd"
RESPONSES_STREAM = [
    _ev("response.created", {"type": "response.created", "response": {"id": "r", "status": "in_progress"}}),
    _ev("response.in_progress", {"type": "response.in_progress", "response": {"id": "r"}}),
    _ev(
        "response.output_item.added",
        {"type": "response.output_item.added", "item": {"content": [], "id": MSG, "role": "assistant"}},
    ),
    _ev(
        "response.content_part.added",
        {"type": "response.content_part.added", "item_id": MSG, "part": {"type": "output_text", "text": ""}},
    ),
    *[
        _ev("response.output_text.delta", {"type": "response.output_text.delta", "item_id": MSG, "delta": d})
        for d in ("<", "|", "im", "_")
    ],
    _ev("response.output_text.done", {"type": "response.output_text.done", "item_id": MSG, "text": "<|im_"}),
    _ev(
        "response.completed",
        {
            "type": "response.completed",
            "response": {
                "id": "r",
                "status": "completed",
                "usage": {"input_tokens": 25, "output_tokens": 4, "total_tokens": 29},
            },
            "timings": {"prompt_n": 25, "predicted_n": 4},
        },
    ),
]

ANTHROPIC_STREAM = [
    _ev(
        "message_start",
        {
            "type": "message_start",
            "message": {"content": [], "usage": {"input_tokens": 5, "output_tokens": 0}},
        },
    ),
    _ev(
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    ),
    *[
        _ev(
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}},
        )
        for t in ("<", "|", "im", "_")
    ],
    _ev("content_block_stop", {"type": "content_block_stop", "index": 0}),
    _ev(
        "message_delta",
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 4}},
    ),
    _ev("message_stop", {"type": "message_stop"}),
]

NATIVE_STREAM = [
    b'data: {"index":0,"content":"!","tokens":[236888],"stop":false,"id_slot":-1,"tokens_predicted":1}\n\n',
    b'data: {"index":0,"content":" this","tokens":[672],"stop":false,"id_slot":-1,"tokens_predicted":2}\n\n',
    b'data: {"index":0,"content":" is","tokens":[563],"stop":false,"id_slot":-1,"tokens_predicted":3}\n\n',
    b'data: {"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,"tokens_predicted":3,'
    b'"timings":{"prompt_n":2,"predicted_n":3}}\n\n',
]


@pytest.mark.parametrize(
    ("fmt", "chunks", "first_index", "tokens"),
    [
        (RESPONSES, RESPONSES_STREAM, 4, 4),
        (ANTHROPIC, ANTHROPIC_STREAM, 2, 4),
        (NATIVE, NATIVE_STREAM, 0, 3),
    ],
)
def test_first_token_and_count_from_each_format(
    fmt: StreamFormat, chunks: list[bytes], first_index: int, tokens: int
) -> None:
    meter = fmt.meter()
    firsts = [i for i, chunk in enumerate(chunks) if meter.feed(chunk, float(i))]
    assert firsts == [first_index]  # the opening events carry no token
    assert meter.ttft_from(-1.0) == first_index + 1.0
    assert meter.tokens == tokens
    assert meter.tpot() is not None and meter.tpot() > 0  # type: ignore[operator]


@pytest.mark.parametrize("fmt", [RESPONSES, ANTHROPIC])
def test_typed_events_counted_without_the_childs_total(fmt: StreamFormat) -> None:
    """A stream cut before its last event: the delta events seen are the count (not every data line)."""
    chunks = RESPONSES_STREAM[:-1] if fmt is RESPONSES else ANTHROPIC_STREAM[:-3]
    meter = fmt.meter()
    for i, chunk in enumerate(chunks):
        meter.feed(chunk, float(i))
    assert meter.tokens == 4


def test_events_arriving_together_or_split_are_measured_alike() -> None:
    whole = b"".join(RESPONSES_STREAM)
    meter = RESPONSES.meter()
    assert meter.feed(whole[: len(whole) // 2], 1.0) is True
    meter.feed(whole[len(whole) // 2 :], 2.0)
    assert meter.tokens == 4
    # The count split across two reads is still found.
    last = RESPONSES_STREAM[-1]
    cut = last.index(b'"output_tokens":') + 17
    meter = RESPONSES.meter()
    for chunk in (*RESPONSES_STREAM[:-1], last[:cut], last[cut:]):
        meter.feed(chunk, 0.0)
    assert meter.reported == 4  # type: ignore[attr-defined]


def test_whole_answers_report_their_tokens() -> None:
    assert RESPONSES.count_tokens(b'{"usage":{"input_tokens":25,"output_tokens":3,"total_tokens":28}}') == 3
    assert (
        ANTHROPIC.count_tokens(b'{"usage":{"cache_read_input_tokens":20,"input_tokens":5,"output_tokens":3}}')
        == 3
    )
    assert NATIVE.count_tokens(b'{"content":"x","tokens_predicted":7,"timings":{"predicted_n":7}}') == 7
    assert OPENAI.count_tokens(b'{"usage":{"completion_tokens":2}}') == 2


def test_anthropic_errors_in_anthropics_shape() -> None:
    event = ANTHROPIC.error_event(UpstreamFailure("llama-server closed the stream"))
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    body = json.loads(event.split(b"data: ", 1)[1])
    assert body == {
        "type": "error",
        "error": {"type": "api_error", "message": "llama-server closed the stream"},
    }
    converted = json.loads(
        ANTHROPIC.error_body(
            500, b'{"error":{"code":500,"message":"\'messages\' is required","type":"server_error"}}'
        )
    )
    assert converted == {"type": "error", "error": {"type": "api_error", "message": "'messages' is required"}}
    assert ANTHROPIC.error_body(502, b"not json") == b"not json"
    overloaded = json.loads(ANTHROPIC.error_event(NotReady("loading", 3)).split(b"data: ", 1)[1])
    assert overloaded["error"]["type"] == "overloaded_error"
    # The other formats keep llama-server's OpenAI-shaped event and pass the child's body through.
    assert RESPONSES.error_event(UpstreamFailure("x")).startswith(b'data: {"error":')
    assert OPENAI.error_body(500, b"{}") == b"{}"
