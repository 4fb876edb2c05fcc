"""What every stream meter keeps of a stream on its way through (``proxy.streams.openai`` for the
``data:``-only dialects, ``proxy.streams.events`` for the typed-event ones): when the first and the last
token arrived, how many tokens it counted, the child's own count, and the chunks that carried it. The
dialects differ only in how ``feed`` finds these in the bytes."""

from __future__ import annotations

# Report chunks kept at most (oldest dropped): one per sequence of a request, or every chunk of a stream
# with ``timings_per_token``, whose latest ones are what counts.
MAX_REPORTS = 256


def keep(reports: list[bytes], chunk: bytes) -> None:
    reports.append(chunk)
    if len(reports) > MAX_REPORTS:
        del reports[0]


class Meter:
    __slots__ = ("_tail", "counted", "first_at", "last_at", "reported", "reports")

    def __init__(self) -> None:
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.counted = 0
        self.reported: int | None = None
        # The chunks that carried the child's own figures, for the usage ledger (``proxy.streams.usage``).
        self.reports: list[bytes] = []
        # End of the previous chunk: a figure split across two reads is still found.
        self._tail = b""

    def feed(self, chunk: bytes, now: float) -> bool:
        """Account for one chunk; True when it carried the first token."""
        raise NotImplementedError

    def ttft_from(self, started: float) -> float | None:
        return None if self.first_at is None else self.first_at - started

    @property
    def tokens(self) -> int:
        """The child's own count when it sent one, else the tokens counted."""
        return self.reported if self.reported is not None else self.counted

    def tpot(self) -> float | None:
        """Time per output token: (last token's arrival - first token's) / (tokens - 1)."""
        n = self.tokens
        if self.first_at is None or self.last_at is None or n < 2:
            return None
        return (self.last_at - self.first_at) / (n - 1)
