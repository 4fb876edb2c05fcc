"""Timing a stream on the way through without parsing it.

The relay forwards raw upstream chunks untouched; this meter only looks at them. Parsing every event as
JSON would cost more than the rest of the relay, so it works on bytes: llama-server writes compact JSON
(no spaces after ``:``), one ``data: {...}\\n\\n`` event per token, then a last chunk with ``timings``, an
optional usage chunk and ``data: [DONE]``.

- time to first token: arrival of the first event carrying non-empty generated text
  (``content``, ``reasoning_content`` for chat, ``text`` for completions); the role-only opening chunk
  of a chat stream does not count.
- tokens: the child's own count (``usage.completion_tokens`` or ``timings.predicted_n``) when it sends
  one, else the number of events from the first token on.
- time per output token: (last token arrival - first token arrival) / (tokens - 1).
- ``reports``: the chunks that carried the child's own figures (``usage``, ``timings``), kept for the
  usage ledger (``proxy.streams.usage`` parses them once the stream is over): a stream's last one or
  two chunks, found by the search the count needs anyway, so the ledger costs the stream nothing more.

Substrings are looked for with ``bytes.find``, not ``in``: CPython 3.11's ``bytes.__contains__`` first
tries its operand as an integer and, for a bytes operand, builds and drops a formatted ``TypeError`` each
time (about 1,500 machine instructions; three per token here were 7 % of the proxy's whole work on a
streamed request, counted with callgrind).
"""

from __future__ import annotations

import re

from proxy.streams.meter import Meter, keep

_FIRST_TEXT = re.compile(rb'"(?:content|reasoning_content|text)":"[^"]')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')
_PREDICTED_N = re.compile(rb'"predicted_n":(\d+)')


class StreamMeter(Meter):
    __slots__ = ()

    def feed(self, chunk: bytes, now: float) -> bool:
        """Account for one chunk; True when it carried the first token."""
        first = False
        if self.first_at is None:
            if _FIRST_TEXT.search(chunk) is None:
                if chunk.find(b'"timings"') >= 0 or chunk.find(b'"usage"') >= 0:
                    keep(self.reports, chunk)  # an answer without any text still reports its usage
                return False
            self.first_at = now
            first = True
        if self._tail or chunk.find(b'"usage"') >= 0 or chunk.find(b'"timings"') >= 0:
            keep(self.reports, chunk)
            self._find_counts(self._tail + chunk)
            if chunk.find(b'"choices":[]') >= 0:
                return first  # the usage chunk carries no token
        events = chunk.count(b"data: ")
        if chunk.find(b"[DONE]") >= 0:
            events -= 1
        if events > 0:
            self.counted += events
            self.last_at = now
        return first

    def _find_counts(self, text: bytes) -> None:
        m = _COMPLETION_TOKENS.search(text) or _PREDICTED_N.search(text)
        if m is not None:
            self.reported = int(m.group(1))
            self._tail = b""
        elif not text.endswith(b"\n\n"):
            self._tail = text[-256:]
        else:
            self._tail = b""


def count_tokens_in_body(body: bytes) -> int:
    """Generated tokens reported in a non-streamed answer (0 when absent)."""
    m = _COMPLETION_TOKENS.search(body) or _PREDICTED_N.search(body)
    return int(m.group(1)) if m else 0
