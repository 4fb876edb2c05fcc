"""What the proxy needs to know about the child, and nothing more.

The proxy never imports the supervisor. Whoever builds the app (the daemon, or a test) passes an
object satisfying ``UpstreamSource``. The proxy reads one ``UpstreamSnapshot`` per request so that a
restart between two reads (new port, new secret) can never mix the old child's URL with the new
child's secret.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SlotStates:
    """Where the child saves its slots' states (its ``--slot-save-path``) and what makes a state valid
    there: the conversations' disk tier (``proxy.conversations.tier``). Set by the daemon per child."""

    # The private folder (0700) of one identity: every state in it was written by a child of that identity.
    directory: str
    # A digest of what a saved state depends on (the binary and the model by sha256, the context per slot,
    # the KV cache types, extra arguments): a state is only ever restored into a child of the same one.
    identity: str
    # The most bytes the folder may hold (least recently used states are removed first).
    budget_bytes: int
    # The most bytes a second the tier writes on average (``llama.state_write_mib_s``); None: unbounded.
    write_bytes_s: int | None = None


@dataclass(frozen=True)
class ModelInputs:
    """What the loaded model takes beside text, as its child said at load: ``/props`` ``modalities``
    (a projector loaded with ``--mmproj``), and whether its vocabulary has the fill-in-the-middle tokens
    ``/infill`` needs (the child answers 501 when it does not). The door refuses the rest (400 naming the
    part, 404 for ``/infill``) instead of passing the child's 500 or 501 to a client."""

    vision: bool = False
    audio: bool = False
    video: bool = False
    fim: bool = False

    @property
    def multimodal(self) -> bool:
        """A projector is loaded (``multimodal_data`` in a prompt needs one, of any kind)."""
        return self.vision or self.audio or self.video


@dataclass(frozen=True)
class UpstreamSnapshot:
    # Supervisor state name: STOPPED, STARTING, READY, UNHEALTHY, BACKOFF, STOPPING, FAILED.
    state: str
    # True only when the child passed the readiness gate and the daemon is not draining.
    ready: bool
    # Why not ready (last failure, "draining", ...); shown on /readyz, so it must hold no secret.
    reason: str | None
    # e.g. "http://127.0.0.1:41234"; None while no child is listening.
    base_url: str | None
    # The per-boot secret the child expects in ``Authorization: Bearer``; None while no child.
    secret: str | None
    # Served model id (llama-server's --alias) and the capacity the admission gate must match.
    model_alias: str
    slots: int
    ctx_per_slot: int
    # Increments on every child boot; lets the proxy tell an old child's connections from a new one's.
    generation: int
    # Honest estimate of when the child may be ready again (for 503 Retry-After), in seconds; None when
    # no retry is scheduled at all (FAILED: only an operator brings it back), so none is promised.
    retry_after_s: float | None
    # True when the child was started with --embeddings (then /v1/embeddings is routed).
    embeddings: bool = False
    # True when the child was started with --rerank (then the rerank routes are routed).
    reranking: bool = False
    # Extra non-secret status fields shown verbatim on /readyz (e.g. uptime_s, restarts, last_failure).
    # Never put a secret, a path with a secret or a key here: /readyz needs no credentials.
    info: Mapping[str, object] = field(default_factory=dict)
    # The model load: 0..1 while the child loads (never decreasing within one load), 1.0 once it is
    # loaded (READY, UNHEALTHY), None otherwise; the gate's step while loading ("health": reading the
    # model, "models", "decode"); seconds left by the previous load of the same file (None: no estimate).
    progress: float | None = None
    load_step: str | None = None
    load_eta_s: float | None = None
    # Tokens in the model's vocabulary (its GGUF header): the request schema refuses a token id beyond it
    # (``proxy.schema``); None: unknown, any int32 id passes the door.
    n_vocab: int | None = None
    # The conversations' disk tier of this child; None: off (``proxy.conversations.tier``).
    slot_states: SlotStates | None = None
    # What the model takes beside text (read from the child at load); None: unknown, every part passes.
    inputs: ModelInputs | None = None


class UpstreamSource(Protocol):
    def snapshot(self) -> UpstreamSnapshot: ...

    def identity(self) -> Mapping[str, object]:
        """The identity record of what is served (admin-only data)."""
        ...


@runtime_checkable
class AnnouncesChanges(Protocol):
    """A source that can say when its snapshot may have changed (the daemon's do: a state transition of
    the child's supervisor), so that a request waiting for the next READY child (``proxy.routes.replay``)
    wakes at once instead of polling. A source without it is read again at short bounded intervals."""

    async def changed(self, timeout_s: float) -> None:
        """Return at the next change of the snapshot, or after ``timeout_s``, whichever comes first."""
        ...
