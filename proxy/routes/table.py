"""Every path the proxy answers, and every llama-server path it refuses on purpose: one table.

Read from the pinned llama-server's source (``tools/server/server.cpp``, the ``ctx_http.get/post/del``
calls, llama.cpp commit 0c1e570): each served path is a ``RouteSpec`` row, each deliberately refused
one a ``Refused`` row with its reason. ``docs/api.md`` shows the same two tables; a unit test parses the
doc and compares it with these rows, so neither can drift. Aliases (``/chat/completions`` beside
``/v1/chat/completions``...) are rows of their own, never a pattern: the metrics and access log label a
request by its row's path, a bounded set.

A row is everything about its route: who may call (``access``, enforced from the row), and for a
generation route its stream format (``proxy.streams.formats``), its cost kind (``proxy.admission.cost``)
and the answer assembled for a non-streamed request (``proxy.streams.assemble``). ``kind`` says how a
row is served (``proxy.routes.build`` maps kinds to endpoints):

- generation kinds take admission permits: ``chat``, ``completions`` (OpenAI text completions),
  ``completion`` (llama-server's native API), ``infill``, ``responses``, ``messages``, ``embeddings``,
  ``rerank``;
- ``count``: tokenizing and templating, answered by the child's HTTP threads without a slot; bounded by
  a per-tenant rate instead (``proxy.admission.count_rate``);
- ``models``, ``props`` (fields that reveal the machine only for admin keys), ``health`` (llama-server's
  ``/health`` answered from readiness), ``liveness``, ``readiness``, ``metrics``, ``identity``,
  ``load`` (the admission gate per tenant, for the page), ``history`` (the last 15 minutes per model, for
  the page's charts), ``slots``, ``admin_models`` (every model's
  state and memory share), ``model_load`` / ``model_unload`` (an operator loads or unloads one model),
  ``requests`` (every generation request queued or running) and ``request`` (one of them by id:
  cancel);
- the accounts store's admin routes (``proxy.routes.store_admin``): ``keys`` (list, make), ``key`` (one
  key by id: revoke) and ``usage`` (the ledger's sums).

A row's path is exact, or holds a ``{name}`` path parameter (Starlette's syntax, e.g.
``/admin/models/{name}/load``, ``/admin/keys/{id}``): the endpoint reads it from ``scope["path_params"]``,
and the metrics and access log label the request by the row's path as written, so the label set stays
bounded.

The status page's static files (``/``, ``/ui``, ``/ui/*``; ``proxy.routes.ui``) are not API routes and not in
this table: ``proxy.app`` adds them beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from proxy.admission.cost import CostKind
from proxy.auth import Access
from proxy.streams.assemble import Kind as AssembledKind
from proxy.streams.formats import ANTHROPIC, NATIVE, OPENAI, RESPONSES, SILENT, StreamFormat

Kind = Literal[
    "chat",
    "completions",
    "completion",
    "infill",
    "responses",
    "messages",
    "embeddings",
    "rerank",
    "count",
    "models",
    "props",
    "health",
    "liveness",
    "readiness",
    "metrics",
    "identity",
    "load",
    "history",
    "slots",
    "admin_models",
    "model_load",
    "model_unload",
    "requests",
    "request",
    "keys",
    "key",
    "usage",
]
# The child must have been started with this feature (llama.embeddings / llama.reranking).
Feature = Literal["embeddings", "reranking"]


@dataclass(frozen=True)
class RouteSpec:
    path: str
    methods: tuple[str, ...]
    kind: Kind
    # Who may call: "none" (no credentials), "inference", "admin", or "any key" (inference or admin);
    # checked from here for every row (``proxy.routes.build``), never by an endpoint.
    access: Access
    # Generation rows: how the answer is measured and an error ends its stream; how the request's cost
    # is counted (``proxy.admission.cost``); which OpenAI answer the proxy assembles from the child's
    # stream when the client asked for none (None: the child's own answer is relayed).
    stream: StreamFormat | None = None
    cost: CostKind | None = None
    assembled: AssembledKind | None = None
    needs: Feature | None = None
    # Anthropic clients: credentials also from x-api-key, errors in Anthropic's shape.
    anthropic: bool = False
    # Generation rows: the request has no side effect beyond generating, so when its child dies before
    # any byte of the answer reached the client it may run once more on the next child
    # (``proxy.routes.replay``). A generation route with another effect must say False.
    replayable: bool = True
    # The request schema its body is checked against (``proxy.schema.routes.SCHEMAS``); generation rows
    # default to their kind. None: a route with no body of its own (GET).
    schema: str | None = None

    @property
    def body(self) -> str:
        """The name of its body's schema."""
        return self.schema or self.kind

    @property
    def parameterized(self) -> bool:
        """The path holds a ``{name}`` parameter: it matches many request paths, never exactly."""
        return "{" in self.path

    @property
    def takes_slots(self) -> bool:
        """True when the route takes slot permits (and waits in the tenant's queue for them)."""
        return self.cost is not None

    @property
    def generates(self) -> bool:
        """Its answer is generated tokens, and may be a stream (not embeddings, not rerank)."""
        return self.cost in ("chat", "completion")


@dataclass(frozen=True)
class Refused:
    path: str
    methods: tuple[str, ...]
    reason: str


_P, _G = ("POST",), ("GET",)
_INF: Access = "inference"

ROUTES: tuple[RouteSpec, ...] = (
    RouteSpec("/v1/chat/completions", _P, "chat", _INF, OPENAI, "chat", "chat"),
    RouteSpec("/chat/completions", _P, "chat", _INF, OPENAI, "chat", "chat"),
    RouteSpec("/v1/completions", _P, "completions", _INF, OPENAI, "completion", "completion"),
    # llama-server answers /completions (unversioned) with its native API, like /completion; its
    # non-streamed answer has another shape than OpenAI's, so it is the child's own.
    RouteSpec("/completions", _P, "completion", _INF, NATIVE, "completion"),
    RouteSpec("/completion", _P, "completion", _INF, NATIVE, "completion"),
    RouteSpec("/infill", _P, "infill", _INF, NATIVE, "completion"),
    # The OpenAI Responses and Anthropic Messages dialects count as chat (one conversation).
    RouteSpec("/v1/responses", _P, "responses", _INF, RESPONSES, "chat"),
    RouteSpec("/responses", _P, "responses", _INF, RESPONSES, "chat"),
    RouteSpec("/v1/messages", _P, "messages", _INF, ANTHROPIC, "chat", anthropic=True),
    RouteSpec("/v1/embeddings", _P, "embeddings", _INF, SILENT, "embedding", needs="embeddings"),
    RouteSpec("/embeddings", _P, "embeddings", _INF, SILENT, "embedding", needs="embeddings"),
    RouteSpec("/embedding", _P, "embeddings", _INF, SILENT, "embedding", needs="embeddings"),
    RouteSpec("/v1/rerank", _P, "rerank", _INF, SILENT, "rerank", needs="reranking"),
    RouteSpec("/v1/reranking", _P, "rerank", _INF, SILENT, "rerank", needs="reranking"),
    RouteSpec("/rerank", _P, "rerank", _INF, SILENT, "rerank", needs="reranking"),
    RouteSpec("/reranking", _P, "rerank", _INF, SILENT, "rerank", needs="reranking"),
    RouteSpec("/v1/chat/completions/input_tokens", _P, "count", "any key", schema="chat"),
    RouteSpec("/chat/completions/input_tokens", _P, "count", "any key", schema="chat"),
    RouteSpec("/v1/responses/input_tokens", _P, "count", "any key", schema="responses"),
    RouteSpec("/responses/input_tokens", _P, "count", "any key", schema="responses"),
    RouteSpec("/v1/messages/count_tokens", _P, "count", "any key", anthropic=True, schema="count_tokens"),
    RouteSpec("/apply-template", _P, "count", "any key", schema="chat"),
    RouteSpec("/tokenize", _P, "count", "any key", schema="tokenize"),
    RouteSpec("/detokenize", _P, "count", "any key", schema="detokenize"),
    RouteSpec("/v1/models", _G, "models", _INF),
    RouteSpec("/models", _G, "models", _INF),
    RouteSpec("/props", _G, "props", "any key"),
    RouteSpec("/health", _G, "health", "none"),
    RouteSpec("/v1/health", _G, "health", "none"),
    RouteSpec("/healthz", _G, "liveness", "none"),
    RouteSpec("/readyz", _G, "readiness", "none"),
    RouteSpec("/metrics", _G, "metrics", "admin"),
    RouteSpec("/admin/identity", _G, "identity", "admin"),
    RouteSpec("/admin/load", _G, "load", "admin"),
    RouteSpec("/admin/history", _G, "history", "admin"),
    RouteSpec("/slots", _G, "slots", "admin"),
    RouteSpec("/admin/models", _G, "admin_models", "admin"),
    RouteSpec("/admin/models/{name}/load", _P, "model_load", "admin"),
    RouteSpec("/admin/models/{name}/unload", _P, "model_unload", "admin"),
    RouteSpec("/admin/requests", _G, "requests", "admin"),
    RouteSpec("/admin/requests/{id}", ("DELETE",), "request", "admin"),
    RouteSpec("/admin/keys", ("GET", "POST"), "keys", "admin"),
    RouteSpec("/admin/keys/{id}", ("DELETE",), "key", "admin"),
    RouteSpec("/admin/usage", _G, "usage", "admin"),
)

_AUDIO = "audio input needs a multimodal projector, which the supervisor does not load"
_ROUTER = "router mode only (no -m); the supervisor always passes -m, one model per child"
_STREAMS = (
    "resumable streams: a client could reattach to another tenant's generation by id, and it keeps a slot"
    " busy after its client left (X-Conversation-Id is stripped for the same reason)"
)
REFUSED: tuple[Refused, ...] = (
    Refused("/props", _P, "changes the child's global properties for every tenant"),
    Refused(
        "/v1/chat/completions/control",
        _P,
        "acts on a running generation named by id, with no check that it belongs to the caller",
    ),
    Refused("/v1/audio/transcriptions", _P, _AUDIO),
    Refused("/audio/transcriptions", _P, _AUDIO),
    Refused(
        "/slots/:id_slot",
        _P,
        "save / restore / erase write files on the host and drop other tenants' cached prompts",
    ),
    Refused("/lora-adapters", ("GET", "POST"), "swaps adapters for every tenant; the supervisor loads none"),
    Refused("/models", ("POST", "DELETE"), _ROUTER),
    Refused("/models/load", _P, _ROUTER),
    Refused("/models/unload", _P, _ROUTER),
    Refused("/models/sse", _G, _ROUTER),
    Refused("/v1/stream", ("GET", "DELETE"), _STREAMS),
    Refused("/v1/streams/lookup", _P, _STREAMS),
    Refused(
        "/cors-proxy",
        ("GET", "POST"),
        "fetches any URL from the host for the web UI (MCP): a request forgery door",
    ),
    Refused("/tools", ("GET", "POST"), "server-side tools give clients file and shell access on the host"),
    Refused("/predict", _P, "Vertex AI compatibility, off: the child's environment is scrubbed (AIP_MODE)"),
)


def served_paths() -> frozenset[str]:
    """The exact paths served (CORS preflights match these); parameterized rows are admin-only and not
    meant for cross-origin callers."""
    return frozenset(r.path for r in ROUTES if not r.parameterized)
