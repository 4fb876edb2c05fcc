"""Non-streamed answers assembled from llama-server's stream events (shapes from server-task.cpp)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.errors import UpstreamFailure
from proxy.streams.assemble import AnswerTooLarge, Assembler

HEAD = {
    "created": 1,
    "id": "chatcmpl-1",
    "model": "m",
    "system_fingerprint": "b1",
    "object": "chat.completion.chunk",
}


def ev(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chat(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    return ev({"choices": [{"finish_reason": finish, "index": index, "delta": delta, **extra}], **HEAD})


def test_chat_answer_with_two_choices_and_tool_calls() -> None:
    a = Assembler("chat", 1 << 20)
    stream = [
        chat(0, {"role": "assistant", "content": None}),
        chat(1, {"role": "assistant", "content": None}),
        chat(0, {"reasoning_content": "think"}),
        chat(0, {"content": "Hel"}, logprobs={"content": [{"token": "Hel"}]}),
        chat(1, {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f"}}]}),
        chat(0, {"content": "lo"}, logprobs={"content": [{"token": "lo"}]}),
        chat(1, {"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]}),
        chat(1, {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        chat(0, {}, "stop"),
        ev({"choices": [], **HEAD, "usage": {"completion_tokens": 2, "prompt_tokens": 5, "total_tokens": 7}}),
        ev(
            {
                "choices": [{"finish_reason": "tool_calls", "index": 1, "delta": {}}],
                **HEAD,
                "timings": {"n": 1},
            }
        ),
        ev({"choices": [], **HEAD, "usage": {"completion_tokens": 3, "prompt_tokens": 5, "total_tokens": 8}}),
        b"data: [DONE]\n\n",
    ]
    raw = b"".join(stream)
    for i in range(0, len(raw), 7):  # reads cut anywhere
        a.feed(raw[i : i + 7])
    status, answer = a.answer()
    assert status == 200
    assert answer["object"] == "chat.completion" and answer["id"] == "chatcmpl-1"
    first, second = answer["choices"]
    assert first == {
        "finish_reason": "stop",
        "index": 0,
        "message": {"role": "assistant", "content": "Hello", "reasoning_content": "think"},
        "logprobs": {"content": [{"token": "Hel"}, {"token": "lo"}]},
    }
    assert second["finish_reason"] == "tool_calls" and second["message"]["content"] == ""
    assert second["message"]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": '{"x":1}'}, "id": "c1"}
    ]
    assert answer["usage"] == {"completion_tokens": 5, "prompt_tokens": 10, "total_tokens": 15}
    assert answer["timings"] == {"n": 1}


def test_completion_answer() -> None:
    a = Assembler("completion", 1 << 20)
    for text in ("Once", " upon"):
        a.feed(
            ev({"choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}], "id": "c"})
        )
    a.feed(
        ev(
            {
                "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
                "id": "c",
                "usage": {"completion_tokens": 2, "prompt_tokens": 3, "total_tokens": 5},
            }
        )
    )
    status, answer = a.answer()
    assert status == 200 and answer["object"] == "text_completion"
    assert answer["choices"] == [
        {"text": "Once upon", "index": 0, "logprobs": None, "finish_reason": "length"}
    ]
    assert answer["usage"]["completion_tokens"] == 2


def test_an_error_event_becomes_the_answer() -> None:
    a = Assembler("completion", 1 << 20)
    a.feed(ev({"error": {"code": 400, "message": "bad", "type": "invalid_request_error"}}))
    assert a.answer() == (400, {"error": {"code": 400, "message": "bad", "type": "invalid_request_error"}})


def test_bounds_and_broken_streams() -> None:
    a = Assembler("completion", 100)
    with pytest.raises(AnswerTooLarge, match="limit of 100 bytes"):
        a.feed(b"data: " + b"x" * 200)
    with pytest.raises(UpstreamFailure, match="without an answer"):
        Assembler("chat", 100).answer()
    with pytest.raises(UpstreamFailure, match="not JSON"):
        Assembler("chat", 100).feed(b"data: {oops\n\n")


def test_a_verbose_childs_debugging_copy_is_kept_as_its_own_answer_has_it() -> None:
    """llama-server started verbose puts ``__verbose`` on its non-streamed answer; streamed, partial chunks
    may carry one each and the final chunk the final result's (``"stop": true``): that one is kept (the
    llama.cpp server test ``test_verbose_debug`` through llamagate)."""
    a = Assembler("completion", 1 << 20)
    partial = {"content": "Once", "stop": False, "tokens_predicted": 1}
    final = {"content": "Once upon", "stop": True, "tokens_predicted": 2, "tokens_evaluated": 3}
    a.feed(
        ev(
            {
                "choices": [{"text": "Once", "index": 0, "finish_reason": None}],
                "id": "c",
                "__verbose": partial,
            }
        )
    )
    a.feed(
        ev(
            {
                "choices": [{"text": " upon", "index": 0, "finish_reason": "length"}],
                "id": "c",
                "__verbose": final,
            }
        )
    )
    _, answer = a.answer()
    assert answer["__verbose"] == final
    plain = Assembler("completion", 1 << 20)
    plain.feed(ev({"choices": [{"text": "x", "index": 0, "finish_reason": "length"}], "id": "c"}))
    assert "__verbose" not in plain.answer()[1]
