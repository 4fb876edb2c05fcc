"""A request whose child is killed before any byte of its answer reached the client is answered by the
restarted child (``proxy.routes.replay``): the real daemon and model, the OpenAI SDK as the client with
its own retries off (``max_retries=0``), so every answer below is the daemon's doing.

Nothing here compares a duration with a constant: the order of events (the kill, the new child READY,
the answer) is read from the daemon's log and the client's own clock."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import Daemon, DaemonFactory, wait_until

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
ROUTE = "/v1/chat/completions"


def sdk(d: Daemon) -> OpenAI:
    return OpenAI(base_url=f"{d.base_url}/v1", api_key=d.inference_key, max_retries=0, timeout=300)


def slots(d: Daemon) -> list[dict[str, Any]]:
    r = httpx.get(
        f"{d.base_url}/slots", headers={"Authorization": f"Bearer {d.admin_key}"}, timeout=30, trust_env=False
    )
    r.raise_for_status()
    out: list[dict[str, Any]] = r.json()
    return out


def replays(d: Daemon) -> dict[str, float]:
    text = httpx.get(
        f"{d.base_url}/metrics",
        headers={"Authorization": f"Bearer {d.admin_key}"},
        timeout=30,
        trust_env=False,
    ).text
    return {
        k: float(v)
        for k, v in re.findall(r'^llamagate_replays_total\{[^}]*reason="(\w+)"\} (\S+)$', text, re.M)
    }


def kill_child(d: Daemon) -> int:
    """SIGKILL the child from outside; returns the generation that died."""
    generation = int(d.readyz()[1]["generation"])
    pid = d.child_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    return generation


def log_after_kill(d: Daemon, generation: int) -> tuple[int, list[dict[str, Any]]]:
    """The index in the daemon's log of the next child's READY, and the chat access-log lines, once both
    are there: the access line is written when the request's handling ends, which may be a moment after
    the client has read the answer's last byte (a run on a busy host read the log before it)."""

    def found() -> bool:
        records = d.log_records()
        readies = [r for r in records if r.get("to") == "READY" and int(r.get("generation", 0)) > generation]
        return bool(readies) and any(_is_chat_access(r) for r in records)

    wait_until(found, "the next child's READY and the request's access line in the log")
    records = d.log_records()
    ready = next(
        i
        for i, r in enumerate(records)
        if r.get("to") == "READY" and int(r.get("generation", 0)) > generation
    )
    return ready, [r for r in records if _is_chat_access(r)]


def _is_chat_access(record: dict[str, Any]) -> bool:
    return record.get("logger") == "llamagate.access" and record.get("route") == ROUTE


def test_a_non_streamed_request_whose_child_is_killed_gets_its_whole_answer_from_the_next_child(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory()
    client = sdk(d)
    with ThreadPoolExecutor(1) as pool:
        reply_f = pool.submit(
            client.chat.completions.create,
            model=MODEL,
            messages=[{"role": "user", "content": "Write a long story about a lighthouse."}],
            max_tokens=96,
            extra_body={"ignore_eos": True},  # the demo model may stop early; this keeps it generating
        )
        wait_until(lambda: any(s.get("is_processing") for s in slots(d)), "the request in progress", 120)
        dead = kill_child(d)
        reply = reply_f.result(timeout=600)
    # Whole, from the next child: every token it was asked for.
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 96
    assert reply.choices[0].message.content
    ready, lines = log_after_kill(d, dead)
    (line,) = lines
    assert line["status"] == 200 and line["replayed"] == 1 and line["outcome"] == "ok"
    # Its answer came after the new child was READY: its latency holds the restart.
    records = d.log_records()
    assert records.index(line) > ready
    assert replays(d) == {"closed": 1.0}


def _long_prompt() -> str:
    # A few thousand tokens: the prompt takes seconds on 2 cores, a window wide enough to kill in.
    return " ".join(f"Line {i}: the keeper climbs the stairs and lights the lamp." for i in range(200))


def test_a_stream_whose_child_is_killed_during_its_prompt_is_served_by_the_next_child(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory(
        {
            # -b 256: the prompt is taken 256 tokens at a time, and /slots (answered between two batches)
            # shows its progress at that grain. The first-token deadline is not under test here (two
            # prompts and a restart on a busy host): it only must not end the request.
            "llama": {"slots": 2, "ctx_per_slot": 8192, "extra_args": ["-b", "256"]},
            "proxy": {"timeouts": {"first_token_s": 600}},
        }
    )
    messages = [{"role": "user", "content": _long_prompt()}]
    counted = httpx.post(
        f"{d.base_url}/v1/chat/completions/input_tokens",
        json={"model": MODEL, "messages": messages},
        headers={"Authorization": f"Bearer {d.inference_key}"},
        timeout=60,
        trust_env=False,
    )
    n_prompt = int(counted.json()["input_tokens"])
    assert 2000 < n_prompt < 8192 - 64, n_prompt
    client = sdk(d)
    events: list[str] = []
    finish: list[str | None] = []
    headers_at: list[float] = []

    def run() -> str:
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, stream=True, extra_body={"ignore_eos": True}
        )
        headers_at.append(time.monotonic())  # the SDK returns once the response has started
        text = []
        for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish.append(chunk.choices[0].finish_reason)
            events.append(chunk.id)
        return "".join(text)

    def in_prompt() -> bool:
        # Processing the prompt, with at least half of it left (so the kill lands before the first token).
        return any(
            s.get("is_processing")
            and s["next_token"][0]["n_decoded"] == 0
            and s.get("n_prompt_tokens_processed", 0) < n_prompt // 2
            for s in slots(d)
        )

    with ThreadPoolExecutor(1) as pool:
        text_f: Future[str] = pool.submit(run)
        wait_until(in_prompt, "the child processing the prompt", 120)
        killed_at = time.monotonic()
        dead = kill_child(d)
        text = text_f.result(timeout=600)
    assert text and finish[-1] == "length"  # a whole stream of every token asked for, no error event
    assert headers_at[0] > killed_at  # nothing reached the client from the child that died
    assert len(set(events)) == 1  # one completion id throughout: every event came from the next child
    ready, lines = log_after_kill(d, dead)
    (line,) = lines
    assert line["status"] == 200 and line["replayed"] == 1 and line["outcome"] == "ok"
    assert d.log_records().index(line) > ready
    assert replays(d) == {"closed": 1.0}


def test_a_stream_that_already_sent_tokens_gets_an_error_event_and_is_not_replayed(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory()
    client = sdk(d)
    tokens = threading.Event()
    received: list[str] = []

    def run() -> BaseException | None:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write a long story about a lighthouse."}],
            max_tokens=3000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    received.append(chunk.choices[0].delta.content)
                    if len(received) >= 3:
                        tokens.set()
        except openai.APIError as exc:
            return exc
        return None

    with ThreadPoolExecutor(1) as pool:
        error_f = pool.submit(run)
        assert tokens.wait(120), "three tokens streamed"
        dead = kill_child(d)
        error = error_f.result(timeout=300)
    assert isinstance(error, openai.APIError), "the stream ends with an error event, not [DONE]"
    assert "closed the stream before it was complete" in error.message
    d.wait_for(lambda code, b: code == 200 and b["generation"] > dead, "READY with a new child")
    _, lines = log_after_kill(d, dead)
    (line,) = lines
    assert line["replayed"] == 0 and line["outcome"] == "upstream_error" and line["status"] == 200
    assert replays(d) == {}
