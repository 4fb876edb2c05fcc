"""What the listener says when it refuses: a whole HTTP answer written straight to the socket (status
line, OpenAI-shaped JSON body, ``connection: close``), and one log line per reason per interval."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

# One log line per reason per minute at most: a hostile client must not be able to fill the disk.
LOG_INTERVAL_S = 60.0

_TYPES = {408: "timeout_error", 503: "unavailable_error"}


def refusal(status: int, message: str, extra: tuple[bytes, ...] = ()) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "code": status}},
        separators=(",", ":"),
    ).encode()
    return b"".join(
        [
            STATUS_LINE[status],
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            *extra,
            b"connection: close\r\n\r\n",
            body,
        ]
    )


OUT_OF_FDS = refusal(
    503, "the server cannot take more connections now; retry shortly", (b"retry-after: 1\r\n",)
)


class RateLimitedLog:
    """At most one line per key per interval; the next line says how many were not written."""

    def __init__(
        self, logger: logging.Logger, interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def event(self, key: str, message: str, level: int = logging.WARNING) -> bool:
        """Count one event; write a line if the key's interval has passed. True if a line was written."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        held = self._held.pop(key, 0)
        self._last[key] = now
        suffix = f" ({held} more since the last such line)" if held else ""
        self.logger.log(level, message + suffix, extra={"fields": {"reason": key, "suppressed": held}})
        return True
