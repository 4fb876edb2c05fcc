"""OpenTelemetry end to end: the daemon with the otel extra and a ``telemetry:`` section, the real child,
the OpenAI SDK as the client and a real OTLP/HTTP receiver on loopback, decoded with opentelemetry-proto."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.helpers.otlp import Receiver, attributes, otlp_receiver
from tests.integration.conftest import DaemonFactory, wait_until

pytestmark = pytest.mark.integration

PROMPT = "PROMPT-CANARY-9d2c: say hello"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as rx:
        yield rx


def _server_spans(rx: Receiver) -> dict[str, tuple[Any, dict[str, Any]]]:
    out = {}
    for _, span in rx.spans():
        if span.kind == span.SPAN_KIND_SERVER:
            a = attributes(span.attributes)
            out[a["llamagate.request_id"]] = (span, a)
    return out


def test_chat_stream_refusal_and_traceparent_are_exported_without_text(
    daemon_factory: DaemonFactory, receiver: Receiver
) -> None:
    d = daemon_factory(
        {
            "telemetry": {"endpoint": receiver.url, "metrics_interval_s": 1, "service_name": "llamagate-e2e"},
            # The fourth request of the minute is refused: a 429 the trace must show.
            "tenants": [
                {
                    "name": "default",
                    "max_concurrency": 2,
                    "max_queue": 8,
                    "budgets": {"requests_per_minute": 3},
                }
            ],
        }
    )
    client = OpenAI(base_url=f"{d.base_url}/v1", api_key=d.inference_key, max_retries=0, timeout=300)
    messages: Any = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct", messages=messages, max_tokens=12, temperature=0.0, seed=3
    )
    answer = whole.parse()
    texts = [answer.choices[0].message.content or ""]
    stream = client.chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct", messages=messages, max_tokens=12, stream=True
    )
    texts.append("".join(c.choices[0].delta.content or "" for c in stream.parse() if c.choices))
    traced = client.chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct",
        messages=messages,
        max_tokens=4,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
    )
    refused = httpx.post(
        f"{d.base_url}/v1/chat/completions",
        headers={"authorization": f"Bearer {d.inference_key}"},
        json={"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 4},
        timeout=30,
    )
    assert refused.status_code == 429

    # Metrics every second; spans in the batch processor's time (5 s), or at the stop: wait for both.
    ids = [r.headers["x-request-id"] for r in (whole, stream, traced, refused)]
    wait_until(lambda: set(ids) <= set(_server_spans(receiver)), "the four requests' spans", 60)
    wait_until(
        lambda: sum(p.count for p in receiver.points("gen_ai.server.request.duration")[-2:]) >= 1,
        "the duration histogram",
        30,
    )
    assert d.stop() == 0  # the last metrics are flushed at the stop
    spans = _server_spans(receiver)

    span, a = spans[ids[0]]
    assert span.name == "chat smollm2-135m-instruct"
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "llama.cpp"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "smollm2-135m-instruct"
    assert a["gen_ai.request.max_tokens"] == 12 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.seed"] == 3
    assert a["gen_ai.response.id"] == answer.id
    assert a["gen_ai.response.finish_reasons"] == [answer.choices[0].finish_reason]
    assert answer.usage is not None
    assert a["gen_ai.usage.input_tokens"] == answer.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens
    assert isinstance(a["gen_ai.usage.cache_read.input_tokens"], int)
    assert a["llamagate.tenant"] == "default" and a["llamagate.key_id"]
    assert d.inference_key not in json.dumps(a)
    children = {s.name for _, s in receiver.spans() if s.parent_span_id == span.span_id}
    assert children == {"llamagate.admission", "llamagate.prefill", "llamagate.decode"}

    _, a = spans[ids[1]]  # the stream: usage from the child's timings, finish reason from its last chunk
    assert a["gen_ai.response.finish_reasons"] in (["stop"], ["length"])
    assert a["gen_ai.usage.output_tokens"] > 0 and a["gen_ai.usage.input_tokens"] > 0
    assert str(a["gen_ai.response.id"]).startswith("chatcmpl-")

    span, _ = spans[ids[2]]
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID

    span, a = spans[ids[3]]
    assert a["http.response.status_code"] == 429 and a["error.type"] == "requests_per_minute"
    (event,) = span.events
    assert event.name == "llamagate.refused"
    assert attributes(event.attributes)["llamagate.refusal.reason"] == "requests_per_minute"

    for name in (
        "gen_ai.server.request.duration",
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
        "gen_ai.client.token.usage",
    ):
        assert receiver.metric(name), f"no {name} exported"
    for point in receiver.points("gen_ai.server.time_to_first_token"):
        assert attributes(point.attributes)["gen_ai.request.model"] == "smollm2-135m-instruct"
    resource = receiver.spans()[0][0]
    assert resource["service.name"] == "llamagate-e2e"

    for body in receiver.bodies:
        assert b"PROMPT-CANARY" not in body
        for text in texts:
            if len(text.strip()) >= 8:
                assert text.strip().encode() not in body
