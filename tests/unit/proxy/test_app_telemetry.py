"""OpenTelemetry through the app (fake child, real OTLP/HTTP receiver): the GenAI span, its children and
the GenAI server metrics of each request; off, nothing of OpenTelemetry is imported."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.settings import TelemetrySettings, TenantSettings
from tests.fakes.fake_llama import _WORD
from tests.fakes.fake_upstream import eventually
from tests.helpers.otlp import attributes, otlp_receiver
from tests.unit.proxy.conftest import ProxyFactory

ROOT = Path(__file__).resolve().parents[3]
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "PROMPT-CANARY-otel-5e1f"}]}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def test_without_telemetry_nothing_of_it_is_imported_and_without_the_extra_all_else_works() -> None:
    # Without the extra (its imports refused here), the daemon's and the proxy's modules load and a
    # proxy without telemetry starts none. With it installed, llamagate's OpenTelemetry module is not
    # imported either (other libraries may import the SDK themselves: redis-py does, when it is there).
    script = (
        "import sys\n"
        "class NoOtel:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'opentelemetry':\n"
        "            raise ModuleNotFoundError(name)\n"
        "if sys.argv[1] == 'blocked':\n"
        "    sys.meta_path.insert(0, NoOtel())\n"
        "import supervisor.daemon.service, proxy.app, proxy.routes.inference\n"
        "from proxy.telemetry import start\n"
        "assert start(None) is None\n"
        "print('proxy.telemetry.otel' in sys.modules)\n"
    )
    for mode in ("blocked", "installed"):
        done = subprocess.run(
            [sys.executable, "-c", script, mode], cwd=ROOT, capture_output=True, text=True, check=False
        )
        assert (done.returncode, done.stdout.strip()) == (0, "False"), done.stderr


async def test_spans_and_metrics_of_a_chat_a_stream_a_refusal_and_a_continued_trace(
    proxy_factory: ProxyFactory,
) -> None:
    tenants = (
        TenantSettings("team", max_concurrency=4, max_queue=8, queue_timeout_s=10),
        TenantSettings("other", max_concurrency=1, max_queue=0, queue_timeout_s=10),
        TenantSettings("ops", max_concurrency=4, max_queue=8, queue_timeout_s=10),
    )
    with otlp_receiver() as rx:
        telemetry = TelemetrySettings(
            endpoint=rx.url,
            service_name="gate-under-test",
            resource_attributes=(("deployment.environment", "t"),),
        )
        async with proxy_factory(telemetry=telemetry, tenants=tenants) as p, p.client() as c:
            whole = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "temperature": 0.5})
            assert whole.status_code == 200
            streamed = await c.post("/v1/chat/completions", json={**CHAT, "stream": True, "seed": 7})
            assert streamed.status_code == 200
            traced = await c.post(
                "/v1/chat/completions", json=CHAT, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
            )
            assert traced.status_code == 200
            async with p.client("other") as other:
                slow = other.post("/v1/chat/completions", json={**CHAT, "fake_delay_ms": 500})
                running = asyncio.ensure_future(slow)
                await eventually(lambda: p.state.in_flight > 0)  # the first holds the tenant's one slot
                refused = await other.post("/v1/chat/completions", json=CHAT)
                assert refused.status_code == 429
                assert (await running).status_code == 200
        # The app's shutdown flushed the spans and the last metrics.
        spans = rx.spans()
        servers = [s for _, s in spans if s.kind == s.SPAN_KIND_SERVER]
        assert len(servers) == 5
        resource = spans[0][0]
        assert resource["service.name"] == "gate-under-test" and resource["deployment.environment"] == "t"
        by_id = {a["llamagate.request_id"]: (s, a) for s in servers for a in [attributes(s.attributes)]}
        span, a = by_id[whole.headers["x-request-id"]]
        assert span.name == "chat gpt-4o-mini"
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "llama.cpp"
        assert a["gen_ai.request.model"] == "gpt-4o-mini"  # as the client named it (an alias)
        assert a["gen_ai.response.model"] == whole.json()["model"] == p.lane.name  # the served model
        assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.temperature"] == 0.5
        usage = whole.json()["usage"]
        assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        # The tenant's answer hides the cached count (show_cache_details: false); the operator's
        # telemetry has the child's figure (the fake's timings say cache_n 3).
        assert "prompt_tokens_details" not in usage and a["gen_ai.usage.cache_read.input_tokens"] == 3
        assert a["gen_ai.response.id"] == whole.json()["id"]
        assert a["gen_ai.response.finish_reasons"] == [whole.json()["choices"][0]["finish_reason"]]
        assert a["llamagate.tenant"] == "team" and a["llamagate.key_id"] == p.entries["user"].key_id
        assert a["http.response.status_code"] == 200 and "error.type" not in a
        children = {s.name: s for _, s in spans if s.parent_span_id == span.span_id}
        assert set(children) == {"llamagate.admission", "llamagate.prefill", "llamagate.decode"}
        assert (
            children["llamagate.admission"].end_time_unix_nano
            <= children["llamagate.prefill"].start_time_unix_nano + 1
        )
        assert span.start_time_unix_nano <= children["llamagate.admission"].start_time_unix_nano
        assert children["llamagate.decode"].end_time_unix_nano <= span.end_time_unix_nano

        _, a = by_id[streamed.headers["x-request-id"]]
        assert a["gen_ai.request.seed"] == 7
        assert (
            a["gen_ai.response.finish_reasons"] == ["length"] and a["gen_ai.response.id"] == "chatcmpl-fake"
        )
        assert a["gen_ai.usage.output_tokens"] > 0

        span, a = by_id[traced.headers["x-request-id"]]
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID

        span, a = by_id[refused.headers["x-request-id"]]
        assert a["http.response.status_code"] == 429 and a["error.type"] == "queue_full"
        assert [e.name for e in span.events] == ["llamagate.refused"]
        assert attributes(span.events[0].attributes)["llamagate.refusal.reason"] == "queue_full"
        assert span.status.code == span.status.STATUS_CODE_ERROR

        for name in ("gen_ai.server.request.duration", "gen_ai.server.time_to_first_token"):
            (metric,) = rx.metric(name)[-1:]
            assert metric.unit == "s"
        duration = rx.points("gen_ai.server.request.duration")
        last = {json.dumps(attributes(p.attributes), sort_keys=True): p for p in duration}
        ok = [p for k, p in last.items() if "error.type" not in k]
        assert sum(p.count for p in ok) == 4
        assert list(ok[0].explicit_bounds)[:3] == [0.01, 0.02, 0.04]
        refusals = [p for k, p in last.items() if '"error.type": "queue_full"' in k]
        assert [p.count for p in refusals] == [1]
        ttft = rx.points("gen_ai.server.time_to_first_token")
        assert list(ttft[-1].explicit_bounds)[:3] == [0.001, 0.005, 0.01]
        assert list(rx.points("gen_ai.server.time_per_output_token")[-1].explicit_bounds)[:2] == [0.01, 0.025]
        tokens = {
            attributes(p.attributes)["gen_ai.token.type"] for p in rx.points("gen_ai.client.token.usage")
        }
        assert tokens == {"input", "output"}
        answer = whole.json()["choices"][0]["message"]["content"]
        assert answer == " ".join([_WORD] * 4)
        for body in rx.bodies:
            assert b"PROMPT-CANARY" not in body and p.keys["user"].encode() not in body
            assert answer.encode() not in body  # the answer's text: never exported


@pytest.mark.parametrize("missing", [("opentelemetry.nothing_here",)])
def test_telemetry_without_the_extra_is_a_config_error_naming_it(
    missing: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    from supervisor.config import rules
    from supervisor.config.load import parse_config
    from supervisor.errors import ConfigError

    monkeypatch.setattr(rules, "_OTEL_MODULES", missing)
    with pytest.raises(
        ConfigError, match=r"telemetry: needs the otel extra \(pip install 'llamagate\[otel\]'\)"
    ):
        parse_config("telemetry: {endpoint: 'http://127.0.0.1:4318'}")
    assert parse_config("telemetry: {enabled: false}").telemetry is not None  # off: no extra needed


async def test_a_replayed_request_has_a_replay_event_and_the_final_attempts_figures(
    proxy_factory: ProxyFactory,
) -> None:
    from tests.unit.proxy.routes.test_replay import CHAT as SHORT
    from tests.unit.proxy.routes.test_replay import dies, next_child, waiting

    with otlp_receiver() as rx:
        async with proxy_factory(telemetry=TelemetrySettings(endpoint=rx.url)) as p, p.client() as c:
            dies(p, at_token=2)  # killed after two tokens: the client has seen nothing
            task = asyncio.ensure_future(c.post("/v1/chat/completions", json=SHORT))
            await eventually(waiting(p), 10)
            async with next_child(p):
                r = await asyncio.wait_for(task, 10)
                assert r.status_code == 200
        (span,) = [s for _, s in rx.spans() if s.kind == s.SPAN_KIND_SERVER]
        a = attributes(span.attributes)
        assert a["llamagate.attempts"] == 2 and "error.type" not in a
        assert a["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"] == 4
        (event,) = span.events
        assert event.name == "llamagate.replay"
        assert attributes(event.attributes)["llamagate.replay.reason"] == "closed"
        assert span.start_time_unix_nano < event.time_unix_nano < span.end_time_unix_nano


async def test_a_failing_recorder_leaves_the_answer_alone_and_says_so(
    proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with otlp_receiver() as rx:
        async with proxy_factory(telemetry=TelemetrySettings(endpoint=rx.url)) as p, p.client() as c:
            assert p.state.telemetry is not None

            def broken(*_: object) -> None:
                raise RuntimeError("exporter state broken")

            monkeypatch.setattr(p.state.telemetry, "record", broken)
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.json()["choices"]
    assert "OpenTelemetry: recording a request failed" in caplog.text
