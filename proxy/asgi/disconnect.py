"""Noticing a client that went away, whatever the request is doing at the time.

uvicorn's ``send`` silently drops messages once the client is gone, so a relay that only sends would
notice nothing while it waits in the queue, for the first token, or for a non-streamed answer. The
watcher task waits on ``receive()`` for ``http.disconnect`` and cancels the request task; the cancellation
unwinds through admission (permit released or waiter removed) and the upstream response (its connection
closed, which makes llama-server cancel the slot's task). Same mechanism as ``asyncio.timeout``: cancel,
then ``uncancel`` at the boundary and raise ``ClientGone`` instead.

An operator's cancel (``DELETE /admin/requests/{id}``, ``proxy.admission.inflight``) comes through the
same door: ``cancel(error)`` cancels the request task the same way, and the boundary raises ``error``
instead of ``ClientGone`` (a stream already under way ends with it as an error event, sent by the
route before it gets here).

The body must be fully read before entering: afterwards ``receive()`` has nothing else to deliver.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from starlette.types import Receive

from proxy.errors import ProxyError


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


class ClientWatch:
    __slots__ = ("_receive", "_task", "_watcher", "cancelled", "complete", "end", "gone", "last")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task: asyncio.Task[object] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.gone = False
        # Set by ``cancel``: what the request ends with instead of its answer.
        self.cancelled: ProxyError | None = None
        # Set by the relay just before the last body message: uvicorn reports "disconnect" once a
        # response is complete, which is not the client leaving.
        self.complete = False
        # Set by a stream's relay: the bytes of the event that ends its route's stream (``[DONE]``,
        # ``message_stop``, ...; None where only the connection's end says it), and the last bytes it
        # sent. SDKs close the connection as soon as they have that event, often before the child's
        # stream has reached its own end: such a client had the whole answer, it did not leave early.
        self.end: bytes | None = None
        self.last = b""

    async def _watch(self) -> None:
        try:
            while True:
                message = await self._receive()
                if message["type"] == "http.disconnect":
                    break
        except asyncio.CancelledError:
            # Only ``__aexit__`` cancels it. Ended without keeping the exception: a cancelled task keeps
            # it, and its traceback holds these frames, the request's objects with them, in a cycle that
            # only the garbage collector frees (every request's, until a full collection: the daemon's
            # memory grew with the requests served, issue 56).
            return
        if not self.complete and self._task is not None and self.cancelled is None:
            if self.had_all():
                # The relay reads the child's end (it follows the last event) and ends as complete.
                self.complete = True
                return
            self.gone = True
            self._task.cancel()

    def had_all(self) -> bool:
        """Whether the last event sent is the stream's final one: a client that leaves then had
        everything the answer holds. The last event is what follows the last blank line: a newline
        inside an event's JSON is escaped, so a generated text that spells the final event (a model
        can be asked to) is never taken for it."""
        end, last = self.end, self.last
        if end is None or not last.endswith(b"\n\n"):
            return False
        start = last.rfind(b"\n\n", 0, len(last) - 2)
        return last.startswith(end, 0 if start < 0 else start + 2)

    def cancel(self, error: ProxyError) -> bool:
        """Stop the request where it waits and end it with ``error``; False when it is already ending
        (its last bytes are on their way, its client left, or another cancel came first)."""
        if self.complete or self.gone or self.cancelled is not None or self._task is None:
            return False
        self.cancelled = error
        self._task.cancel()
        return True

    async def __aenter__(self) -> ClientWatch:
        self._task = asyncio.current_task()
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # No await in here: a cancel can only have landed inside the block, never after it.
        if self._watcher is not None:
            self._watcher.cancel()
        # A cancel that comes after the block must not hit whatever the task does next.
        task, self._task = self._task, None
        if (self.gone or self.cancelled is not None) and task is not None:
            task.uncancel()
            if exc_type is asyncio.CancelledError:
                if self.cancelled is not None:
                    raise self.cancelled from None
                raise ClientGone from None
