"""Reading what an answer used, in each dialect llama-server speaks, from the bytes as they arrive; and
the usage chunk the proxy asked for, taken out again with its timings put back where they belong."""

from __future__ import annotations

import json

import pytest

from proxy.streams.formats import ANTHROPIC, NATIVE, OPENAI, RESPONSES, SILENT
from proxy.streams.usage import Usage, UsageTap


def event(obj: object, name: str | None = None) -> bytes:
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def token(text: str, index: int = 0) -> bytes:
    return event({"choices": [{"delta": {"content": text}, "finish_reason": None, "index": index}]})


def finish(index: int = 0, timings: bool = False) -> bytes:
    obj: dict[str, object] = {"choices": [{"delta": {}, "finish_reason": "stop", "index": index}]}
    if timings:
        obj["timings"] = {"cache_n": 2, "prompt_n": 3, "predicted_n": 2}
    return event(obj)


def usage_chunk(prompt: int, completion: int, cached: int, timings: bool = True) -> bytes:
    obj: dict[str, object] = {
        "choices": [],
        "usage": {
            "completion_tokens": completion,
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }
    if timings:
        obj["timings"] = {"cache_n": cached, "prompt_n": prompt - cached, "predicted_n": completion}
    return event(obj)


DONE = b"data: [DONE]\n\n"


def run(tap: UsageTap, chunks: list[bytes]) -> bytes:
    tap.start()
    out = b"".join(tap.feed(c) for c in chunks)
    return out + tap.flush()


def in_pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def test_a_stream_that_asked_for_usage_passes_unchanged_and_its_usage_is_read() -> None:
    stream = [token("Hi"), token(" there"), finish(), usage_chunk(5, 2, 2), DONE]
    tap = UsageTap(OPENAI.usage)
    assert run(tap, stream) == b"".join(stream)
    assert tap.usage == Usage(prompt=5, cached=2, completion=2, reported=True)


@pytest.mark.parametrize("size", [1, 7, 64, 10_000])
def test_the_added_usage_chunk_is_removed_and_its_timings_go_back_to_the_finishing_chunk(size: int) -> None:
    """Byte for byte what the client gets without include_usage: llama-server then puts the timings on
    the finishing chunk (tools/server/server-task.cpp: ``deltas.back()["timings"]``)."""
    asked = token("Hi") + token(" there") + finish() + usage_chunk(5, 2, 2) + DONE
    tap = UsageTap(OPENAI.usage, strip=True)
    out = run(tap, in_pieces(asked, size))
    lines = [json.loads(line[6:]) for line in out.decode().split("\n\n") if line.startswith("data: {")]
    assert [e["choices"][0].get("finish_reason") for e in lines] == [None, None, "stop"]
    assert lines[-1]["timings"] == {"cache_n": 2, "prompt_n": 3, "predicted_n": 2}
    assert not any("usage" in e for e in lines) and out.endswith(DONE)
    assert tap.usage == Usage(prompt=5, cached=2, completion=2, reported=True)


def test_several_sequences_each_with_a_usage_chunk_are_summed() -> None:
    stream = [
        token("a", 0) + token("b", 1),
        finish(0) + usage_chunk(4, 1, 0, timings=False),
        finish(1) + usage_chunk(4, 1, 4, timings=False),
        DONE,
    ]
    tap = UsageTap(OPENAI.usage, strip=True)
    out = run(tap, stream)
    assert tap.usage == Usage(prompt=8, cached=4, completion=2, reported=True)
    assert out.count(b'"finish_reason":"stop"') == 2 and b'"usage"' not in out


def test_a_stream_cut_short_has_no_reported_usage() -> None:
    tap = UsageTap(OPENAI.usage, strip=True)
    out = run(tap, [token("a"), token("b")])
    assert out == token("a") + token("b")
    assert tap.usage == Usage()


def test_progress_events_of_a_request_cut_short_tell_its_prompt() -> None:
    progress = event({"choices": [], "prompt_progress": {"total": 120, "cache": 0, "processed": 64}})
    tap = UsageTap(OPENAI.usage)
    run(tap, [progress, token("a")])
    assert tap.usage == Usage(prompt=120, reported=False)


def test_native_streams_report_the_prompt_in_tokens_evaluated_and_the_cache_in_timings() -> None:
    last = event(
        {
            "content": "",
            "stop": True,
            "tokens_predicted": 6,
            "tokens_evaluated": 11,
            "tokens_cached": 17,  # the slot's whole cache after the answer: not the cached prompt
            "timings": {"cache_n": 4, "prompt_n": 7, "predicted_n": 6},
        }
    )
    tap = UsageTap(NATIVE.usage)
    run(tap, in_pieces(event({"content": "x", "stop": False}) + last, 5))
    assert tap.usage == Usage(prompt=11, cached=4, completion=6, reported=True)
    # A whole native answer to a prompt array is a list of such objects.
    whole = UsageTap(NATIVE.usage)
    whole.whole(json.dumps([json.loads(last[6:]), json.loads(last[6:])]).encode())
    assert whole.usage == Usage(prompt=22, cached=8, completion=12, reported=True)


def test_responses_and_anthropic_streams_and_answers() -> None:
    completed = {
        "type": "response.completed",
        "response": {
            "usage": {"input_tokens": 9, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 5}}
        },
    }
    tap = UsageTap(RESPONSES.usage)
    run(
        tap,
        [event({"type": "response.output_text.delta", "delta": "x"}), event(completed, "response.completed")],
    )
    assert tap.usage == Usage(prompt=9, cached=5, completion=3, reported=True)

    start = {"type": "message_start", "message": {"usage": {"input_tokens": 4, "cache_read_input_tokens": 6}}}
    delta = {"type": "message_delta", "usage": {"output_tokens": 7}}
    tap = UsageTap(ANTHROPIC.usage)
    run(tap, [event(start, "message_start"), event(delta, "message_delta")])
    # Anthropic's input_tokens leaves the cached part out; the ledger's prompt tokens include it.
    assert tap.usage == Usage(prompt=10, cached=6, completion=7, reported=True)
    whole = UsageTap(ANTHROPIC.usage)
    whole.whole(b'{"usage":{"input_tokens":4,"cache_read_input_tokens":6,"output_tokens":7}}')
    assert whole.usage == Usage(prompt=10, cached=6, completion=7, reported=True)


def test_embeddings_report_prompt_tokens_and_native_embeddings_nothing() -> None:
    tap = UsageTap(SILENT.usage)
    tap.whole(b'{"data":[],"usage":{"prompt_tokens":12,"total_tokens":12}}')
    assert tap.usage == Usage(prompt=12, reported=True)
    tap.whole(b'[{"index":0,"embedding":[0.1]}]')
    assert tap.usage == Usage()


def test_an_assembled_answer_is_charged_its_usage_as_the_client_gets_it() -> None:
    tap = UsageTap(OPENAI.usage)
    tap.answered({"usage": {"prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": {}}})
    assert tap.usage == Usage(prompt=3, completion=4, reported=True)
