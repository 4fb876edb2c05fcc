"""Small async probes of a llama-server, shared by ``verify``'s smoke test, the readiness gate and the
liveness watchdog.

Each probe is one request with its own timeout. Transport failures (connection refused while the
child binds, timeouts) propagate as ``httpx.HTTPError`` so a caller polling with a deadline can tell
"not up yet" from a wrong answer, which raises ``ProbeError``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_random_exponential

from proxy.source import ModelInputs
from supervisor.errors import CheckFailed


class ProbeError(CheckFailed):
    """llama-server answered, but not what a healthy server answers."""

    def __init__(self, what: str, message: str, status: int | None = None) -> None:
        self.what = what
        self.status = status
        super().__init__(f"{what}: {message}")


@dataclass(frozen=True)
class ServedModel:
    id: str
    n_ctx: int | None  # per-slot context (``meta.n_ctx``)


@dataclass(frozen=True)
class OneToken:
    text: str
    completion_tokens: int
    seconds: float


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _json(response: httpx.Response, what: str) -> Any:
    try:
        return response.json()
    except ValueError:
        raise ProbeError(what, f"answer is not JSON: {response.text[:200]!r}", response.status_code) from None


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


async def get_health(client: httpx.AsyncClient, base_url: str, *, timeout_s: float = 2.0) -> int:
    """Status of ``GET /health``: 503 while the model loads, 200 once it serves."""
    response = await client.get(f"{base_url}/health", timeout=timeout_s)
    return response.status_code


# A reused keep-alive connection the child closed (its idle close is 5 s), or a refused connect while the
# listener is busy, fails in under a millisecond: retried within the deadline, first after at most 50 ms,
# never more than 1 s apart (full jitter), so a transport hiccup is never mistaken for a held loop.
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0


async def loop_answers(client: httpx.AsyncClient, base_url: str, secret: str, *, deadline_s: float) -> str:
    """Ask the server loop itself: ``GET /slots`` is a task in llama-server's queue (``SLOT_GET``), answered
    by the loop between batches even while a decode runs (server-context.cpp ``process_single_task``),
    unlike ``/health``, which its HTTP threads answer alone. Returns the path that answered; raises
    ``httpx.TimeoutException`` or ``httpx.TransportError`` when nothing answered within ``deadline_s``
    (transport errors are retried until then), ``ProbeError`` for an answer no loop gives.

    A child started with ``--no-slots`` answers 501 without the loop: then ``/metrics`` (a
    ``SERVER_TASK_TYPE_METRICS`` task; llamagate always passes ``--metrics``) is asked instead. It is the
    second choice because each of its answers resets llama-server's throughput window."""
    started = time.monotonic()
    path = "/slots"
    async for attempt in AsyncRetrying(
        stop=stop_after_delay(deadline_s),
        wait=wait_random_exponential(multiplier=RETRY_FIRST_S, max=RETRY_MAX_S),
        retry=retry_if_exception_type(httpx.TransportError),
        reraise=True,
    ):
        with attempt:
            left = max(0.001, deadline_s - (time.monotonic() - started))
            response = await client.get(f"{base_url}{path}", headers=_auth(secret), timeout=left)
            if response.status_code == 501 and path == "/slots":
                path = "/metrics"
                left = max(0.001, deadline_s - (time.monotonic() - started))
                response = await client.get(f"{base_url}{path}", headers=_auth(secret), timeout=left)
            if response.status_code != 200:
                what = f"GET {path}"
                raise ProbeError(
                    what, f"HTTP {response.status_code}: {_error_text(response)}", response.status_code
                )
    return path


async def get_models(
    client: httpx.AsyncClient, base_url: str, secret: str, *, timeout_s: float = 5.0
) -> list[ServedModel]:
    what = "GET /v1/models"
    response = await client.get(f"{base_url}/v1/models", headers=_auth(secret), timeout=timeout_s)
    if response.status_code != 200:
        raise ProbeError(what, f"HTTP {response.status_code}: {_error_text(response)}", response.status_code)
    body = _json(response, what)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ProbeError(what, "answer has no 'data' list", response.status_code)
    models: list[ServedModel] = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            raise ProbeError(what, f"model entry without an id: {item!r}"[:200], response.status_code)
        meta = item.get("meta")
        n_ctx = meta.get("n_ctx") if isinstance(meta, dict) else None
        models.append(ServedModel(id=item["id"], n_ctx=n_ctx if isinstance(n_ctx, int) else None))
    return models


async def one_token_completion(
    client: httpx.AsyncClient,
    base_url: str,
    secret: str,
    *,
    prompt: str = "The capital of France is",
    timeout_s: float = 60.0,
) -> OneToken:
    """Generate exactly one token, greedily. Proves the binary can decode, not just load and listen."""
    what = "POST /v1/completions (1 token)"
    payload = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": False}
    started = time.monotonic()
    response = await client.post(
        f"{base_url}/v1/completions", json=payload, headers=_auth(secret), timeout=timeout_s
    )
    seconds = time.monotonic() - started
    if response.status_code != 200:
        raise ProbeError(what, f"HTTP {response.status_code}: {_error_text(response)}", response.status_code)
    body = _json(response, what)
    try:
        text = body["choices"][0]["text"]
        tokens = body["usage"]["completion_tokens"]
    except (KeyError, IndexError, TypeError):
        raise ProbeError(what, f"unexpected answer shape: {str(body)[:200]}", response.status_code) from None
    if not isinstance(text, str) or not isinstance(tokens, int) or tokens != 1:
        raise ProbeError(what, f"expected 1 generated token, got {tokens!r}", response.status_code)
    return OneToken(text=text, completion_tokens=tokens, seconds=seconds)


async def get_inputs(
    client: httpx.AsyncClient, base_url: str, secret: str, *, timeout_s: float = 5.0
) -> ModelInputs | None:
    """What the loaded model takes beside text, or None when the child does not say (an older or a fake
    server): ``GET /props`` ``modalities``, and whether ``/infill`` is served. The pinned ``/infill``
    checks the vocabulary's FIM tokens first (501 without them) and refuses ``input_extra`` that is not an
    array next (400), both before any work: so a body with ``input_extra: 0`` asks exactly that question,
    as llama.cpp itself decides it (its vocabulary reads FIM tokens from the GGUF keys and, failing
    those, from token texts such as ``<|fim_prefix|>``)."""
    headers = _auth(secret)
    try:
        props = await client.get(f"{base_url}/props", headers=headers, timeout=timeout_s)
        infill = await client.post(
            f"{base_url}/infill", json={"input_extra": 0}, headers=headers, timeout=timeout_s
        )
    except httpx.HTTPError:
        return None
    if props.status_code != 200 or infill.status_code not in (400, 501):
        return None
    try:
        modalities = props.json().get("modalities")
    except (ValueError, AttributeError):
        return None
    if not isinstance(modalities, dict):
        return None
    return ModelInputs(
        vision=modalities.get("vision") is True,
        audio=modalities.get("audio") is True,
        video=modalities.get("video") is True,
        fim=infill.status_code == 400,
    )
