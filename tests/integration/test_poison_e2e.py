"""A poison request is contained (issue 48): one that kills every child it reaches is sent at most twice,
its key is cooled down, and nobody else notices more than a replay.

The child is the fake llama-server with ``--abort-on POISON`` (SIGABRT, as a failed ``GGML_ASSERT`` in
the pinned server does) and ``--request-log``, its own record of every request that reached it, written
before it aborts: what the child received is counted there, not inferred from the daemon's answers.
The daemon is the real one; one tenant's inference key sends the marked request 10 times in a row while
another tenant's key keeps sending ordinary requests.

The contract under test: a request in flight at two child deaths is never sent again, its client gets
502 ``poison_request``; a key involved in ``strikes`` such verdicts within ``window_s`` gets 429
``key_cooling_down`` with Retry-After for ``cooldown_s``; at most ``2 x strikes`` child deaths; the
other tenant's requests all complete; the model never FAILED; ``llamagate_poison_requests_total``
counts the verdicts by tenant and key.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.config.keys import ADMIN, new_key_config
from tests.fakes.fake_child import make_fake_binary
from tests.integration.conftest import Daemon, DaemonFactory, wait_until

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
MARKER = "POISON"
STRIKES = 2
COOLDOWN_S = 600
ATTEMPTS = 10
ANSWER_S = 1.0


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _received(log: Path) -> list[dict[str, Any]]:
    if not log.is_file():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _poison_samples(d: Daemon, admin_key: str) -> dict[tuple[str, str], float]:
    text = httpx.get(d.base_url + "/metrics", headers=_auth(admin_key), timeout=30, trust_env=False).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "llamagate_poison_requests_total":
                key = (s.labels.get("tenant", ""), s.labels.get("key", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


NOT_READY_WAIT_S = 60.0


def _served(c: httpx.Client, url: str, body: dict[str, Any], key: str) -> httpx.Response:
    """POST as a client that honours 503 ``not_ready`` + Retry-After (as the OpenAI SDK does): sent again
    until the daemon takes it. A request that arrives while the child restarts is refused at once by
    design; one in flight at a death is replayed, never answered 503 or 502. The last 503 is returned
    when it has no Retry-After (FAILED: no retry is coming) or after ``NOT_READY_WAIT_S``."""
    deadline = time.monotonic() + NOT_READY_WAIT_S
    while True:
        r = c.post(url, json=body, headers=_auth(key))
        if r.status_code != 503 or r.json().get("error", {}).get("code") != "not_ready":
            return r
        retry_after = r.headers.get("retry-after")
        if retry_after is None or time.monotonic() > deadline:
            return r
        time.sleep(min(float(retry_after), 0.25))


class _Bystander:
    """Another tenant's ordinary requests, one after another until stopped, and the model's state seen
    between them: every one must complete (200), replayed if a death caught it in flight."""

    def __init__(self, d: Daemon, key: str) -> None:
        self.d = d
        self.key = key
        self.stop = threading.Event()
        self.answers: list[tuple[int, str]] = []
        self.sending = 0  # the number of the request under way (its prompt says it)
        self.states: set[str] = set()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60, trust_env=False) as c:
            n = 0
            while not self.stop.is_set():
                n += 1
                self.sending = n
                body = {"model": MODEL, "prompt": f"ordinary request {n}", "max_tokens": 1}
                try:
                    r = _served(c, self.d.base_url + "/v1/completions", body, self.key)
                    self.answers.append((r.status_code, r.text[:300]))
                except httpx.HTTPError as exc:
                    self.answers.append((0, f"no answer: {type(exc).__name__}: {exc}"))
                self.states.add(str(c.get(self.d.base_url + "/readyz").json().get("state")))
                time.sleep(0.05)

    def __enter__(self) -> _Bystander:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(120)


def test_a_request_that_kills_its_child_is_sent_at_most_twice_and_its_key_cooled_down(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    requests_log = tmp_path / "received.jsonl"
    fake = make_fake_binary(
        tmp_path / "fake",
        *("--abort-on", MARKER, "--request-log", str(requests_log)),
        # An ordinary request takes a second at the child, so the other tenant's is in flight at the
        # deaths: it must be replayed, and not judged with the marked one it shared two deaths with.
        *("--answer-seconds", str(ANSWER_S)),
    )
    admin_key, admin = new_key_config("default", ADMIN)
    attacker_key, attacker = new_key_config("default")
    other_key, other = new_key_config("other")
    d = daemon_factory(
        {
            "proxy": {"poison": {"strikes": STRIKES, "window_s": 600, "cooldown_s": COOLDOWN_S}},
            "tenants": [
                {"name": "default", "max_concurrency": 2, "max_queue": 8},
                {"name": "other", "max_concurrency": 2, "max_queue": 8},
            ],
            "keys": [admin, attacker, other],
        },
        binary=fake,
    )
    d.keys.update(admin=admin_key, inference=attacker_key)  # the fixture's own keys are not in this config
    generation0 = int(d.readyz()[1]["generation"])
    answers: list[httpx.Response] = []
    with _Bystander(d, other_key) as bystander, httpx.Client(timeout=120, trust_env=False) as c:
        # The first marked request goes while one of the other tenant's is at the child, unanswered: it
        # is in flight at the death that follows.
        def bystander_at_child() -> bool:
            n = bystander.sending
            at_child = any(f'ordinary request {n}"' in r["body"] for r in _received(requests_log))
            return at_child and len(bystander.answers) < n

        wait_until(bystander_at_child, "one of the other tenant's requests in flight at the child")
        for attempt in range(ATTEMPTS):
            body = {"model": MODEL, "prompt": f"{MARKER} attempt {attempt}", "max_tokens": 1}
            answers.append(_served(c, d.base_url + "/v1/completions", body, attacker_key))
        # A little of the episode's aftermath: the bystander keeps going on the last child.
        settle = len(bystander.answers) + 5
        deadline = time.monotonic() + 30
        while len(bystander.answers) < settle and time.monotonic() < deadline:
            time.sleep(0.05)

    # What the attacker saw: strikes x (502 poison_request), then 429 key_cooling_down with Retry-After.
    seen = [(r.status_code, r.json().get("error", {}).get("code")) for r in answers]
    verdicts = [r for r in answers if r.status_code == 502]
    assert seen[0] == (502, "poison_request"), seen
    assert len(verdicts) == STRIKES, seen
    for r in verdicts:
        error = r.json()["error"]
        assert error["code"] == "poison_request", error
        # It says why: in flight at two deaths, not sent again (and never the prompt itself).
        assert re.search(r"\b(two|2|twice)\b", error["message"]), error
        assert MARKER not in error["message"], error
    cooled = answers[STRIKES:]
    assert cooled, seen
    for r in cooled:
        assert r.status_code == 429, seen
        assert r.json()["error"]["code"] == "key_cooling_down", r.text
        assert 0 < int(r.headers["retry-after"]) <= COOLDOWN_S, r.headers
    assert seen == [(502, "poison_request")] * STRIKES + [(429, "key_cooling_down")] * (ATTEMPTS - STRIKES)

    # What the child received: each marked request at most twice, none after the cool-down began.
    received = _received(requests_log)
    marked = Counter(
        int(m.group(1))
        for r in received
        if r["marked"]
        for m in [re.search(rf"{MARKER} attempt (\d+)", r["body"])]
        if m
    )
    assert sum(marked.values()) == sum(1 for r in received if r["marked"]), received
    assert marked, f"no marked request reached the fake child: {received[:5]}"
    assert max(marked.values()) <= 2, marked
    assert sum(marked.values()) <= 2 * STRIKES, marked
    # Once cooled down, the key's requests reach no child.
    assert all(attempt < STRIKES for attempt in marked), marked
    # Deaths: one per marked request received (the fake aborts on each), and no more.
    code, ready = d.readyz()
    deaths = int(ready["generation"]) - generation0
    assert deaths == sum(marked.values()) <= 2 * STRIKES, (deaths, marked)

    # The other tenant: every request completed, the model never FAILED, READY at the end.
    assert bystander.answers, "the other tenant sent nothing during the episode"
    failed = [a for a in bystander.answers if a[0] != 200]
    assert not failed, failed
    assert "FAILED" not in bystander.states, bystander.states
    assert code == 200 and ready["state"] == "READY", ready
    assert d.admin_status().get("state") != "FAILED"

    # And some of its requests were in flight at a death and replayed: received by two children.
    children_per_request: dict[str, set[int]] = {}
    for record in received:
        m = re.search(r"ordinary request \d+", record["body"])
        if m:
            children_per_request.setdefault(m.group(0), set()).add(int(record["pid"]))
    replayed = [name for name, pids in children_per_request.items() if len(pids) > 1]
    assert replayed, "no ordinary request was in flight at a death"

    # The verdicts, counted by tenant and key (the key's public id, never the key).
    attacker_id = attacker["id"]
    samples = _poison_samples(d, admin_key)
    assert samples.get(("default", attacker_id)) == STRIKES, samples
    assert not any(tenant == "other" for tenant, _ in samples), samples
    assert attacker_key not in json.dumps(list(samples)), "a key's secret in a label"
