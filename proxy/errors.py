"""The proxy's exception tree, mapped to OpenAI-shaped JSON at one boundary
(``proxy.middleware.context.RequestContextMiddleware``).

    ProxyError                      500 internal_error (a bug; the message stays generic)
    ├── BadRequest                  400 invalid_request_error   unparsable / non-object JSON, bad field
    │   ├── ContextTooLarge         400 exceed_context_size_error  llama-server's own shape
    │   └── FieldError              400 invalid_field            a body field the schema refuses (+ param;
    │       │                                                    proxy.schema.values)
    │       └── UnknownField        400 unknown_field            a field the route does not declare
    ├── Unauthorized                401 authentication_error     + WWW-Authenticate: Bearer
    ├── Forbidden                   403 permission_error         key lacks the route's scope
    ├── NotFound                    404 not_found_error          unknown route
    │   └── ModelNotFound           404 model_not_found          "model" is not the served alias
    ├── MethodNotAllowed            405 invalid_request_error    + Allow
    ├── Conflict                    409 invalid_request_error    the operator's action contradicts config
    ├── Cancelled                   410 cancelled_error          an operator cancelled the request
    ├── PayloadTooLarge             413 invalid_request_error    body over proxy.max_body_bytes
    ├── Rejected                    429 rate_limit_error         + Retry-After; queue_full, queue_timeout
    │   └── PoisonRefusal           429 key_cooling_down,        + Retry-After; a key after its strikes, a
    │                                   poison_body              body that killed two children
    │                                                            (proxy.admission.poison)
    ├── NotReady                    503 unavailable_error        + Retry-After; child not READY or draining
    ├── SharedLimitsUnavailable     503 unavailable_error        + Retry-After; Redis down, refuse mode
    ├── StoreUnavailable            503 unavailable_error        an admin change the accounts store refused
    └── UpstreamFailure             502 upstream_error           child died / hung up / malformed answer
        ├── UpstreamGone            502 upstream_error           the child closed the connection before
        │   │                                                    the answer was complete (died, killed,
        │   │                                                    restarted)
        │   └── PoisonRequest       502 poison_request           in flight at two deaths (or hangs) of its
        │                                                        model's child: not sent again
        │                                                        (proxy.admission.poison)
        ├── UpstreamUnreachable     503 unavailable_error        + Retry-After; nothing reached the child
        ├── UpstreamTimeout         504 upstream_timeout         connect, first-token or total deadline
        └── AnswerTooLarge          502 upstream_error           a non-streamed answer over
                                                                 proxy.max_response_bytes
                                                                 (proxy.streams.assemble)

A generation whose child went away (``UpstreamGone``, ``UpstreamUnreachable``; a hung child is killed, so
its requests see the same) before any byte of its answer reached the client is run once more on the next
child instead (``proxy.routes.replay``); these are what it ends with when it is not. The subclasses
defined beside their owners (the schema's, poison's, the assembler's) are drawn here too: this is the
one tree.

Errors the child itself answers (a 4xx/5xx with a JSON body) are not exceptions: they pass through with
their status and body untouched. ``outcome`` is the access log's word for how the request ended.

Two internal signals are not in the tree (nothing answers them as such): ``ClientGone``
(``proxy.asgi.disconnect``: the client left; the boundary logs 499 and sends nothing) and
``UpstreamClosed`` (``proxy.upstream.connection``: the child hung up mid-answer; the routes turn it into
an ``UpstreamFailure``, or an error event once a stream has started).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping


class ProxyError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | int = "internal_error"
    outcome: str = "error"

    def __init__(self, message: str = "internal error", *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers: dict[str, str] = dict(headers or {})

    def payload(self) -> dict[str, object]:
        return {"message": self.message, "type": self.type, "code": self.code}

    def body(self) -> bytes:
        return json.dumps({"error": self.payload()}, separators=(",", ":")).encode()

    def sse_event(self) -> bytes:
        """The same error as one SSE event, for a stream whose 200 already went out."""
        return b"data: " + json.dumps({"error": self.payload()}, separators=(",", ":")).encode() + b"\n\n"


class BadRequest(ProxyError):
    status = 400
    type = "invalid_request_error"
    code: str | int = "invalid_request"
    outcome = "rejected:bad_request"


class ContextTooLarge(BadRequest):
    """Mirrors llama-server's answer so clients see one shape whether we or the child refuse."""

    type = "exceed_context_size_error"
    code = 400
    outcome = "rejected:context_size"

    def __init__(self, n_prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"request ({n_prompt_tokens} tokens) exceeds the available context size ({n_ctx} tokens), "
            "try increasing it"
        )
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx

    def payload(self) -> dict[str, object]:
        out = super().payload()
        out["n_prompt_tokens"] = self.n_prompt_tokens
        out["n_ctx"] = self.n_ctx
        return out


class Unauthorized(ProxyError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"
    outcome = "rejected:unauthorized"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"www-authenticate": 'Bearer realm="llamagate"'})


class Forbidden(ProxyError):
    status = 403
    type = "permission_error"
    code = "insufficient_scope"
    outcome = "rejected:forbidden"


class NotFound(ProxyError):
    status = 404
    type = "not_found_error"
    code = "not_found"
    outcome = "rejected:not_found"


class ModelNotFound(NotFound):
    type = "invalid_request_error"
    code = "model_not_found"
    outcome = "rejected:model_not_found"


class MethodNotAllowed(ProxyError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"
    outcome = "rejected:method_not_allowed"


class Conflict(ProxyError):
    """An operator's action the configuration forbids (unloading a ``residency: always`` model)."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"
    outcome = "rejected:conflict"


class Cancelled(ProxyError):
    """An operator cancelled the request (``DELETE /admin/requests/{id}``), queued or running.

    410 rather than 409 or a 5xx: the OpenAI and Anthropic SDKs retry 408, 409, 429 and every 5xx on
    their own, and a load balancer may send a 5xx on to another replica, which would undo the
    operator's decision; 410 is retried by neither and says the request is gone on purpose. 499 is
    nginx's word for a client that left, which the access log already uses."""

    status = 410
    type = "cancelled_error"
    code = "cancelled_by_operator"
    outcome = "cancelled"

    def __init__(self, message: str = "the request was cancelled by an operator") -> None:
        super().__init__(message)


class PayloadTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"
    outcome = "rejected:payload_too_large"


def _retry_after(seconds: float) -> dict[str, str]:
    # Retry-After takes whole seconds; rounding up keeps the promise "not before this".
    return {"retry-after": str(max(1, math.ceil(seconds)))}


class Rejected(ProxyError):
    """Admission said no: the tenant's queue is full or the wait hit its deadline."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, reason: str, retry_after_s: float, message: str) -> None:
        super().__init__(message, headers=_retry_after(retry_after_s))
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.outcome = f"rejected:{reason}"


class NotReady(ProxyError):
    status = 503
    type = "unavailable_error"
    code = "not_ready"
    outcome = "rejected:not_ready"

    def __init__(self, message: str, retry_after_s: float | None) -> None:
        # None: no retry is scheduled (FAILED), so no Retry-After promises one.
        super().__init__(message, headers=_retry_after(retry_after_s) if retry_after_s is not None else {})


class SharedLimitsUnavailable(ProxyError):
    """Redis, which holds the limits shared by the replicas, is unreachable and ``cluster.on_redis_error``
    is ``refuse``: the request is not started (nothing was held)."""

    status = 503
    type = "unavailable_error"
    code = "shared_limits_unavailable"
    outcome = "rejected:shared_limits_unavailable"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, headers=_retry_after(retry_after_s))


class StoreUnavailable(ProxyError):
    """A write to the accounts store failed (a full disk): the change did not happen; serving goes on."""

    status = 503
    type = "unavailable_error"
    code = "store_unavailable"
    outcome = "store_error"


class UpstreamFailure(ProxyError):
    status = 502
    type = "upstream_error"
    code = "upstream_error"
    outcome = "upstream_error"


class UpstreamGone(UpstreamFailure):
    """The child closed the connection (it died, was killed or restarted) before the answer was complete."""


class UpstreamUnreachable(UpstreamFailure):
    """The child refused the connection (it just died, or is being replaced): nothing reached it, so no work
    began. A 503, like NotReady, so that a load balancer in front may send the request to another replica:
    llamagate answers 429 or 503 only while no live llama-server works on the request and no byte of an
    answer went out (docs/deploy.md, scale-out): a request this refusal hits first waits for the next
    child (``proxy.routes.replay``), and ends with it only when none comes in time."""

    status = 503
    type = "unavailable_error"
    code = "not_ready"
    outcome = "rejected:not_ready"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, headers=_retry_after(retry_after_s))


class UpstreamTimeout(UpstreamFailure):
    status = 504
    type = "upstream_timeout"
    code = "upstream_timeout"
