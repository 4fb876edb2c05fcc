"""A hang reaches OpenTelemetry through the daemon's ``Observability`` (the supervisor's ``on_hang``), and a
failing exporter never reaches the supervisor."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import pytest

from supervisor.config.schema import Config
from supervisor.daemon.observability import Observability


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.events: list[tuple[str, dict[str, str | int | float]]] = []

    def record(self, ctx: object, duration_s: float) -> None:
        raise AssertionError("no request here")

    def child_event(self, name: str, attributes: Mapping[str, str | int | float]) -> None:
        if self.fail:
            raise RuntimeError("collector down")
        self.events.append((name, dict(attributes)))

    def shutdown(self) -> None:
        return None


def observability() -> Observability:
    return Observability(Config(), lambda: {}, lambda: {}, lambda: 0.0)


def test_a_hang_is_one_span_naming_the_model_generation_and_reason() -> None:
    obs = observability()
    obs.child_hung("chat", "failed: hung: ...", 3)  # telemetry off: nothing, no error
    recorder = Recorder()
    obs.telemetry = recorder
    reason = "failed: hung: the server loop did not answer GET /slots for 10.0 s"
    obs.child_hung("chat", reason, 3)
    assert recorder.events == [
        (
            "llamagate.child.hang",
            {
                "llamagate.model": "chat",
                "llamagate.child.generation": 3,
                "llamagate.child.reason": reason,
            },
        )
    ]


def test_a_failing_exporter_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    obs = observability()
    obs.telemetry = Recorder(fail=True)
    with caplog.at_level(logging.ERROR):
        obs.child_hung("chat", "failed: hung: ...", 1)
    assert "could not export the hang event" in caplog.text
