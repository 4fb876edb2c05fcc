"""A tenant's leases in Redis: the scripts of ``proxy.cluster.scripts`` behind three calls, and the key
names. Every call is one round trip; every failure is Redis's (``redis.exceptions.RedisError``, which
includes its timeouts and refused connections) or the socket's (``OSError``) for the caller to handle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from redis.asyncio import Redis

from proxy.cluster.scripts import ACQUIRE, RELEASE, RENEW

PREFIX = "llamagate"
TOTAL = "*"  # the lease group of a tenant's total across models (model names never hold "*")


@dataclass(frozen=True, slots=True)
class Group:
    """One lease group: a tenant's leases for one model (or for all: ``TOTAL``) under one limit."""

    tenant: str
    model: str
    limit: int

    @property
    def key(self) -> str:
        return f"{PREFIX}:{{{self.tenant}}}:lease:{self.model}"


@dataclass(frozen=True, slots=True)
class LeaseAsk:
    """What one request asks for: ``slots`` leases in every group (the first is its model's, whose line
    it waits in), with ``member`` naming it. ``head_start_ms``: its priority's head start in the line
    (``proxy.cluster.scripts``)."""

    member: str
    slots: int
    groups: tuple[Group, ...]
    max_queue: int
    head_start_ms: int = 0

    @property
    def line(self) -> tuple[str, str]:
        first = self.groups[0]
        return (
            f"{PREFIX}:{{{first.tenant}}}:queue:{first.model}",
            f"{PREFIX}:{{{first.tenant}}}:alive:{first.model}",
        )


Outcome = Literal["granted", "wait", "full"]


class RedisLeases:
    def __init__(self, client: Redis) -> None:
        self.client = client
        self._acquire = client.register_script(ACQUIRE)
        self._renew = client.register_script(RENEW)
        self._release = client.register_script(RELEASE)

    async def acquire(self, ask: LeaseAsk, ttl_ms: int, join: bool = True) -> tuple[Outcome, float]:
        """Granted, or a place in line kept (and the seconds until the soonest lease expires), or a full
        line. Asking again with the same member keeps its place. ``join`` False: not granted at once, it
        takes no place (a request that does not wait)."""
        keys = [*ask.line, *(g.key for g in ask.groups)]
        args: list[Any] = [ask.member, ttl_ms, ask.slots, ask.max_queue, ask.head_start_ms, int(join)]
        args += [g.limit for g in ask.groups]
        code, ms = await self._acquire(keys=keys, args=args)
        outcome: Outcome = "granted" if code == 1 else "full" if code == -1 else "wait"
        return outcome, max(0, int(ms)) / 1000

    async def renew(self, held: Sequence[LeaseAsk], ttl_ms: int) -> int:
        """Push every lease in ``held`` to now + TTL (re-adding any that Redis lost); how many leases."""
        keys: list[str] = []
        args: list[Any] = [ttl_ms]
        for ask in held:
            for group in ask.groups:
                keys.append(group.key)
                args += [ask.member, ask.slots]
        return int(await self._renew(keys=keys, args=args)) if keys else 0

    async def release(self, ask: LeaseAsk) -> None:
        """Drop the request's leases, or its place in line."""
        keys = [*ask.line, *(g.key for g in ask.groups)]
        await self._release(keys=keys, args=[ask.member, ask.slots])

    async def ping(self) -> bool:
        return bool(await self.client.ping())

    def count(self, group: Group) -> Any:
        """Leases counted in ``group`` now, expired ones included (tests and diagnostics)."""
        return self.client.zcard(group.key)
