"""Header lines the proxy renders itself, and the ASGI extension that writes them into a response head.

A budgeted caller's answers carry six ``x-ratelimit-*`` lines (``proxy.accounts.budgets``). Given to the
server as ASGI header pairs, uvicorn checks each pair's name and value with a regular expression and
lowercases the name on every answer (``RequestResponseCycle.send``): for those six lines that was about
20,000 machine instructions per answer (callgrind), more than the budgets' own check. Their names are
fixed lower-case constants and their values digits or durations, so they are rendered once as bytes
(``name: value\\r\\n`` lines) instead, and written into the head as they are where the server offers
this extension (``scope["extensions"][HEAD_LINES]``: the front door's protocol does,
``proxy.listener.head``); under any other server they go as ordinary header pairs (``as_headers``).

Only lines whose every byte the proxy chose may be rendered: a value taken from a request or from the
child must go as a header pair, through the server's checks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import Message, Scope, Send

HEAD_LINES = "llamagate.head_lines"

# The extension's "send": the server's ``send`` for this request, a response start, and rendered lines
# to write into its head beside the start's own headers.
SendWithLines = Callable[[Send, Message, bytes], Awaitable[None]]


def as_headers(lines: bytes) -> list[tuple[bytes, bytes]]:
    """Rendered lines as ASGI header pairs (for a server without the extension)."""
    pairs: list[tuple[bytes, bytes]] = []
    for text in lines.split(b"\r\n"):
        if text:
            name, _, value = text.partition(b": ")
            pairs.append((name, value))
    return pairs


def lines_writer(scope: Scope) -> SendWithLines | None:
    """The server's writer of rendered lines, if it offers one for this request."""
    extensions = scope.get("extensions")
    if not extensions:
        return None
    offered = extensions.get(HEAD_LINES)
    return offered["send"] if offered else None
