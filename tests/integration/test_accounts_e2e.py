"""Tenants as accounts (issue 24) against the real daemon, the real llama-server and model, and a real
SQLite store file: keys made and revoked with ``llamagate keys`` while the daemon serves, the usage ledger
against the usage objects the clients received (and after a restart), a token budget with the OpenAI SDK
retrying on its own, and what SIGTERM and SIGKILL under load leave in the ledger. No SIGHUP anywhere."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import Daemon, DaemonFactory, process_gone, wait_until
from tests.integration.test_multi_model_e2e import model

pytestmark = pytest.mark.integration

PROMPT = "Name a colour."
# Every answer is exactly max_tokens long (ignore_eos), so its usage is known before it is asked.
EXACT = {"ignore_eos": True, "temperature": 0}
# The store's writer writes every second (proxy.accounts.writer), or each 500 records.
BATCH = 500


def tenant(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "max_concurrency": 2, "max_queue": 8, "show_cache_details": True, **extra}


def with_store(store: Path, *tenants: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"store": {"path": str(store)}, "tenants": [tenant("default"), *tenants], **more}


def two_models(factory: DaemonFactory) -> dict[str, Any]:
    """The demo GGUF served twice, as two models."""
    return {
        "llama": {"prompt_cache_mib": 0, "ctx_checkpoints": 0},
        "models": [model(factory, "chat"), model(factory, "chat2")],
    }


def llamagate(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """A ``llamagate`` command on the daemon's own configuration (its store), as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args, "--config", str(d.config_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def new_key(d: Daemon, tenant_name: str, *flags: str) -> tuple[str, str]:
    """``llamagate keys new``: the key it printed once, and its id."""
    done = llamagate(d, "keys", "new", "--tenant", tenant_name, *flags)
    assert done.returncode == 0, done.stderr
    key = next(line.rsplit(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("API key"))
    return key, key.split("_")[1]


def usage(d: Daemon, *args: str) -> dict[str, Any]:
    done = llamagate(d, "usage", "--format", "json", *args)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def status_of(d: Daemon, key: str, model_name: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    if model_name:
        body["model"] = model_name
    return httpx.post(
        f"{d.base_url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
        trust_env=False,
    )


def within(seconds: float, pred: Callable[[], bool], what: str) -> float:
    """Poll ``pred`` until it holds; fail unless it did within ``seconds`` (the issue's promise)."""
    start = time.monotonic()
    wait_until(pred, what, timeout=seconds)
    return time.monotonic() - start


def test_keys_made_revoked_expired_and_limited_to_a_model_while_serving(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    d = daemon_factory(
        {**with_store(tmp_path / "state" / "llamagate.db", tenant("web")), **two_models(daemon_factory)}
    )
    key, key_id = new_key(d, "web", "--name", "e2e")
    within(1.0, lambda: status_of(d, key, "chat").status_code == 200, "a new store key to answer 200")
    unknown = status_of(d, key[:-6] + "AAAAAA", "chat")
    assert unknown.status_code == 401

    # Revoked: the unknown key's 401, word for word, within a second.
    revoked = llamagate(d, "keys", "revoke", key_id)
    assert revoked.returncode == 0, revoked.stderr
    within(1.0, lambda: status_of(d, key, "chat").status_code == 401, "the revoked key to get 401")
    assert status_of(d, key, "chat").json() == unknown.json()

    # Expired: works until then, then the same 401 (expiry needs no change to the store at all).
    short, _ = new_key(d, "web", "--expires", "6s")
    within(1.0, lambda: status_of(d, short, "chat").status_code == 200, "the short-lived key to answer")
    wait_until(lambda: status_of(d, short, "chat").status_code == 401, "the key to expire", timeout=30)
    assert status_of(d, short, "chat").json() == unknown.json()

    # Limited to one model: a clear 403 for the other, naming the limit.
    limited, _ = new_key(d, "web", "--models", "chat")
    within(1.0, lambda: status_of(d, limited, "chat").status_code == 200, "the limited key on its model")
    other = status_of(d, limited, "chat2")
    assert other.status_code == 403
    assert other.json()["error"] == {
        "message": "this API key may not use the model 'chat2'; it is limited to 'chat'",
        "type": "permission_error",
        "code": "insufficient_scope",
    }
    listed = llamagate(d, "keys", "list", "--format", "json")
    statuses = {k["id"]: k["status"] for k in json.loads(listed.stdout)["keys"]}
    assert statuses[key_id] == "revoked" and sorted(statuses.values()).count("active") == 1


@dataclass
class Sums:
    requests: int = 0
    prompt: int = 0
    cached: int = 0
    completion: int = 0

    def add(self, u: Any) -> None:
        self.requests += 1
        self.prompt += u.prompt_tokens
        details = u.prompt_tokens_details
        self.cached += (details.cached_tokens or 0) if details is not None else 0
        self.completion += u.completion_tokens


def ledger_sums(report: dict[str, Any]) -> dict[tuple[str, str], tuple[int, int, int, int]]:
    return {
        (r["tenant"], r["model"]): (
            r["requests"],
            r["prompt_tokens"],
            r["cached_tokens"],
            r["completion_tokens"],
        )
        for r in report["rows"]
    }


def test_the_ledger_is_exactly_the_usage_the_clients_received_and_survives_a_restart(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    store = tmp_path / "state" / "llamagate.db"
    overrides = {**with_store(store, tenant("a"), tenant("b")), **two_models(daemon_factory)}
    d = daemon_factory(overrides)
    sent: dict[tuple[str, str], Sums] = {}
    unseen_cache: set[tuple[str, str]] = set()
    for name in ("a", "b"):
        key, _ = new_key(d, name)
        wait_until(lambda k=key: _models_ok(d, k), "the store key", timeout=5)  # not a generation: free
        with OpenAI(base_url=d.base_url + "/v1", api_key=key, max_retries=0, timeout=120) as c:
            for m in ("chat", "chat2"):
                sums = sent.setdefault((name, m), Sums())
                messages: Any = [{"role": "user", "content": f"{PROMPT} ({name}, {m})"}]
                for n in (3, 5):
                    answer = c.chat.completions.create(
                        model=m, messages=messages, max_tokens=n, extra_body=EXACT
                    )
                    assert answer.usage is not None
                    sums.add(answer.usage)
                    streamed = list(
                        c.chat.completions.create(
                            model=m,
                            messages=messages,
                            max_tokens=n,
                            stream=True,
                            stream_options={"include_usage": True},
                            extra_body=EXACT,
                        )
                    )
                    assert streamed[-1].usage is not None and streamed[-1].choices == []
                    sums.add(streamed[-1].usage)
                # A stream that did not ask for usage sees none (the proxy asks the child for it and
                # takes the chunk back out), and is charged what the same request reports non-streamed:
                # the same prompt, and exactly max_tokens (ignore_eos).
                twin = c.chat.completions.create(model=m, messages=messages, max_tokens=4, extra_body=EXACT)
                assert twin.usage is not None
                sums.add(twin.usage)
                plain = list(
                    c.chat.completions.create(
                        model=m, messages=messages, max_tokens=4, stream=True, extra_body=EXACT
                    )
                )
                assert plain and all(ch.usage is None and ch.choices for ch in plain)
                sums.requests += 1
                sums.prompt += twin.usage.prompt_tokens
                sums.completion += 4
                unseen_cache.add((name, m))  # its cached tokens were never shown to the client
    total = sum(s.requests for s in sent.values())
    wait_until(lambda: usage(d)["total"]["requests"] == total, "the ledger to hold every request", timeout=30)
    report = ledger_sums(usage(d, "--by", "model"))
    assert set(report) == set(sent)
    for group, s in sent.items():
        requests, prompt, cached, completion = report[group]
        assert (requests, prompt, completion) == (s.requests, s.prompt, s.completion), group
        assert cached >= s.cached if group in unseen_cache else cached == s.cached, group
    before = usage(d, "--by", "model")

    assert d.stop() == 0
    again = daemon_factory(overrides)
    assert usage(again, "--by", "model") == before  # nothing lost, nothing written twice
    assert again.stop() == 0


def test_a_token_budget_refuses_with_retry_after_and_the_sdk_gets_through_once_there_is_room(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    store = tmp_path / "state" / "llamagate.db"
    d = daemon_factory(with_store(store, tenant("capped", budgets={"tokens_per_minute": 200})))
    key, _ = new_key(d, "capped")
    raw = OpenAI(base_url=d.base_url + "/v1", api_key=key, max_retries=0, timeout=120)
    wait_until(lambda: _models_ok(d, key), "the store key", timeout=5)
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 64,
    }
    answered: list[int] = []
    refusal: openai.RateLimitError | None = None
    for _ in range(10):
        try:
            r = raw.chat.completions.with_raw_response.create(**body, extra_body=EXACT)  # type: ignore[arg-type]
        except openai.RateLimitError as exc:
            refusal = exc
            break
        assert r.headers["x-ratelimit-limit-tokens"] == "200"
        assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 200
        usage_ = r.parse().usage
        assert usage_ is not None and usage_.completion_tokens == 64
        answered.append(usage_.total_tokens)
    assert refusal is not None, "no 429 after ten 64-token requests on 200 tokens a minute"
    per_request = max(answered)
    assert sum(answered[:-1]) < 200 <= sum(answered) <= 200 + per_request
    headers = refusal.response.headers
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-limit-tokens"] == "200" and headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-reset-tokens"].endswith("s")
    error = refusal.response.json()["error"]
    assert (error["type"], error["code"]) == ("tokens", "tokens_per_minute")
    raw.close()

    # The OpenAI SDK, default retries: it waits as Retry-After says and gets through.
    refused_before = _refusals(d)
    with OpenAI(base_url=d.base_url + "/v1", api_key=key, timeout=120) as sdk:
        answer = sdk.chat.completions.create(**body, extra_body=EXACT)  # type: ignore[arg-type]
    assert answer.usage is not None and answer.usage.completion_tokens == 64
    assert _refusals(d) > refused_before  # it was refused first, and retried on its own

    # Within any minute, the tenant's charged usage stays within its budget plus one request's tokens.
    wait_until(lambda: len(_rows(store, "capped")) == len(answered) + 1, "every answer in the ledger")
    rows = _rows(store, "capped")
    for at, _tokens in rows:
        in_minute = sum(t for when, t in rows if at - 60 < when <= at)
        assert in_minute <= 200 + per_request, rows


def _models_ok(d: Daemon, key: str) -> bool:
    r = httpx.get(f"{d.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return r.status_code == 200


def _refusals(d: Daemon) -> float:
    text = httpx.get(f"{d.base_url}/metrics", headers={"Authorization": f"Bearer {d.admin_key}"}).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llamagate_rejections_total{") and 'reason="tokens_per_minute"' in line
    )


def _rows(store: Path, tenant_name: str) -> list[tuple[float, int]]:
    conn = sqlite3.connect(store, timeout=10)
    try:
        return [
            (at, p + c)
            for at, p, c in conn.execute(
                "SELECT at, prompt_tokens, completion_tokens FROM usage_events WHERE tenant = ? ORDER BY at",
                (tenant_name,),
            )
        ]
    finally:
        conn.close()


def _count(store: Path) -> int:
    conn = sqlite3.connect(store, timeout=10)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM usage_events").fetchone()[0])
    finally:
        conn.close()


@dataclass
class Load:
    """Clients that keep asking (every other request streamed) until told to stop or refused; each
    completed answer (a whole body, or a stream up to its [DONE]) is counted with the time it ended."""

    d: Daemon
    clients: int = 3
    done: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, i: int) -> None:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, **EXACT}
        headers = {"Authorization": f"Bearer {self.d.inference_key}"}
        url = f"{self.d.base_url}/v1/chat/completions"
        stream = bool(i % 2)
        with httpx.Client(timeout=60, trust_env=False) as c:
            while not self.stop.is_set():
                stream = not stream
                try:
                    if stream:
                        with c.stream("POST", url, json={**body, "stream": True}, headers=headers) as r:
                            ok = r.status_code == 200 and any(ln == "data: [DONE]" for ln in r.iter_lines())
                    else:
                        r = c.post(url, json=body, headers=headers)
                        ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
                except httpx.HTTPError:
                    return  # the daemon is gone
                if ok:
                    with self._lock:
                        self.done.append(time.monotonic())
                elif r.status_code in (429, 503):
                    if r.status_code == 503:
                        return  # draining: no more work is taken
                else:
                    raise AssertionError(f"unexpected answer {r.status_code}")

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(self.clients)]
        for t in threads:
            t.start()
        return threads


def test_sigterm_under_load_writes_a_ledger_row_for_every_completed_request(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    store = tmp_path / "state" / "llamagate.db"
    d = daemon_factory(with_store(store))
    load = Load(d)
    threads = load.start()
    wait_until(lambda: len(load.done) >= 12, "a dozen answers", timeout=120)
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    load.stop.set()
    for t in threads:
        t.join(60)
    assert _count(store) == len(load.done), (len(load.done), d.log_text()[-3000:])


def test_sigkill_under_load_loses_at_most_the_last_batch(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    store = tmp_path / "state" / "llamagate.db"
    d = daemon_factory(with_store(store))
    child = d.child_pid
    load = Load(d)
    threads = load.start()
    wait_until(lambda: len(load.done) >= 30, "thirty answers", timeout=180)
    d.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    d.wait_exit(30)
    load.stop.set()
    for t in threads:
        t.join(60)
    assert child is not None
    wait_until(lambda: process_gone(child), "llama-server to die with its daemon")
    rows, completed = _count(store), len(load.done)
    missing = completed - rows
    recent = sum(1 for t in load.done if t > killed_at - 3.0)
    print(
        f"SIGKILL under load: {completed} completed, {rows} in the ledger, {missing} missing, "
        f"{recent} answered in the last 3 s"
    )
    # What was charged since the writer's last cycle (1 s), never more than one batch, never extra rows.
    assert 0 <= missing <= min(BATCH, recent)


def test_a_store_serve_cannot_use_is_refused_with_exit_2_naming_the_file(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    foreign = tmp_path / "notes.db"
    foreign.write_text("these are my notes, not a database\n")
    d = daemon_factory(with_store(foreign), wait_ready=False)
    assert d.wait_exit(120) == 2
    assert f"{foreign}: not an SQLite database" in d.log_text() + d.stdout_path.read_text()
    checked = llamagate(d, "config", "check")
    assert checked.returncode == 2 and f"{foreign}: not an SQLite database" in checked.stdout
    assert foreign.read_text() == "these are my notes, not a database\n"  # untouched

    # A real store cut short (issue 39: serve died with a raw sqlite3.DatabaseError, exit 1).
    from proxy.accounts.records import Batch, UsageRecord
    from proxy.accounts.sqlite import open_store

    cut = tmp_path / "cut" / "llamagate.db"
    made = open_store(cut)
    made.write(
        Batch(
            usage=tuple(UsageRecord("t", "k", "m", "chat", 1, 0, 1, 200, 0.1, float(i)) for i in range(2000))
        )
    )
    made.close()
    with cut.open("r+b") as f:
        f.truncate(cut.stat().st_size // 2)
    d = daemon_factory(with_store(cut), wait_ready=False)
    assert d.wait_exit(120) == 2
    assert f"{cut}: corrupt" in d.log_text() + d.stdout_path.read_text()

    # One daemon per store file: the second is refused, naming the first one's pid.
    store = tmp_path / "state" / "llamagate.db"
    first = daemon_factory(with_store(store))
    second = daemon_factory(with_store(store), wait_ready=False)
    assert second.wait_exit(120) == 2
    assert f"in use by another llamagate daemon (pid {first.pid})" in second.log_text()
    assert first.readyz()[0] == 200
