"""The operator's request routes (admin only), over the door's registry (``proxy.admission.inflight``).

``GET /admin/requests``: every generation request queued or running, for every model, as
``{"requests": [{"id", "tenant", "key_id", "model", "route", "state", "waited_s", "running_s",
"tokens"}]}``; ids, names and numbers, never a prompt or a completion.

``DELETE /admin/requests/{id}``: cancel the request(s) with that ``X-Request-ID``. A queued one leaves
its queue at once, a running one is stopped where it waits for the child's next token (its connection to
the child is closed, so llama-server frees the slot); either way its client gets ``410 cancelled_error``
(``proxy.errors.Cancelled``; an error event when its stream had begun). The answer comes once the
cancelled requests have left the registry (or after ``_LEAVE_S``), so a listing made after it no
longer shows them; it lists them as they were. Unknown id: ``404``; a request already sending its
last bytes cannot be cancelled: ``409``.
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive, Scope, Send

from proxy.asgi.responses import send_json
from proxy.auth import Principal
from proxy.errors import Cancelled, Conflict, NotFound
from proxy.state import ProxyState

# How long DELETE waits for the cancelled requests to unwind. Nothing in the unwinding waits on the
# child (a stream's last event is one write to its client), so this is a guard, not a guess.
_LEAVE_S = 5.0


class AdminRequests:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        await send_json(send, 200, {"requests": self.state.inflight.rows()})


class CancelRequest:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        request_id = scope["path_params"]["id"]
        shown = request_id if len(request_id) <= 128 else "(invalid)"
        inflight = self.state.inflight
        if not inflight.find(request_id):
            raise NotFound(f"no request '{shown}' is queued or running (GET /admin/requests lists them)")
        cancelled = inflight.cancel(
            request_id, lambda: Cancelled(f"the request '{shown}' was cancelled by an operator")
        )
        if not cancelled:
            raise Conflict(f"the request '{shown}' is already ending; it cannot be cancelled")
        for row in cancelled.values():
            self.state.metrics.observe_cancel(str(row["model"] or "-"), str(row["state"]))
        await asyncio.wait([inflight.left(entry) for entry in cancelled], timeout=_LEAVE_S)
        await send_json(send, 200, {"cancelled": list(cancelled.values())})
