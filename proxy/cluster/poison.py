"""``SharedPoison``: the replicas' shared memory of poison requests (``proxy.admission.poison``), in Redis.

Alone, each replica remembers its own poison verdicts: a body that kills children costs two deaths on
*each* replica a balancer sends it to, and a key's strikes count per replica. With ``cluster.redis_url``
every verdict goes to Redis (``proxy.cluster.poison_scripts``: the refused bodies, the keys' strikes and
cool-downs, with Redis's TTLs) and is published to every replica, which learns it into its own memory
(``Poison.learn_*``). So:

- **the request path asks no one**: ``Poison.check`` is still a lookup in the replica's memory (no Redis
  round trip per request, none added to admission);
- **a verdict is shared before its client hears of it**: ``strike`` runs the script *synchronously*
  (a blocking call, on the event loop), so by the time this replica's 502 leaves, Redis holds the
  verdict and has sent it to every replica listening. A client (or a balancer's retry) that sends the
  same body again at once, to any replica, finds it refused: the verdict travels Redis -> replica in
  well under a millisecond, the client's next request through a balancer takes longer. The price: a
  verdict blocks this replica's loop for one round trip (docs/benchmarks.md: 0.2 ms at the median), at
  most ``cluster.socket_timeout_s`` for a Redis that hangs; verdicts are rare (two deaths each);
- **a key's strikes count across replicas**: ``strikes`` poison requests within ``window_s`` on any
  replicas cool the key down on all of them;
- **a replica that starts (or whose listening connection broke) learns everything first**: it listens,
  then reads every verdict in force (``SYNC``), so nothing falls between the two.

Redis unreachable (the limiter's mode is not ``cluster``): a strike is this replica's alone, as without
Redis; the listener reconnects every ``cluster.probe_interval_s``, and once it does (or once the limiter
says Redis is back, ``ClusterLimiter.on_resume``), what this replica judged meanwhile goes to Redis and
is published, and what the others did is read. Strikes counted during an outage stay local (only their
verdicts are merged). A Redis that restarts empty gets the verdicts back the same way: each replica's
listening connection broke, and once it is made again the replica sends what it still refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Iterable
from typing import Any

import redis
from redis.asyncio.client import PubSub
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as BrokenConnection
from redis.retry import Retry

from proxy.admission.poison import MAX_BODIES, Poison
from proxy.cluster.limiter import REDIS_ERRORS, ClusterLimiter
from proxy.cluster.poison_scripts import BODIES, CHANNEL, COOLING, STRIKE, SYNC, strikes_key
from proxy.settings import PoisonSettings

_log = logging.getLogger("llamagate.cluster")


class SharedPoison:
    """Implements ``proxy.admission.poison.PoisonShare`` for ``poison``, over ``limiter``'s Redis."""

    def __init__(self, limiter: ClusterLimiter, poison: Poison) -> None:
        self._limiter = limiter
        self._poison = poison
        self.origin = secrets.token_hex(6)  # this replica, in what it publishes
        settings = limiter.settings
        # The strike's own connection: synchronous, so the verdict is in Redis before the 502 leaves.
        self._sync = redis.Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.socket_timeout_s,
            # A connection a restarted Redis closed is made again, once; a timeout is not retried (redis-py's
            # default would), so a hung Redis holds the loop one ``socket_timeout_s``, not two.
            retry=Retry(NoBackoff(), 1, supported_errors=(BrokenConnection,)),
            retry_on_timeout=False,
        )
        self._strike = self._sync.register_script(STRIKE)
        self._read = limiter.leases.client.register_script(SYNC)
        self._listener: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()  # set once the listener reads every verdict in force
        limiter.on_resume.append(self._resumed)
        self.learned = 0  # verdicts and strikes learned from the other replicas (tests, diagnostics)

    def start(self) -> None:
        """Listen from now on (in the app's running loop; idempotent)."""
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(self._listen(), name="poison-listen")

    async def synced(self) -> None:
        """Return once the listener has read every verdict in force (tests; the caller bounds the wait)."""
        await self._synced.wait()

    # --- PoisonShare ------------------------------------------------------------------------------------
    def strike(self, key_id: str, digest: bytes, settings: PoisonSettings) -> bool | None:
        limiter = self._limiter
        if limiter.mode != "cluster":
            return None  # this replica's alone; sent with the rest once Redis answers (``_sync_now``)
        args: list[Any] = [
            self.origin,
            key_id,
            digest.hex(),
            secrets.token_hex(8),
            settings.strikes,
            round(settings.window_s * 1000),
            round(settings.cooldown_s * 1000),
            MAX_BODIES,
            CHANNEL,
        ]
        try:
            cooled = self._strike(keys=[BODIES, COOLING, strikes_key(key_id)], args=args)
        except REDIS_ERRORS as exc:
            limiter.lost(exc)  # the mode switches; this verdict goes to Redis once it is back
            return None
        return int(cooled) > 0

    # --- learning from the others ------------------------------------------------------------------------
    async def _listen(self) -> None:
        """Subscribe, then read every verdict in force, then learn each one published; on a broken
        connection, again after ``probe_interval_s``."""
        client = self._limiter.leases.client
        while True:
            pubsub: PubSub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(CHANNEL)
                await self._sync_now()
                async for message in pubsub.listen():
                    self._learn(message.get("data"))
            except REDIS_ERRORS:
                self._synced.clear()
            finally:
                with contextlib.suppress(*REDIS_ERRORS):
                    await pubsub.aclose()
            await asyncio.sleep(self._limiter.probe_s)

    def _resumed(self) -> None:
        """Redis answers again (the limiter's probe): what was judged here meanwhile goes there now."""
        self._limiter.spawn(self._sync_quietly())

    async def _sync_quietly(self) -> None:
        try:
            await self._sync_now()
        except REDIS_ERRORS as exc:
            self._limiter.lost(exc)

    async def _sync_now(self) -> None:
        """Send what this replica refuses (added where Redis has less), read what every replica does."""
        bodies, keys = self._poison.verdicts()
        args: list[Any] = [self.origin, CHANNEL, MAX_BODIES, len(bodies)]
        for digest, left_s in bodies:
            args += [digest.hex(), max(1, round(left_s * 1000))]
        for key_id, left_s in keys:
            args += [key_id, max(1, round(left_s * 1000))]
        async with asyncio.timeout(self._limiter.call_s):
            refused_bodies, cooling = await self._read(keys=[BODIES, COOLING], args=args)
        for digest_hex, left_ms in _pairs(refused_bodies):
            self._poison.learn_body(bytes.fromhex(digest_hex), left_ms / 1000)
        for key_id, left_ms in _pairs(cooling):
            self._poison.learn_cooling(key_id, left_ms / 1000)
        self._synced.set()

    def _learn(self, data: object) -> None:
        """One message of ``CHANNEL``: another replica's strike (``s``) or what it judged alone (``m``)."""
        try:
            text = data.decode() if isinstance(data, bytes) else str(data)
            msg = json.loads(text)
            if not isinstance(msg, dict) or msg.get("o") == self.origin:
                return
            poison = self._poison
            if msg.get("s"):
                key_id = str(msg["k"])
                poison.learn_body(bytes.fromhex(msg["d"]), int(msg["b"]) / 1000)
                poison.learn_strike(key_id)
                if int(msg["c"]) > 0:
                    poison.learn_cooling(key_id, int(msg["c"]) / 1000)
                self.learned += 1
                _log.info(
                    "a poison verdict of another replica: its body is refused here too",
                    extra={"fields": {"key_id": key_id, "key_cools_down": int(msg["c"]) > 0}},
                )
            elif msg.get("m"):
                for digest_hex, left_ms in _entries(msg.get("bodies")):
                    poison.learn_body(bytes.fromhex(digest_hex), left_ms / 1000)
                for key_id, left_ms in _entries(msg.get("keys")):
                    poison.learn_cooling(key_id, left_ms / 1000)
                self.learned += 1
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            _log.warning("a message on the poison channel was not understood: ignored")

    async def aclose(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
        self._sync.close()


def _pairs(flat: Iterable[Any]) -> list[tuple[str, int]]:
    """``[member, ms, member, ms, ...]`` as Redis answers them (bytes, ints) -> ``[(member, ms), ...]``."""
    items = [v.decode() if isinstance(v, bytes) else v for v in flat]
    return [(str(items[i]), int(items[i + 1])) for i in range(0, len(items) - 1, 2)]


def _entries(value: object) -> list[tuple[str, int]]:
    """A published list of ``[member, ms]`` (Lua's JSON writes an empty one as ``{}``)."""
    if not isinstance(value, list):
        return []
    return [(str(member), int(ms)) for member, ms in value]
