"""The registry of queued and running requests (``proxy.admission.inflight``): rows, order, cancel by
id (every request sharing it, none already ending), and the wait for a cancelled request to leave."""

from __future__ import annotations

import asyncio

from proxy.admission.inflight import InFlight, Tracked
from proxy.errors import Cancelled, ProxyError


class Handle:
    def __init__(self, ending: bool = False) -> None:
        self.ending = ending
        self.errors: list[ProxyError] = []

    def cancel(self, error: ProxyError) -> bool:
        if self.ending:
            return False
        self.errors.append(error)
        return True


class Meter:
    tokens = 0


class Relay:
    def __init__(self) -> None:
        self.meter: Meter | None = None


def entry(request_id: str, handle: Handle | None = None, model: str = "chat") -> Tracked:
    return Tracked(request_id, "team", "k1", model, "/v1/chat/completions", handle or Handle())


def test_rows_say_state_times_and_tokens_queued_first() -> None:
    reg = InFlight()
    first, second = entry("a"), entry("b")
    reg.add(first)
    reg.add(second)
    relay = Relay()
    first.running(relay)
    rows = reg.rows()
    assert [r["id"] for r in rows] == ["b", "a"]
    queued, running = rows
    assert queued["state"] == "queued" and queued["running_s"] is None and queued["tokens"] == 0
    assert running["state"] == "running" and isinstance(running["running_s"], float)
    assert running["tokens"] == 0  # no meter yet: the attempt's answer has not begun
    relay.meter = Meter()
    relay.meter.tokens = 42
    assert reg.rows()[1]["tokens"] == 42  # read from the meter when asked, nothing per token
    assert set(running) == {
        "id",
        "tenant",
        "key_id",
        "model",
        "route",
        "state",
        "waited_s",
        "running_s",
        "tokens",
    }
    first.queued()  # a replay waits again
    assert [r["state"] for r in reg.rows()] == ["queued", "queued"]
    reg.remove(first)
    reg.remove(first)  # twice is harmless
    assert len(reg) == 1


def test_waited_stops_at_admission() -> None:
    e = entry("a")
    e.queued_at = 100.0
    e.running(Relay())
    e.running_at = 103.0
    row = e.row(110.0)
    assert row["waited_s"] == 3.0 and row["running_s"] == 7.0
    e.queued()
    assert e.row(110.0)["waited_s"] == 10.0


def test_cancel_hits_every_request_with_the_id_each_with_its_own_error() -> None:
    reg = InFlight()
    one, two, other, ending = Handle(), Handle(), Handle(), Handle(ending=True)
    for request_id, handle in (("x", one), ("x", two), ("y", other), ("x", ending)):
        reg.add(entry(request_id, handle))
    cancelled = reg.cancel("x", Cancelled)
    assert len(cancelled) == 2
    assert all(row["id"] == "x" for row in cancelled.values())
    assert len(one.errors) == len(two.errors) == 1 and one.errors[0] is not two.errors[0]
    assert other.errors == [] and ending.errors == []
    assert reg.cancel("nope", Cancelled) == {}
    assert len(reg.find("x")) == 3  # cancelled requests leave when they end, not at the cancel


async def test_left_is_done_when_the_entry_leaves() -> None:
    reg = InFlight()
    e = entry("a")
    reg.add(e)
    left = reg.left(e)
    assert not left.done()
    asyncio.get_running_loop().call_soon(reg.remove, e)
    await asyncio.wait_for(left, 1.0)
    assert reg.left(e).done()  # already gone: done at once
