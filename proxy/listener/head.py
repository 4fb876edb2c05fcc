"""The front door's side of ``proxy.asgi.head``: rendered header lines written into uvicorn's response head.

uvicorn writes a response's status line and headers with one ``transport.write`` that ends with the
blank line (``RequestResponseCycle.send``, every version this project runs on). For a start message with
rendered lines, the cycle's transport is swapped for that one call for a ``_Splice``, which puts the
lines before the first blank line it writes (a body after it in the same write or not) and hands the
rest on: uvicorn still checks and frames everything else (status, content length or chunked encoding,
keep-alive, its access log). ``tests/unit/proxy/listener`` checks the head against the one uvicorn
writes when the same lines are given as header pairs.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from starlette.types import Message, Send

from proxy.asgi.head import HEAD_LINES


class _Splice:
    """A transport for one ``send`` of a response start: its write of the head gets ``lines`` before the
    head's closing blank line."""

    __slots__ = ("lines", "transport")

    def __init__(self, transport: Any, lines: bytes) -> None:
        self.transport = transport
        self.lines = lines

    def write(self, data: bytes) -> None:
        end = data.find(b"\r\n\r\n") if self.lines else -1  # the head's end, a body after it or not
        if end >= 0:
            data = data[: end + 2] + self.lines + data[end + 2 :]
            self.lines = b""
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def send_with_lines(send: Send, message: Message, lines: bytes) -> None:
    """``send`` (uvicorn's, bound to this request's cycle) of the response start ``message``, with the
    rendered ``lines`` in its head."""
    cycle: Any = getattr(send, "__self__", None)
    if cycle is None or getattr(cycle, "response_started", True) or not hasattr(cycle, "transport"):
        raise RuntimeError("head lines offered for a send that is not a cycle's, or after the response start")
    transport = cycle.transport
    cycle.transport = _Splice(transport, lines)
    try:
        await send(message)
    finally:
        cycle.transport = transport


# What the front door offers as ``scope["extensions"][HEAD_LINES]``: one read-only mapping for every
# request (each request's ``extensions`` is a dict of its own).
OFFER: MappingProxyType[str, Any] = MappingProxyType({"send": send_with_lines})


def offer(scope: dict[str, Any]) -> None:
    """Offer the extension in a request's scope."""
    scope["extensions"] = {HEAD_LINES: OFFER}
