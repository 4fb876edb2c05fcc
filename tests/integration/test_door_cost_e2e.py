"""Issue 54's shapes, end to end with the real daemon, child and model: values whose cost would hold the
child's one server loop for seconds to minutes are refused at the door, from an inference key, on every
route that reaches them.

- 20,000 DRY breakers of 100 characters (bare llama-server: about 13 minutes of a held loop);
- ``logit_bias`` over the whole vocabulary;
- 100,000 stop strings;
- ``/tokenize`` of 50,000 special tokens with ``parse_special`` (bare: 7 s).

Each is a 400 naming the field (the route's own error shape), the child keeps its pid, an admin's
``/slots`` (a task the loop serves) answers within 1 s after each, and after 50 of them in a row the
daemon is READY with 0 restarts.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.integration.conftest import DaemonFactory

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
N_VOCAB = 49_152  # the demo model's vocabulary
SPECIAL = "<|im_start|>"
MESSAGES = [{"role": "user", "content": "Hi"}]

BREAKERS = ["b" * 100] * 20_000
WHOLE_VOCAB = [[i, -1.0] for i in range(N_VOCAB)]
STOPS = [f"stop-{i}" for i in range(100_000)]

# (route, body, the refused field's path): every route with the pinned schema's fields takes DRY,
# logit_bias and stop; Anthropic's stop strings are stop_sequences.
_GEN: tuple[tuple[str, dict[str, Any]], ...] = (
    ("/completion", {"prompt": "Hi", "n_predict": 4}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4}),
    ("/infill", {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 4}),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}),
    ("/v1/messages", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}),
    ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 4}),
)
SHAPES: tuple[tuple[str, dict[str, Any], str], ...] = (
    *(
        (route, {**body, "dry_multiplier": 0.8, "dry_sequence_breakers": BREAKERS}, "dry_sequence_breakers")
        for route, body in _GEN
    ),
    *((route, {**body, "logit_bias": WHOLE_VOCAB}, "logit_bias") for route, body in _GEN),
    *(
        (route, {**body, "stop_sequences" if route == "/v1/messages" else "stop": STOPS}, "")
        for route, body in _GEN
    ),
    ("/tokenize", {"content": SPECIAL * 50_000, "parse_special": True}, "content"),
)


def _refused_naming(r: httpx.Response, route: str, field: str) -> None:
    assert r.status_code == 400, f"{route}: {r.status_code} {r.text[:300]}"
    body = r.json()
    if route == "/v1/messages":
        assert body["type"] == "error", body
        message = body["error"]["message"]
    else:
        assert body["error"]["code"] == "invalid_field", body
        assert body["error"]["param"] == field, body
        message = body["error"]["message"]
    assert f"'{field}'" in message and "the bound" in message, message


def test_costly_shapes_are_refused_on_every_route_and_the_loop_stays_free(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory()
    pid = d.child_pid
    generation = d.readyz()[1]["generation"]
    bodies = [
        (route, body, field or ("stop_sequences" if route == "/v1/messages" else "stop"))
        for route, body, field in SHAPES
    ]
    sent = 0
    with httpx.Client(timeout=60, trust_env=False) as c:
        inference = {"Authorization": f"Bearer {d.inference_key}", "x-api-key": d.inference_key}
        admin = {"Authorization": f"Bearer {d.admin_key}"}
        while sent < 50:
            route, body, field = bodies[sent % len(bodies)]
            _refused_naming(c.post(d.base_url + route, json=body, headers=inference), route, field)
            sent += 1
            # The loop is free: a task it serves (an admin's /slots) is answered within 1 s.
            started = time.monotonic()
            slots = c.get(d.base_url + "/slots", headers=admin, timeout=1.0)
            assert slots.status_code == 200 and time.monotonic() - started < 1.0, (route, slots.text[:200])
            assert d.child_pid == pid, route
        code, ready = d.readyz(c)
    assert code == 200, ready
    assert ready["generation"] == generation
    assert d.admin_status()["restarts"] == 0
