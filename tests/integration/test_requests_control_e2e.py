"""An operator in control of requests, against the real llama-server and the demo model on one slot,
with the OpenAI SDK as the clients.

- ``llamagate requests`` lists a running 2000-token stream and a queued request; cancelling the queued
  one (``llamagate requests --cancel``) takes it out of its queue at once and its client gets
  ``410 cancelled_error``; cancelling the running one through ``DELETE /admin/requests/{id}`` ends its
  stream with that error as the last event, at its next token (long before its 2000 tokens), and the
  child's ``/slots`` shows the slot free again; then neither is listed.
- Priorities with aging: a batch tenant keeps 4 requests queued, an interactive tenant sends one: the
  interactive one is admitted next; while interactive requests keep coming, every batch request still
  gets its turn, overtaken only by interactive requests that arrived within the documented bound
  (``AGING_S_PER_LEVEL`` x the 10 levels between batch and interactive) after it.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from proxy.admission.gate import AGING_S_PER_LEVEL
from proxy.settings import PRIORITY_LEVELS
from supervisor.config.keys import new_key_config
from tests.integration.conftest import Daemon, DaemonFactory, wait_until

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
# Exactly max_tokens long: the model's end of text does not end a stream early.
LONG = {"ignore_eos": True, "temperature": 0}


def requests_cli(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "supervisor", "requests", *args, "--url", d.base_url, "--key", d.admin_key]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def admin(d: Daemon) -> dict[str, str]:
    return {"Authorization": f"Bearer {d.admin_key}"}


def rows(d: Daemon) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{d.base_url}/admin/requests", headers=admin(d), timeout=10, trust_env=False)
    assert r.status_code == 200, r.text
    return {row["id"]: row for row in r.json()["requests"]}


def busy_slots(d: Daemon) -> int:
    r = httpx.get(f"{d.base_url}/slots", headers=admin(d), timeout=10, trust_env=False)
    return sum(1 for s in r.json() if s.get("is_processing"))


def counter(d: Daemon, name: str, **labels: str) -> float:
    text = httpx.get(f"{d.base_url}/metrics", headers=admin(d), timeout=30, trust_env=False).text
    total = 0.0
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m[2])
    return total


@dataclass
class Outcome:
    chunks: int = 0  # stream chunks that carried generated text
    error: openai.APIError | None = None
    done: threading.Event = field(default_factory=threading.Event)


def test_cancel_a_running_stream_and_a_queued_request(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"llama": {"slots": 1, "prompt_cache_mib": 0, "ctx_checkpoints": 0}})
    client = OpenAI(base_url=f"{d.base_url}/v1", api_key=d.inference_key, max_retries=2, timeout=300)
    running, queued = Outcome(), Outcome()

    def stream() -> None:
        try:
            chunks = client.chat.completions.create(
                model=MODEL,
                messages=PROMPT,  # type: ignore[arg-type]
                max_tokens=2000,
                stream=True,
                extra_body=LONG,
                extra_headers={"X-Request-ID": "running-a"},
            )
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    running.chunks += 1
        except openai.APIError as exc:
            running.error = exc
        finally:
            running.done.set()

    def ask() -> None:
        try:
            client.chat.completions.create(
                model=MODEL,
                messages=PROMPT,
                max_tokens=8,
                extra_headers={"X-Request-ID": "queued-b"},  # type: ignore[arg-type]
            )
        except openai.APIError as exc:
            queued.error = exc
        finally:
            queued.done.set()

    threads = [threading.Thread(target=stream), threading.Thread(target=ask)]
    threads[0].start()
    wait_until(
        lambda: rows(d).get("running-a", {}).get("tokens", 0) >= 5, "the stream to generate", timeout=120
    )
    threads[1].start()
    wait_until(lambda: rows(d).get("queued-b", {}).get("state") == "queued", "the second request to queue")

    listing = requests_cli(d)
    assert listing.returncode == 0, listing
    states = {line.split()[0]: line.split()[1] for line in listing.stdout.splitlines()}
    assert states == {"running-a": "running", "queued-b": "queued"}, listing.stdout

    cancelled = requests_cli(d, "--cancel", "queued-b")
    assert cancelled.returncode == 0 and cancelled.stdout.startswith("cancelled queued-b  queued"), cancelled
    # Out of its queue by the time the cancel answered; the stream goes on.
    load = httpx.get(f"{d.base_url}/admin/load", headers=admin(d), timeout=10, trust_env=False).json()
    assert load["queued"] == 0 and load["in_flight"] == 1
    assert queued.done.wait(60)
    assert isinstance(queued.error, openai.APIStatusError), queued.error  # not retried by the SDK
    assert queued.error.status_code == 410
    assert isinstance(queued.error.body, dict) and queued.error.body["type"] == "cancelled_error"
    assert queued.error.body["code"] == "cancelled_by_operator"
    assert not running.done.is_set()

    r = httpx.delete(f"{d.base_url}/admin/requests/running-a", headers=admin(d), timeout=30, trust_env=False)
    assert r.status_code == 200, r.text
    (row,) = r.json()["cancelled"]
    assert row["state"] == "running"
    assert running.done.wait(60)
    # The documented error, as the stream's last event, at its next token: nothing generated after the
    # cancel reached the client (the row's count was read in the same loop turn as the cancel).
    assert running.error is not None and isinstance(running.error.body, dict), running.error
    assert running.error.body["type"] == "cancelled_error", running.error.body
    assert running.chunks <= row["tokens"] + 1 < 2000, (running.chunks, row)
    # The child stopped generating: its one slot is free.
    wait_until(lambda: busy_slots(d) == 0, "the cancelled request's slot to be free on /slots")

    after = requests_cli(d)
    assert after.returncode == 0 and after.stdout.strip() == "no requests queued or running", after
    assert counter(d, "llamagate_cancelled_requests_total", state="queued") == 1
    assert counter(d, "llamagate_cancelled_requests_total", state="running") == 1
    for t in threads:
        t.join(30)
    # The slot serves the next request as before.
    answer = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4)  # type: ignore[arg-type]
    assert answer.choices[0].message.content


@dataclass
class Served:
    """One request as the access log saw it: when it arrived and when it was admitted (the proxy's
    clock), and its tenant."""

    request_id: str
    tenant: str
    status: int
    arrived: float
    admitted: float


def served(d: Daemon) -> list[Served]:
    out = []
    for line in d.log_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("logger") != "llamagate.access" or record.get("route") != "/v1/chat/completions":
            continue
        ended = datetime.fromisoformat(record["ts"].replace("Z", "+00:00")).timestamp()
        arrived = ended - record["duration_ms"] / 1000.0
        wait = (record.get("queue_wait_ms") or 0.0) / 1000.0
        out.append(Served(record["request_id"], record["tenant"], record["status"], arrived, arrived + wait))
    return out


def test_interactive_goes_next_and_batch_still_gets_its_turn(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"llama": {"slots": 1}})
    batch_key, batch = new_key_config("batch")
    inter_key, inter = new_key_config("inter")
    limits = {"max_concurrency": 1, "max_queue": 8, "queue_timeout_s": 120}
    d.write_config(
        {
            "tenants": [
                {"name": "default", "max_concurrency": 2, "max_queue": 8},
                {"name": "batch", "priority": "batch", **limits},
                {"name": "inter", "priority": "interactive", **limits},
            ],
            "keys": [*d.config["keys"], batch, inter],
        }
    )
    d.signal(signal.SIGHUP)
    wait_until(
        lambda: (
            httpx.get(f"{d.base_url}/v1/models", headers={"Authorization": f"Bearer {inter_key}"}).status_code
            == 200
        ),
        "the reloaded keys",
        timeout=60,
    )
    batch_client = OpenAI(base_url=f"{d.base_url}/v1", api_key=batch_key, max_retries=0, timeout=300)
    inter_client = OpenAI(base_url=f"{d.base_url}/v1", api_key=inter_key, max_retries=0, timeout=300)
    statuses: dict[str, int] = {}
    lock = threading.Lock()

    def one(c: OpenAI, request_id: str, max_tokens: int = 8) -> None:
        try:
            c.chat.completions.create(
                model=MODEL,
                messages=PROMPT,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                extra_body=LONG,
                extra_headers={"X-Request-ID": request_id},
            )
            status = 200
        except openai.APIStatusError as exc:
            status = exc.status_code
        except openai.APIError:
            status = 0
        with lock:
            statuses[request_id] = status

    def background(c: OpenAI, request_id: str, max_tokens: int = 8) -> threading.Thread:
        t = threading.Thread(target=one, args=(c, request_id, max_tokens), daemon=True)
        t.start()
        return t

    # The batch tenant holds the one slot with a long request and keeps 4 more queued.
    holder = background(batch_client, "batch-hold", 2000)
    wait_until(lambda: rows(d).get("batch-hold", {}).get("state") == "running", "the slot taken", 120)
    batch_ids = [f"batch-{i}" for i in range(4)]
    threads = [background(batch_client, rid) for rid in batch_ids]
    wait_until(
        lambda: sum(rows(d).get(rid, {}).get("state") == "queued" for rid in batch_ids) == 4, "4 queued"
    )
    threads.append(background(inter_client, "inter-first"))
    wait_until(lambda: rows(d).get("inter-first", {}).get("state") == "queued", "the interactive one queued")

    # Interactive requests keep coming (two clients, so one always waits while one runs) until every
    # batch request has been served; they queue behind the first interactive one.
    stop = threading.Event()
    sent = [0]

    def keep_coming(n: int) -> None:
        while not stop.is_set():
            with lock:
                sent[0] += 1
                rid = f"inter-{n}-{sent[0]}"
            one(inter_client, rid)

    loops = [threading.Thread(target=keep_coming, args=(n,), daemon=True) for n in range(2)]
    for t in loops:
        t.start()
    wait_until(lambda: sum(row["tenant"] == "inter" for row in rows(d).values()) >= 2, "more interactive")
    # Free the slot (an operator's cancel): the interactive request is admitted next, ahead of the 4.
    r = httpx.delete(f"{d.base_url}/admin/requests/batch-hold", headers=admin(d), timeout=30, trust_env=False)
    assert r.status_code == 200, r.text
    holder.join(60)
    try:
        wait_until(
            lambda: all(rid in statuses for rid in batch_ids), "every batch request served", timeout=180
        )
    finally:
        stop.set()
        for t in [*loops, *threads]:
            t.join(120)
    assert [statuses[rid] for rid in batch_ids] == [200] * 4, statuses
    assert statuses["batch-hold"] == 410 and statuses["inter-first"] == 200

    records = served(d)
    # One slot: the access log's lines of the served requests are in the order they were admitted.
    order = [s.request_id for s in records if s.status == 200]
    assert all(order.index("inter-first") < order.index(rid) for rid in batch_ids), order
    # Priority, not the fair share (which would alternate the two tenants): interactive requests kept
    # going first until the batch ones had aged.
    first_batch = min(order.index(rid) for rid in batch_ids)
    assert sum(rid.startswith("inter-") for rid in order[:first_batch]) >= 3, order
    log = {s.request_id: s for s in records}
    inters = [s for s in records if s.tenant == "inter"]
    bound_s = (PRIORITY_LEVELS["interactive"] - PRIORITY_LEVELS["batch"]) * AGING_S_PER_LEVEL
    for rid in batch_ids:
        b = log[rid]
        # Interactive requests kept coming: one was waiting when this batch request went first.
        assert any(i.arrived < b.admitted < i.admitted for i in inters), rid
        # The aging bound: only interactive requests that arrived less than bound_s after it overtook
        # it (1 s of slack: the log's times are its arrival before the body was read, in ms).
        overtook = [i for i in inters if b.arrived < i.arrived and i.admitted < b.admitted]
        late = [round(i.arrived - b.arrived, 3) for i in overtook if i.arrived - b.arrived > bound_s + 1.0]
        assert not late, (rid, late)
