"""Deaths and hangs take one protocol (issue 55): a request in flight at a hang is replayed alone once, as at
a death; a request in flight at two deaths or hangs is poison; a request that was only in flight beside a
hang is answered.

The child is the fake llama-server with ``--hold-on HOLD``: a request whose body holds the marker holds its
"server loop", so nothing but ``/health`` is answered any more (``/slots``, the other request in flight, every
later one), as a request that never yields holds the pinned server's loop while its HTTP thread still
answers ``/health``. ``--request-log`` is the child's own record of what reached it (pid, held or not),
written before it holds or aborts. The daemon is the real one.

The supervisor's watchdog notices such a child by a probe through the task queue (``GET /slots``) once it
owes an answer for ``supervision.loop_deadline_s``, SIGKILLs it, and restarts it as a crash of a ready
child (tests/integration/test_watchdog_e2e.py holds that with the real child). ``_StandInWatchdog`` does
the same here from outside, at once, for every child that logged a held request, so the test does not
wait out the deadline: what is under test is the proxy's protocol after the kill, which is the same
whoever kills. When the watchdog gets there first, the stand-in's kill finds no process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.config.keys import ADMIN, new_key_config
from tests.fakes.fake_child import make_fake_binary
from tests.integration.clients import poison_samples, received, served
from tests.integration.conftest import Daemon, DaemonFactory, wait_until

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
HOLD = "HOLD-THE-LOOP"
# An ordinary request takes this long at the child, so it is surely in flight when the other one holds
# the loop (and the fake never answers it once the loop is held).
ANSWER_S = 2.0


def _children_of(log: Path, text: str) -> list[int]:
    """The pids of the children that received a request whose body holds ``text``, in order."""
    return [int(r["pid"]) for r in received(log) if text in r["body"]]


class _StandInWatchdog:
    """Stands in for the supervisor's watchdog, without its deadline: SIGKILLs every child that logged a
    held request, as the watchdog does to a child whose loop misses its probe."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.killed: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            for record in received(self.log):
                pid = int(record["pid"])
                if record.get("held") and pid not in self.killed:
                    self.killed.append(pid)
                    with contextlib.suppress(ProcessLookupError):  # the real watchdog got there first
                        os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> _StandInWatchdog:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def _post(d: Daemon, key: str, prompt: str) -> httpx.Response:
    """POST a completion as a client that honours 503 ``not_ready`` with Retry-After."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    with httpx.Client(timeout=120, trust_env=False) as c:
        return served(c, d.base_url + "/v1/completions", body, key)


def _daemon(daemon_factory: DaemonFactory, fake: Path) -> tuple[Daemon, dict[str, str], dict[str, Any]]:
    admin_key, admin = new_key_config("default", ADMIN)
    attacker_key, attacker = new_key_config("default")
    other_key, other = new_key_config("other")
    d = daemon_factory(
        {
            "proxy": {"poison": {"strikes": 2, "window_s": 600, "cooldown_s": 600}},
            "tenants": [
                {"name": "default", "max_concurrency": 2, "max_queue": 8},
                {"name": "other", "max_concurrency": 2, "max_queue": 8},
            ],
            "keys": [admin, attacker, other],
        },
        binary=fake,
    )
    d.keys.update(admin=admin_key, inference=attacker_key)
    return d, {"admin": admin_key, "attacker": attacker_key, "other": other_key}, attacker


def _ready_and_never_failed(d: Daemon, generation0: int, deaths: int) -> None:
    def replaced() -> bool:
        code, ready = d.readyz()
        return code == 200 and ready["state"] == "READY" and int(ready["generation"]) - generation0 == deaths

    wait_until(replaced, f"the model READY after {deaths} deaths", timeout=60)
    assert d.admin_status().get("state") != "FAILED"
    failed = [r for r in d.log_records() if r.get("to") == "FAILED"]
    assert not failed, failed


def test_hang_then_hang_again_is_poison_and_a_request_beside_the_hang_is_answered(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    log = tmp_path / "received.jsonl"
    fake = make_fake_binary(
        tmp_path / "fake", "--hold-on", HOLD, "--request-log", str(log), "--answer-seconds", str(ANSWER_S)
    )
    d, keys, attacker = _daemon(daemon_factory, fake)
    generation0 = int(d.readyz()[1]["generation"])
    with _StandInWatchdog(log) as watchdog, ThreadPoolExecutor(2) as pool:
        # Another tenant's ordinary request is at the child when the marked one holds the loop.
        beside: Future[httpx.Response] = pool.submit(_post, d, keys["other"], "ordinary request beside")
        wait_until(
            lambda: bool(_children_of(log, "ordinary request beside")), "the ordinary request at the child"
        )
        held = _post(d, keys["attacker"], f"{HOLD} once")
        answered = beside.result(timeout=120)
    # The marked request: held its child, replayed alone, held the next one: poison, its client told so.
    assert held.status_code == 502, held.text
    error = held.json()["error"]
    assert error["code"] == "poison_request", error
    assert HOLD not in error["message"], error
    marked = _children_of(log, f"{HOLD} once")
    assert len(marked) == 2 and len(set(marked)) == 2, marked  # two children, each killed for its hang
    assert watchdog.killed[:2] == marked, (watchdog.killed, marked)
    # The ordinary request: in flight at one hang only, replayed alone on a child the suspect never
    # shared, and answered there.
    assert answered.status_code == 200, answered.text
    ordinary = _children_of(log, "ordinary request beside")
    assert len(ordinary) == 2 and ordinary[0] == marked[0], (ordinary, marked)
    assert ordinary[1] != marked[1], "the replay shared its child with the suspect's replay"
    # Counted once, for the marked request's tenant and key only; the body is refused from every key now
    # and reaches no child.
    samples = poison_samples(d, keys["admin"])
    assert samples == {("default", attacker["id"]): 1.0}, samples
    again = _post(d, keys["other"], f"{HOLD} once")
    assert again.status_code == 429 and again.json()["error"]["code"] == "poison_body", again.text
    assert len(_children_of(log, f"{HOLD} once")) == 2
    _ready_and_never_failed(d, generation0, deaths=2)


def test_hang_then_death_is_poison(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    log = tmp_path / "received.jsonl"
    once = tmp_path / "hold-once"
    once.touch()
    # The marked request holds the first child's loop (the fake removes ``once`` as it holds), then
    # aborts the next child (SIGABRT, as a failed GGML_ASSERT does).
    fake = make_fake_binary(
        tmp_path / "fake",
        *("--hold-on", HOLD, "--hold-file", str(once), "--abort-on", HOLD, "--request-log", str(log)),
    )
    d, keys, attacker = _daemon(daemon_factory, fake)
    generation0 = int(d.readyz()[1]["generation"])
    with _StandInWatchdog(log) as watchdog:
        answer = _post(d, keys["attacker"], f"{HOLD} then abort")
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["code"] == "poison_request", answer.text
    records = [r for r in received(log) if HOLD in r["body"]]
    assert [r["held"] for r in records] == [True, False], records  # a hang, then a death
    assert len({r["pid"] for r in records}) == 2, records
    assert watchdog.killed == [records[0]["pid"]], watchdog.killed
    assert poison_samples(d, keys["admin"]) == {("default", attacker["id"]): 1.0}
    _ready_and_never_failed(d, generation0, deaths=2)
