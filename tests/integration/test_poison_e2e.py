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
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from supervisor.config.keys import ADMIN, new_key_config
from tests.fakes.fake_child import make_fake_binary
from tests.integration.clients import Bystander, poison_samples, received, served
from tests.integration.conftest import DaemonFactory, wait_until

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
MARKER = "POISON"
STRIKES = 2
COOLDOWN_S = 600
ATTEMPTS = 10
ANSWER_S = 1.0


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
    with Bystander(d, other_key, timeout_s=60) as bystander, httpx.Client(timeout=120, trust_env=False) as c:
        # The first marked request goes while one of the other tenant's is at the child, unanswered: it
        # is in flight at the death that follows.
        def bystander_at_child() -> bool:
            n = bystander.sending
            at_child = any(f'ordinary request {n}"' in r["body"] for r in received(requests_log))
            return at_child and len(bystander.answers) < n

        wait_until(bystander_at_child, "one of the other tenant's requests in flight at the child")
        for attempt in range(ATTEMPTS):
            body = {"model": MODEL, "prompt": f"{MARKER} attempt {attempt}", "max_tokens": 1}
            answers.append(served(c, d.base_url + "/v1/completions", body, attacker_key))
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
    at_child = received(requests_log)
    marked = Counter(
        int(m.group(1))
        for r in at_child
        if r["marked"]
        for m in [re.search(rf"{MARKER} attempt (\d+)", r["body"])]
        if m
    )
    assert sum(marked.values()) == sum(1 for r in at_child if r["marked"]), at_child
    assert marked, f"no marked request reached the fake child: {at_child[:5]}"
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
    for record in at_child:
        m = re.search(r"ordinary request \d+", record["body"])
        if m:
            children_per_request.setdefault(m.group(0), set()).add(int(record["pid"]))
    replayed = [name for name, pids in children_per_request.items() if len(pids) > 1]
    assert replayed, "no ordinary request was in flight at a death"

    # The verdicts, counted by tenant and key (the key's public id, never the key).
    attacker_id = attacker["id"]
    samples = poison_samples(d, admin_key)
    assert samples.get(("default", attacker_id)) == STRIKES, samples
    assert not any(tenant == "other" for tenant, _ in samples), samples
    assert attacker_key not in json.dumps(list(samples)), "a key's secret in a label"
