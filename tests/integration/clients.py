"""Clients the recovery tests act as, one copy each: a client that honours ``not_ready`` (``served``),
another tenant's steady traffic (``Bystander``), and what a fake child received (``received``).

The poison, hang and watchdog tests (test_poison_e2e.py, test_hang_poison_e2e.py, test_watchdog_e2e.py,
test_replicas_poison_e2e.py) each had their own copy of these; a fix to one (a longer wait, a new
answer code) now reaches every test that relies on it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Daemon

MODEL = "smollm2-135m-instruct"
# How long a client keeps honouring ``not_ready``: past any restart backoff of a test daemon.
NOT_READY_WAIT_S = 60.0


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def served(
    c: httpx.Client,
    url: str,
    body: dict[str, Any],
    key: str | None = None,
    *,
    headers: dict[str, str] | None = None,
    wait_s: float = NOT_READY_WAIT_S,
    any_503: bool = False,
) -> httpx.Response:
    """POST as a client that honours 503 + Retry-After (as the OpenAI SDK does): sent again until the
    daemon takes it. A request that arrives while the child restarts is refused at once by design; one
    in flight at a death or a hang is replayed, never answered 503 or 502. The last 503 is returned when
    it has no Retry-After (FAILED: no retry is coming) or after ``wait_s``.

    ``key`` or ``headers``: the caller's credentials. ``any_503``: retry every 503, not only
    ``not_ready`` (behind nginx, whose answer for a replica it could not reach has no JSON body)."""
    sent = headers if headers is not None else auth(key or "")
    deadline = time.monotonic() + wait_s
    while True:
        r = c.post(url, json=body, headers=sent)
        if r.status_code != 503:
            return r
        if not any_503 and r.json().get("error", {}).get("code") != "not_ready":
            return r
        retry_after = r.headers.get("retry-after")
        if (retry_after is None and not any_503) or time.monotonic() > deadline:
            return r
        time.sleep(min(float(retry_after or "1"), 0.25))


class Bystander:
    """Another tenant's ordinary requests, one after another until stopped, and the model's states seen
    between them: every one must complete (200), replayed if a death or a hang caught it in flight."""

    def __init__(self, d: Daemon, key: str, *, timeout_s: float = 120.0, pause_s: float = 0.05) -> None:
        self.d, self.key = d, key
        self.timeout_s, self.pause_s = timeout_s, pause_s
        self.stop = threading.Event()
        self.answers: list[tuple[int, str]] = []
        self.sending = 0  # the number of the request under way (its prompt says it)
        self.states: set[str] = set()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s, trust_env=False) as c:
            n = 0
            while not self.stop.is_set():
                n += 1
                self.sending = n
                body = {"model": MODEL, "prompt": f"ordinary request {n}", "max_tokens": 1}
                try:
                    r = served(c, self.d.base_url + "/v1/completions", body, self.key, wait_s=self.timeout_s)
                    self.answers.append((r.status_code, r.text[:300]))
                except httpx.HTTPError as exc:
                    self.answers.append((0, f"no answer: {type(exc).__name__}: {exc}"))
                self.states.add(str(c.get(self.d.base_url + "/readyz").json().get("state")))
                time.sleep(self.pause_s)

    def __enter__(self) -> Bystander:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(2 * self.timeout_s)


def received(log: Path) -> list[dict[str, Any]]:
    """The requests a fake child logged (``tests/fakes/fake_child.py --request-log``), in order."""
    if not log.is_file():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def poison_samples(d: Daemon, admin_key: str) -> dict[tuple[str, str], float]:
    """``llamagate_poison_requests_total`` by (tenant, key)."""
    text = httpx.get(d.base_url + "/metrics", headers=auth(admin_key), timeout=30, trust_env=False).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "llamagate_poison_requests_total":
                key = (s.labels.get("tenant", ""), s.labels.get("key", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out
