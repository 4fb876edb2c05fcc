"""Reading what an answer used, in each dialect llama-server speaks: a stream through its own meter (the
chunks that carry the child's figures are kept on the way and read once it is over), a whole answer,
and the proxy's assembled one."""

from __future__ import annotations

import json

from proxy.streams.formats import ANTHROPIC, NATIVE, OPENAI, RESPONSES, SILENT, StreamFormat
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


def run(tap: UsageTap, chunks: list[bytes], fmt: StreamFormat = OPENAI) -> Usage:
    """A stream as the relay sees it: each chunk through the format's meter; then what the tap reads."""
    meter = fmt.meter()
    for i, c in enumerate(chunks):
        meter.feed(c, float(i))
    tap.start()
    return tap.result(meter.reports)


def test_a_stream_that_asked_for_usage_is_read_from_its_usage_chunk() -> None:
    stream = [token("Hi"), token(" there"), finish(), usage_chunk(5, 2, 2), DONE]
    assert run(UsageTap(OPENAI.usage), stream) == Usage(5, 2, 2, reported=True)
    # Several events in one read, as llama-server writes a result's last events together.
    assert run(UsageTap(OPENAI.usage), [b"".join(stream)]) == Usage(5, 2, 2, reported=True)


def test_a_stream_that_did_not_is_read_from_the_timings_of_its_last_chunk() -> None:
    """``cache_n + prompt_n`` is the prompt, ``cache_n`` its cached part, ``predicted_n`` the completion:
    the counters llama-server's usage is made of (proxy.streams.usage says where)."""
    stream = [token("Hi"), token(" there"), finish(timings=True), DONE]
    assert run(UsageTap(OPENAI.usage), stream) == Usage(5, 2, 2, reported=True)
    # An answer with no text at all (its first token an end of generation) still reports its prompt.
    assert run(UsageTap(OPENAI.usage), [finish(timings=True), DONE]) == Usage(5, 2, 2, reported=True)


def test_a_report_cut_across_two_reads_after_its_marker_is_put_together() -> None:
    last = finish(timings=True)
    cut = last.index(b'"timings"') + 12
    stream = [token("Hi"), last[:cut], last[cut:], DONE]
    assert run(UsageTap(OPENAI.usage), stream) == Usage(5, 2, 2, reported=True)


def test_usage_wins_over_the_timings_on_the_same_chunk() -> None:
    # With include_usage, llama-server puts the timings on the usage chunk: counted once.
    assert run(UsageTap(OPENAI.usage), [finish(), usage_chunk(5, 2, 2), DONE]) == Usage(
        5, 2, 2, reported=True
    )


def test_several_sequences_are_summed_and_per_token_timings_count_once_each() -> None:
    with_usage = [finish(0) + usage_chunk(4, 1, 0, timings=False), finish(1) + usage_chunk(4, 1, 4), DONE]
    assert run(UsageTap(OPENAI.usage), with_usage) == Usage(prompt=8, cached=4, completion=2, reported=True)
    # timings_per_token: every chunk of a sequence has its running timings; the last ones count.
    running = [
        event(
            {
                "choices": [{"delta": {"content": "a"}, "index": i}],
                "timings": {"prompt_n": 3, "cache_n": 1, "predicted_n": n},
            }
        )
        for n in (1, 2, 3)
        for i in (0, 1)
    ]
    assert run(UsageTap(OPENAI.usage), running) == Usage(prompt=8, cached=2, completion=6, reported=True)


def test_a_stream_cut_short_has_no_reported_usage() -> None:
    assert run(UsageTap(OPENAI.usage), [token("a"), token("b")]) == Usage()


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
    assert run(UsageTap(NATIVE.usage), [event({"content": "x", "stop": False}), last], NATIVE) == Usage(
        11, 4, 6, True
    )
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
    text = event({"type": "response.output_text.delta", "delta": "x"}, "response.output_text.delta")
    got = run(UsageTap(RESPONSES.usage), [text, event(completed, "response.completed")], RESPONSES)
    assert got == Usage(prompt=9, cached=5, completion=3, reported=True)

    # As llama-server's message_start: output_tokens 0 beside the input (server-task.cpp).
    usage = {"input_tokens": 4, "cache_read_input_tokens": 6, "output_tokens": 0}
    start = {"type": "message_start", "message": {"usage": usage}}
    delta = {"type": "message_delta", "usage": {"output_tokens": 7}}
    chunks = [event(start, "message_start"), event(delta, "message_delta")]
    got = run(UsageTap(ANTHROPIC.usage), chunks, ANTHROPIC)
    # Anthropic's input_tokens leaves the cached part out; the ledger's prompt tokens include it.
    assert got == Usage(prompt=10, cached=6, completion=7, reported=True)
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


def test_timings_are_read_in_llama_servers_order_and_in_any_other() -> None:
    """llama-server writes cache_n, prompt_n, the prompt's other figures, then predicted_n (one search
    finds the three); another order (a sorted dump) is read figure by figure, to the same usage."""
    ordered = {"cache_n": 2, "prompt_n": 3, "prompt_ms": 1.5, "predicted_n": 4, "predicted_ms": 9.0}
    other = dict(sorted(ordered.items()))  # cache_n, predicted_ms, predicted_n, prompt_ms, prompt_n
    for timings in (ordered, other):
        last = event({"choices": [{"delta": {}, "finish_reason": "stop", "index": 0}], "timings": timings})
        got = run(UsageTap(OPENAI.usage), [token("Hi"), last, DONE])
        assert got == Usage(prompt=5, cached=2, completion=4, reported=True), timings


def test_the_answers_id_and_finish_reasons_are_read_in_each_dialect() -> None:
    """For OpenTelemetry: gen_ai.response.id and gen_ai.response.finish_reasons."""
    last = event(
        {
            "choices": [{"delta": {}, "finish_reason": "length", "index": 0}],
            "id": "chatcmpl-abc",
            "timings": {"cache_n": 2, "prompt_n": 3, "predicted_n": 2},
        }
    )
    got = run(UsageTap(OPENAI.usage), [token("Hi"), last, DONE])
    assert (got.response_id, got.finish_reasons) == ("chatcmpl-abc", ["length"])
    two = run(UsageTap(OPENAI.usage), [finish(0, timings=True) + finish(1, timings=True), DONE])
    assert two.finish_reasons == ["stop", "stop"]  # one per sequence

    start = {
        "type": "message_start",
        "message": {"id": "msg_1", "usage": {"input_tokens": 4, "output_tokens": 0}},
    }
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 7}}
    got = run(
        UsageTap(ANTHROPIC.usage), [event(start, "message_start"), event(delta, "message_delta")], ANTHROPIC
    )
    assert (got.response_id, got.finish_reasons) == ("msg_1", ["end_turn"])

    completed = {
        "type": "response.completed",
        "response": {"id": "resp_9", "status": "completed", "usage": {"input_tokens": 2, "output_tokens": 1}},
    }
    got = run(UsageTap(RESPONSES.usage), [event(completed, "response.completed")], RESPONSES)
    assert (got.response_id, got.finish_reasons) == ("resp_9", ["completed"])

    native = event(  # as llama-server ends a native stream: its figures and timings
        {
            "stop": True,
            "stop_type": "eos",
            "tokens_evaluated": 3,
            "tokens_predicted": 1,
            "timings": {"cache_n": 0},
        }
    )
    got = run(UsageTap(NATIVE.usage), [event({"content": "x", "stop": False}), native], NATIVE)
    assert (got.response_id, got.finish_reasons) == (None, ["eos"])

    whole = UsageTap(OPENAI.usage)
    whole.answered({"id": "chatcmpl-w", "choices": [{"finish_reason": "stop", "index": 0}], "usage": {}})
    assert (whole.result().response_id, whole.result().finish_reasons) == ("chatcmpl-w", ["stop"])
