"""Request body checks: size (declared and counted), JSON object, model name, token cap."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.asgi.body import parse_object, read_body
from proxy.asgi.disconnect import ClientGone
from proxy.errors import BadRequest, PayloadTooLarge


def receiver(*parts: bytes, disconnect: bool = False) -> Any:
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)
    ]
    if disconnect:
        messages = [*messages[:-1], {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    return receive


async def test_reads_a_body_in_parts() -> None:
    assert await read_body(receiver(b"ab", b"cd", b""), None, 10) == b"abcd"


async def test_declared_length_over_the_limit_is_refused_without_reading() -> None:
    async def never() -> dict[str, Any]:
        raise AssertionError("must not read")

    with pytest.raises(PayloadTooLarge) as info:
        await read_body(never, 11, 10)
    assert info.value.status == 413


async def test_counted_length_over_the_limit_is_refused() -> None:
    with pytest.raises(PayloadTooLarge):
        await read_body(receiver(b"x" * 6, b"x" * 6), None, 10)


async def test_client_leaving_during_upload() -> None:
    with pytest.raises(ClientGone):
        await read_body(receiver(b"ab", b"cd", disconnect=True), None, 10)


@pytest.mark.parametrize("raw", [b"", b"{", b"[1,2]", b'"text"', b"null", b"\xff\xfe", b"3"])
def test_non_objects_are_400(raw: bytes) -> None:
    with pytest.raises(BadRequest) as info:
        parse_object(raw)
    assert info.value.status == 400
    assert info.value.body().startswith(b'{"error":{')


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested more than 64 levels"),
        (b'{"a":' + b"[" * 65 + b"]" * 65 + b"}", "nested more than 64 levels"),
        (b'{"a":' + b'{"b":' * 70 + b"1" + b"}" * 70 + b"}", "nested more than 64 levels"),
        (b'{"a":"\\ud800"}', "lone UTF-16 surrogate"),
        (b'{"\\udfff":1}', "lone UTF-16 surrogate"),
        (b'{"a":NaN}', "NaN"),
        (b'{"a":Infinity}', "Infinity"),
        (b'{"a":-Infinity}', "-Infinity"),
        (b'{"a":1e999}', "overflows a double"),
        (b'{"a":-1e400}', "overflows a double"),
        (b'{"a":123456789012345678901}', "beyond 64 bits"),
        ('{"a":1}'.encode("utf-16"), "not UTF-8"),
        ('{"a":1}'.encode("utf-32"), "not UTF-8"),
        ('{"a":1}'.encode("utf-16-le"), "not valid JSON"),
        (b'\xef\xbb\xbf{"a":1}', "not valid JSON"),  # a UTF-8 byte order mark
    ],
)
def test_malformed_json_is_400_naming_the_problem(raw: bytes, said: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse_object(raw)
    assert said in err.value.message


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a":' + b"[" * 63 + b"]" * 63 + b"}",  # 64 levels with the object
        b'{"a":"\\ud83d\\ude00 a pair is fine","b":"[[[[ brackets in strings ]]]]"}',
        b'{"a":18446744073709551615,"b":-9223372036854775808,"c":"12345678901234567890123"}',
        b'{"prompt":' + b"[[1,2]," * 40 + b"[3]" + b"]" * 40 + b"}",
        b'{"a":1.5e300,"b":[' + b"[1]," * 200 + b"[2]]}",  # many arrays, shallow
    ],
)
def test_acceptable_json_passes(raw: bytes) -> None:
    assert isinstance(parse_object(raw), dict)
