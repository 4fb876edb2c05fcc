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

from proxy.streams.meter import Meter, keep


@dataclass(frozen=True)
class EventSpec:
    # Event names whose events each carry one generated piece (``event: <name>`` lines).
    delta_events: tuple[bytes, ...]
    # Matches a delta with non-empty text: the first such event is the first token.
    first_text: re.Pattern[bytes]
    # The child's own count of generated tokens.
    reported: re.Pattern[bytes]


class EventMeter(Meter):
    __slots__ = ("_markers", "_spec")

    def __init__(self, spec: EventSpec) -> None:
        super().__init__()
        self._spec = spec
        self._markers = tuple(b"event: " + name + b"\n" for name in spec.delta_events)

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

    @property
    def tokens(self) -> int:
        # A reported 0 is not a count yet: Anthropic's ``message_start`` says ``"output_tokens":0``.
        return self.reported if self.reported else self.counted
