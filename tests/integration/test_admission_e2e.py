"""Admission that holds for every request shape, with the real llama-server (2 slots) behind the daemon:
wide requests counted or refused, response-size levers bounded, cache hits hidden across tenants, an
abandoned non-streamed request that frees its slot before its permit moves on, malformed bodies 400."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from supervisor.config.keys import ADMIN, INFERENCE, new_key_config
from tests.integration.conftest import Daemon, DaemonFactory, wait_until

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"


def _keys(*specs: tuple[str, bool]) -> tuple[list[str], list[dict[str, Any]]]:
    plain, entries = [], []
    for tenant, admin in specs:
        key, entry = new_key_config(tenant, ADMIN if admin else INFERENCE)
        plain.append(key)
        entries.append(entry)
    return plain, entries


def _tenant(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "max_concurrency": 1, "max_queue": 8, "queue_timeout_s": 300, **kw}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _slots(c: httpx.Client, d: Daemon, admin: str) -> list[dict[str, Any]]:
    r = c.get(f"{d.base_url}/slots", headers=_auth(admin))
    r.raise_for_status()
    slots: list[dict[str, Any]] = r.json()
    return slots


def _busy(slots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in slots if s.get("is_processing")]


def _readyz(c: httpx.Client, d: Daemon) -> dict[str, Any]:
    body: dict[str, Any] = c.get(f"{d.base_url}/readyz").json()
    return body


@contextmanager
def _background_stream(d: Daemon, key: str, body: dict[str, Any]) -> Iterator[threading.Event]:
    """A stream read in a thread until the block ends (then its connection is closed)."""
    stop = threading.Event()

    def run() -> None:
        with (
            httpx.Client(timeout=300, trust_env=False) as c,
            c.stream("POST", f"{d.base_url}/v1/completions", json=body, headers=_auth(key)) as r,
        ):
            for _ in r.iter_bytes():
                if stop.is_set():
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(60)


def test_wide_requests_are_refused_or_counted(daemon_factory: DaemonFactory) -> None:
    (narrow, wide, admin), keys = _keys(("narrow", False), ("wide", False), ("ops", True))
    d = daemon_factory(
        {
            "tenants": [_tenant("narrow"), _tenant("wide", max_concurrency=2), _tenant("ops")],
            "keys": keys,
        }
    )
    url = d.base_url
    with httpx.Client(timeout=120, trust_env=False) as c:
        refused = [
            ("/v1/completions", {"prompt": "hello", "n": 2}, "'n'"),
            ("/v1/completions", {"prompt": "hello", "n_cmpl": 2}, "'n'"),
            ("/v1/completions", {"prompt": ["a", "b"]}, "2 slots"),
            ("/v1/completions", {"prompt": [[1, 2], "b"]}, "2 slots"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "'n'"),
            ("/v1/completions", {"prompt": "hello", "id_slot": 1}, "id_slot"),
        ]
        for path, body, named in refused:
            r = c.post(url + path, json={"model": MODEL, "max_tokens": 2, **body}, headers=_auth(narrow))
            assert r.status_code == 400, (body, r.text)
            assert named in r.json()["error"]["message"]
        # One prompt: a token array (an integer at its top level) or text mixed with tokens.
        for prompt in ([2, 3, 4], [2, "hello", 3]):
            r = c.post(
                url + "/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "id_slot": -1},
                headers=_auth(narrow),
            )
            assert r.status_code == 200, r.text

        # A two-slot request from a tenant allowed two: it holds two permits while both slots work.
        wide_body = {"model": MODEL, "prompt": "Count:", "n": 2, "max_tokens": 400, "ignore_eos": True}
        wide_body["stream"] = True
        seen_two = False
        with _background_stream(d, wide, wide_body):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                before = _readyz(c, d)["in_flight"]
                busy = len(_busy(_slots(c, d, admin)))
                after = _readyz(c, d)["in_flight"]
                assert busy <= max(before, after), (busy, before, after)
                if busy == 2 and before == after == 2:
                    seen_two = True
                    break
                time.sleep(0.05)
        assert seen_two, "the n=2 stream never held two permits while two slots were busy"


def test_logprob_levers_are_bounded(daemon_factory: DaemonFactory) -> None:
    (key,), keys = _keys(("small", False))
    d = daemon_factory({"tenants": [_tenant("small", max_logprobs=5)], "keys": keys})
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cmpl = {"model": MODEL, "prompt": "Once upon", "max_tokens": 4}
    with httpx.Client(timeout=120, trust_env=False) as c:
        for path, body, field in [
            ("/v1/completions", {**cmpl, "n_probs": 262144}, "'n_probs'"),
            ("/v1/completions", {**cmpl, "logprobs": 6}, "'logprobs'"),
            ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 6}, "'top_logprobs'"),
        ]:
            r = c.post(d.base_url + path, json=body, headers=_auth(key))
            assert r.status_code == 400, r.text
            assert field in r.json()["error"]["message"]
        # Within the bound: answered, and small. Chat's implicit 20 becomes the tenant's 5.
        r = c.post(d.base_url + "/v1/chat/completions", json={**chat, "logprobs": True}, headers=_auth(key))
        assert r.status_code == 200, r.text
        assert len(r.content) < 64 * 1024
        candidates = r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        assert 1 <= len(candidates) <= 5
        r = c.post(d.base_url + "/v1/completions", json={**cmpl, "n_probs": 5}, headers=_auth(key))
        assert r.status_code == 200 and len(r.content) < 64 * 1024


PROMPT = (
    "You are the archivist of the northern observatory. Record the following private note exactly: "
    "the vault code for the east wing is tangerine-seventeen, and the meeting moved to Thursday at nine."
)


def _has_cache_detail(obj: Any) -> bool:
    text = json.dumps(obj)
    return "cached_tokens" in text or "timings" in text or "cache_n" in text


def test_cache_hits_are_hidden_from_other_tenants(daemon_factory: DaemonFactory) -> None:
    (first, second, strict, admin), keys = _keys(
        ("first", False), ("second", False), ("strict", False), ("ops", True)
    )
    d = daemon_factory(
        {
            "tenants": [
                _tenant("first"),
                _tenant("second"),
                _tenant("strict", show_cache_details=True, cache_prompt=False),
                _tenant("ops"),
            ],
            "keys": keys,
        }
    )
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=120, trust_env=False) as c:

        def ask(key: str, **extra: Any) -> httpx.Response:
            r = c.post(d.base_url + "/v1/completions", json={**body, **extra}, headers=_auth(key))
            assert r.status_code == 200, r.text
            return r

        ask(first)
        # The second tenant's answers, whole and streamed, carry nothing about the first one's prompt.
        plain = ask(second).json()
        assert not _has_cache_detail(plain) and plain["usage"]["completion_tokens"] >= 1
        streamed = ask(second, stream=True, stream_options={"include_usage": True}, timings_per_token=True)
        events = [line for line in streamed.text.split("\n") if line.startswith("data: {")]
        assert events and not any(_has_cache_detail(json.loads(e[6:])) for e in events)
        chat = c.post(
            d.base_url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2},
            headers=_auth(second),
        )
        assert chat.status_code == 200 and not _has_cache_detail(chat.json())
        # Control: the child did answer from the cache (an admin key sees it) ...
        seen = ask(admin).json()
        assert seen["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 and "timings" in seen
        # ... and a strict tenant never reuses it, so even its own timings show no hit.
        strict_answer = ask(strict).json()
        assert strict_answer["timings"]["cache_n"] == 0
        assert strict_answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def _open_request(d: Daemon, key: str, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", d.port), timeout=10)
    sock.sendall(head + data)
    return sock


def test_abandoned_non_stream_frees_its_slot_before_its_permit_moves_on(
    daemon_factory: DaemonFactory,
) -> None:
    (streamer, leaver, waiter, admin), keys = _keys(
        ("streamer", False), ("leaver", False), ("waiter", False), ("ops", True)
    )
    d = daemon_factory(
        {
            "tenants": [_tenant("streamer"), _tenant("leaver"), _tenant("waiter"), _tenant("ops")],
            "keys": keys,
        }
    )
    long = {"model": MODEL, "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    with (
        httpx.Client(timeout=60, trust_env=False) as c,
        _background_stream(d, streamer, {**long, "prompt": "STREAMER: the numbers from one", "stream": True}),
    ):
        wait_until(lambda: len(_busy(_slots(c, d, admin))) == 1, "the stream in its slot", 120)
        # /slots shows no prompts (llama-server hides them unless debugging): tasks are told by their id.
        (stream_task,) = [s["id_task"] for s in _busy(_slots(c, d, admin))]
        sock = _open_request(d, leaver, {**long, "prompt": "LEAVER: the letters of the alphabet"})

        def leaver_slot() -> dict[str, Any] | None:
            for s in _busy(_slots(c, d, admin)):
                if s["id_task"] != stream_task and s["next_token"][0]["n_decoded"] > 0:
                    return s
            return None

        wait_until(lambda: leaver_slot() is not None, "the non-streamed request generating", 120)
        abandoned = leaver_slot()
        assert abandoned is not None
        task = abandoned["id_task"]

        result: dict[str, Any] = {}

        def wait_for_permit() -> None:
            with httpx.Client(timeout=300, trust_env=False) as w:
                r = w.post(
                    d.base_url + "/v1/completions",
                    json={"model": MODEL, "prompt": "WAITER: hi", "max_tokens": 2},
                    headers=_auth(waiter),
                )
                result["status"] = r.status_code

        third = threading.Thread(target=wait_for_permit, daemon=True)
        third.start()
        wait_until(lambda: _readyz(c, d)["queued"] == 1, "the third request queued in the proxy", 60)
        sock.close()  # the non-streamed client leaves while the stream keeps the child busy

        granted = freed = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (granted and freed):
            queued = _readyz(c, d)["queued"]
            busy = _busy(_slots(c, d, admin))
            still = any(s["id_task"] == task for s in busy)
            freed = freed or not still
            if queued == 0:
                granted = True
                # The permit moved on (read before /slots): the abandoned task must be gone by now.
                assert not still, "the permit was handed on while the abandoned task still held its slot"
            assert any(s["id_task"] == stream_task for s in busy), "the stream ended early"
            time.sleep(0.02)
        assert granted and freed
        third.join(120)
        assert result.get("status") == 200


MALFORMED: list[tuple[str, bytes, dict[str, str]]] = [
    ("nesting", b'{"prompt":"x","a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}),
    # An alias makes the proxy write the body again: the surrogate used to fail there with a 500.
    ("surrogate", b'{"model":"alias","prompt":"\\ud800","max_tokens":1}', {}),
    ("nan", b'{"prompt":"x","temperature":NaN}', {}),
    ("infinity", b'{"prompt":"x","temperature":-Infinity}', {}),
    ("overflow", b'{"prompt":"x","temperature":1e999}', {}),
    ("utf-16", '{"prompt":"x","max_tokens":1}'.encode("utf-16"), {}),
    ("utf-16-le", '{"prompt":"x","max_tokens":1}'.encode("utf-16-le"), {}),
]


def test_malformed_bodies_are_400_without_traceback(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"proxy": {"model_aliases": ["alias"], "max_body_bytes": 1024 * 1024}})
    headers = {**_auth(d.inference_key), "Content-Type": "application/json"}
    with httpx.Client(timeout=60, trust_env=False) as c:
        for name, raw, extra in MALFORMED:
            r = c.post(d.base_url + "/v1/completions", content=raw, headers={**headers, **extra})
            assert r.status_code == 400, (name, r.status_code, r.text[:300])
            assert r.json()["error"]["type"] == "invalid_request_error"
        ok = c.post(
            d.base_url + "/v1/completions",
            json={"model": "alias", "prompt": "\U0001f600", "max_tokens": 1},
            headers=headers,
        )
        assert ok.status_code == 200, ok.text
    log = d.log_text()
    assert "Traceback" not in log and "RecursionError" not in log and "UnicodeEncodeError" not in log
