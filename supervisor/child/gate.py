"""Readiness gate and liveness probing (``/health``, and the server loop's ``GET /slots``) over HTTP,
on top of ``supervisor.child.probes``.

READY means three things, checked in order: ``/health`` answers 200 (the model is loaded),
``/v1/models`` lists our alias with the per-slot context we asked for (the child is the one we
configured), and a one-token completion succeeds (it can decode, not just listen). The gate has no
deadline of its own: the state machine owns the load deadline and cancels the gate when it expires or
when the child exits, so the gate never outlives the child it probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import httpx

from proxy.source import ModelInputs
from supervisor.child import probes
from supervisor.child.loading import Step
from supervisor.child.osseam import Probes, ProbeUnreachable, ProbeWrongAnswer, ServedModel

# Poll /health every 50 ms for the first seconds (a small model is ready in ~1.5 s and READY should
# follow /health 200 closely), then every 250 ms so a long load costs few requests.
FAST_POLL_S = 0.05
SLOW_POLL_S = 0.25
FAST_PHASE_S = 5.0


def poll_interval(elapsed_s: float) -> float:
    return FAST_POLL_S if elapsed_s < FAST_PHASE_S else SLOW_POLL_S


class HttpProbes:
    """``Probes`` over one shared ``httpx.AsyncClient`` (keep-alive below the child's 5 s idle close)."""

    def __init__(self, client: httpx.AsyncClient | None = None) -> None:
        self._client = client or httpx.AsyncClient(
            trust_env=False,  # never send loopback probes through an HTTP proxy from the environment
            limits=httpx.Limits(max_keepalive_connections=2, keepalive_expiry=4.0),
        )

    async def health(self, base_url: str, timeout_s: float) -> int:
        try:
            return await probes.get_health(self._client, base_url, timeout_s=timeout_s)
        except httpx.TimeoutException:
            raise ProbeUnreachable(f"no answer within {timeout_s:g} s") from None
        except httpx.TransportError as exc:
            raise ProbeUnreachable(type(exc).__name__) from None

    async def loop(self, base_url: str, secret: str, deadline_s: float) -> bool:
        try:
            await probes.loop_answers(self._client, base_url, secret, deadline_s=deadline_s)
        except (httpx.HTTPError, probes.ProbeError):
            return False
        return True

    async def models(self, base_url: str, secret: str) -> list[ServedModel]:
        try:
            return await probes.get_models(self._client, base_url, secret)
        except probes.ProbeError as exc:
            raise ProbeWrongAnswer(str(exc)) from None
        except httpx.HTTPError as exc:
            raise ProbeUnreachable(f"GET /v1/models: {type(exc).__name__}") from None

    async def one_token(self, base_url: str, secret: str) -> None:
        try:
            await probes.one_token_completion(self._client, base_url, secret)
        except probes.ProbeError as exc:
            raise ProbeWrongAnswer(str(exc)) from None
        except httpx.HTTPError as exc:
            raise ProbeUnreachable(f"one-token completion: {type(exc).__name__}") from None

    async def inputs(self, base_url: str, secret: str) -> ModelInputs | None:
        return await probes.get_inputs(self._client, base_url, secret)

    async def aclose(self) -> None:
        await self._client.aclose()


async def wait_health_200(
    p: Probes, base_url: str, *, timeout_s: float = 2.0, wake: asyncio.Event | None = None
) -> float:
    """Poll until /health says 200; returns seconds waited. 503 (loading) and refused both mean 'not yet'.

    ``wake``: set by whoever reads the child's log. llama-server logs "model loaded" and "listening" the
    moment it can serve, so a new log line triggers the next probe at once instead of at the next tick.
    """
    started = time.monotonic()
    while True:
        if wake is not None:
            wake.clear()
        try:
            if await p.health(base_url, timeout_s) == 200:
                return time.monotonic() - started
        except ProbeUnreachable:
            pass
        interval = poll_interval(time.monotonic() - started)
        if wake is None:
            await asyncio.sleep(interval)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), interval)


async def readiness_gate(
    p: Probes,
    base_url: str,
    secret: str,
    *,
    alias: str,
    ctx_per_slot: int,
    wake: asyncio.Event | None = None,
    on_step: Callable[[Step], None] | None = None,
) -> ModelInputs | None:
    """Return once all three gates pass; raise ``ProbeWrongAnswer``/``ProbeUnreachable`` otherwise.
    ``on_step`` hears each step after the first as it begins (the load's progress shows them). Returns
    what the model takes beside text (``read_inputs``), for the request schema."""
    step = on_step or (lambda name: None)
    await wait_health_200(p, base_url, wake=wake)
    step("models")
    served = await p.models(base_url, secret)
    ours = [m for m in served if m.id == alias]
    if not ours:
        listed = ", ".join(repr(m.id) for m in served) or "nothing"
        raise ProbeWrongAnswer(f"/v1/models lists {listed}, not the alias {alias!r}")
    if ours[0].n_ctx != ctx_per_slot:
        raise ProbeWrongAnswer(
            f"/v1/models reports n_ctx {ours[0].n_ctx} per slot for {alias!r}, expected {ctx_per_slot}"
        )
    step("decode")
    await p.one_token(base_url, secret)
    return await read_inputs(p, base_url, secret)


async def read_inputs(p: Probes, base_url: str, secret: str) -> ModelInputs | None:
    """What the model takes beside text (``/props`` modalities, FIM tokens), read once per child before it
    is READY, so that no request reaches it before the door knows; None (every part passes) when the
    child does not say."""
    return await p.inputs(base_url, secret)
