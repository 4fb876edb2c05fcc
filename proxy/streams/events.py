"""A byte-level meter for llama-server's typed-event streams (Responses and Anthropic Messages).

Both dialects send ``event: NAME\\ndata: {json}\\n\\n``, with compact JSON (nlohmann's ``dump()``: no
spaces, keys sorted). Many events carry no token (``response.created``, ``content_block_start``,
``message_stop``...), so counting ``data:`` lines as the OpenAI meter does would overcount: only the
delta events named by the format are tokens, and the first one with non-empty text is the first token.
The child's own count (``"output_tokens":N`` in ``response.completed`` / ``message_delta``) wins when
it arrives; the last figure seen is kept (Anthropic's ``message_start`` already says ``0``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from proxy.streams.openai import keep


@dataclass(frozen=True)
class EventSpec:
    # Event names whose events each carry one generated piece (``event: <name>`` lines).
    delta_events: tuple[bytes, ...]
    # Matches a delta with non-empty text: the first such event is the first token.
    first_text: re.Pattern[bytes]
    # The child's own count of generated tokens.
    reported: re.Pattern[bytes]


class EventMeter:
    __slots__ = ("_markers", "_spec", "_tail", "counted", "first_at", "last_at", "reported", "reports")

    def __init__(self, spec: EventSpec) -> None:
        self._spec = spec
        self._markers = tuple(b"event: " + name + b"\n" for name in spec.delta_events)
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.counted = 0
        self.reported: int | None = None
        # The chunks that carried the child's count (its usage): for the usage ledger (``StreamMeter``).
        self.reports: list[bytes] = []
        # End of the previous chunk: a count split across two reads is still found.
        self._tail = b""

    def feed(self, chunk: bytes, now: float) -> bool:
        """Account for one chunk; True when it carried the first token."""
        deltas = sum(chunk.count(m) for m in self._markers)
        first = False
        if deltas and self.first_at is None and self._spec.first_text.search(chunk) is not None:
            self.first_at = now
            first = True
        if self.first_at is not None and deltas:
            self.counted += deltas
            self.last_at = now
        text = self._tail + chunk
        found = self._spec.reported.findall(text)
        if found:
            self.reported = int(found[-1])
            keep(self.reports, chunk)
        self._tail = b"" if text.endswith(b"\n\n") else text[-256:]
        return first

    def ttft_from(self, started: float) -> float | None:
        return None if self.first_at is None else self.first_at - started

    @property
    def tokens(self) -> int:
        return self.reported if self.reported else self.counted

    def tpot(self) -> float | None:
        n = self.tokens
        if self.first_at is None or self.last_at is None or n < 2:
            return None
        return (self.last_at - self.first_at) / (n - 1)
