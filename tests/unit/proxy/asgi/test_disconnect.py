"""``ClientWatch``: a client that leaves mid-answer cancels the request; one that leaves once it has the
stream's last event had the whole answer."""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message

from proxy.asgi.disconnect import ClientGone, ClientWatch
from proxy.streams.formats import ANTHROPIC, NATIVE, OPENAI, RESPONSES, StreamFormat
from tests.fakes.fake_upstream import eventually

# The last writes of llama-server's streams, as its formatters shape them (server-common.cpp).
_OPENAI_LAST = b"data: [DONE]\n\n"
_ANTHROPIC_LAST = (
    b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":4}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)
_RESPONSES_LAST = b'event: response.completed\ndata: {"type":"response.completed"}\n\n'
_NATIVE_LAST = b'data: {"content":"","stop":true,"timings":{"predicted_n":4}}\n\n'
_TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'


@pytest.mark.parametrize(
    ("fmt", "last", "had_all"),
    [
        (OPENAI, _OPENAI_LAST, True),
        (OPENAI, _TOKEN, False),
        # A model made to write the final event: its text is inside an event, not an event of its own.
        (
            OPENAI,
            b'data: {"choices":[{"index":0,"delta":{"content":"\\n\\ndata: [DONE]\\n\\n"}}]}\n\n',
            False,
        ),
        (OPENAI, _TOKEN + b'data: {"choices":[{"delta":{"content":"data: [DONE]"}}]}\n\n', False),
        (OPENAI, _TOKEN + _OPENAI_LAST, True),
        (ANTHROPIC, _ANTHROPIC_LAST, True),
        (ANTHROPIC, _ANTHROPIC_LAST[: _ANTHROPIC_LAST.rindex(b"data:")], False),  # its data not yet out
        (RESPONSES, _RESPONSES_LAST, True),
        (RESPONSES, _RESPONSES_LAST + b'event: response.output_text.delta\ndata: {"delta":"x"}\n\n', False),
        # Each prompt of an array ends with its own "stop": only the connection's end says it is over.
        (NATIVE, _NATIVE_LAST, False),
    ],
)
def test_the_stream_s_last_event_is_read_from_the_last_bytes_sent(
    fmt: StreamFormat, last: bytes, had_all: bool
) -> None:
    watch = ClientWatch(_never)
    watch.end, watch.last = fmt.end, last
    assert watch.had_all() is had_all


async def _never() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _run(last: bytes) -> tuple[ClientWatch, BaseException | None]:
    """A request that has sent ``last`` of an OpenAI stream and waits for the child's end when its
    client disconnects."""
    left = asyncio.Event()
    child_ended = asyncio.Event()

    async def receive() -> Message:
        await left.wait()
        return {"type": "http.disconnect"}

    watch = ClientWatch(receive)
    error: BaseException | None = None
    try:
        async with watch:
            watch.end, watch.last = OPENAI.end, last
            left.set()
            # The child's end comes once the watch has dealt with the disconnect (or never is needed).
            ender = asyncio.ensure_future(eventually(lambda: watch.complete or watch.gone))
            ender.add_done_callback(lambda _: child_ended.set())
            await child_ended.wait()  # the relay reading the child's end
    except ClientGone as exc:
        error = exc
    return watch, error


async def test_a_client_that_leaves_after_done_lets_the_request_end_as_complete() -> None:
    watch, error = await _run(_OPENAI_LAST)
    assert error is None and watch.complete and not watch.gone


async def test_a_client_that_leaves_before_done_is_gone() -> None:
    watch, error = await _run(_TOKEN)
    assert isinstance(error, ClientGone) and watch.gone and not watch.complete
