"""The request headers that ask admission for less: ``X-LlamaGate-Priority`` may lower a request's
priority (a higher one is clamped by the gate), ``X-LlamaGate-Max-Wait`` shortens its queue wait; a bad
value is a 400 naming the header."""

from __future__ import annotations

import pytest

from proxy.admission.asks import Asked, asked
from proxy.errors import BadRequest


def test_a_request_without_the_headers_asks_nothing() -> None:
    assert asked([(b"authorization", b"Bearer x"), (b"content-type", b"application/json")]) is None
    assert asked([]) is None


@pytest.mark.parametrize(
    ("value", "level"),
    [(b"batch", 0), (b"Interactive", 10), (b"default", 5), (b"7", 7), (b" 0 ", 0), (b"100", 100)],
)
def test_priority_names_and_integers(value: bytes, level: int) -> None:
    assert asked([(b"x-llamagate-priority", value)]) == Asked(priority=level)


@pytest.mark.parametrize(("value", "seconds"), [(b"0", 0.0), (b"2.5", 2.5), (b"30", 30.0), (b"1e1", 10.0)])
def test_max_wait_seconds(value: bytes, seconds: float) -> None:
    assert asked([(b"x-llamagate-max-wait", value)]) == Asked(max_wait_s=seconds)


def test_both_together() -> None:
    headers = [(b"x-llamagate-max-wait", b"1"), (b"x-llamagate-priority", b"batch")]
    assert asked(headers) == Asked(priority=0, max_wait_s=1.0)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (b"x-llamagate-priority", b"urgent"),
        (b"x-llamagate-priority", b"101"),
        (b"x-llamagate-priority", b"-1"),
        (b"x-llamagate-priority", b"2.5"),
        (b"x-llamagate-priority", b""),
        (b"x-llamagate-priority", "h\u00f6ch".encode()),
        (b"x-llamagate-priority", b"1" * 40),
        (b"x-llamagate-max-wait", b"-1"),
        (b"x-llamagate-max-wait", b"soon"),
        (b"x-llamagate-max-wait", b"nan"),
        (b"x-llamagate-max-wait", b"inf"),
        (b"x-llamagate-max-wait", b"1e400"),
        (b"x-llamagate-max-wait", b""),
    ],
)
def test_a_bad_value_is_a_400_naming_the_header(name: bytes, value: bytes) -> None:
    with pytest.raises(BadRequest) as raised:
        asked([(name, value)])
    shown = {b"x-llamagate-priority": "X-LlamaGate-Priority", b"x-llamagate-max-wait": "X-LlamaGate-Max-Wait"}
    assert raised.value.status == 400
    assert raised.value.message.startswith(shown[name])


@pytest.mark.parametrize("name", [b"x-llamagate-priority", b"x-llamagate-max-wait"])
def test_a_header_sent_twice_is_refused(name: bytes) -> None:
    with pytest.raises(BadRequest, match="given twice"):
        asked([(name, b"0"), (name, b"0")])
