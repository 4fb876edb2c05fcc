"""``llamagate bench soak``: a daemon under twice its envelope for N minutes, with the child killed,
stopped and the config reloaded underneath, and the books kept (``soak_ledger``).

The run starts its own daemon (``launcher.start_llamagate``) from the given config with three tenants
of different shares, one inference key each and an admin key for the monitor, then:

- ``concurrency`` client loops (default: twice the slots) send a mix of streamed and plain chat
  completions, and clients that leave mid-answer (a stream closed after its first token, a plain call
  cut after ``drop_after_s``); every call has its own deadline, so a hang is counted, never waited on;
- a monitor reads ``/metrics`` (permits in flight + lingering slots), ``/slots`` (busy), ``/metrics``
  again, twice a second, and the daemon's RSS and open descriptors (psutil) every few seconds;
- the daemon's replays (``llamagate_replays_total``: requests run again on the next child because
  theirs died before any byte of the answer reached the client) are read at the end, by reason;
- the chaos steps run at fixed fractions of the run: SIGHUP reloads (a real change: one tenant's queue
  length flips), SIGKILL of the child, SIGSTOP of the child for ``stop_s`` then SIGCONT. They all fall
  in the first half, so the last 5 minutes of a 10-minute run measure a settled daemon's memory.

At the end the load stops, the gauges must come back to 0 and the descriptors to their start count.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from supervisor.bench import provenance
from supervisor.bench.client import Exchange, Target, stream_chat
from supervisor.bench.launcher import PrivateDaemon, deep_merge, start_llamagate, validate
from supervisor.bench.soak_ledger import Ending, Ledger, ResourceSample, SlotSample, evaluate, report
from supervisor.child.spawn import free_port
from supervisor.config.keys import ADMIN, new_key_config
from supervisor.progress import NullProgress, Progress

SCHEMA = "llamagate.bench.soak/1"
# (tenant, max_concurrency, max_queue, queue_timeout_s): one roomy, one narrow, one that never queues.
TENANTS = (("alpha", 2, 4, 10.0), ("beta", 1, 2, 10.0), ("gamma", 1, 0, 5.0))
# What a client does, and how often.
KINDS = (("stream", 0.40), ("plain", 0.35), ("drop_stream", 0.15), ("drop_plain", 0.10))
# Chaos steps at fractions of the run (all in the first half).
CHAOS = (("sighup", 0.10), ("sigkill", 0.20), ("sighup", 0.30), ("sigstop", 0.35), ("sighup", 0.45))
GAUGES = ("llamagate_in_flight_requests", "llamagate_queued_requests", "llamagate_lingering_slots")
SETTLE_TIMEOUT_S = 90.0
RESOURCE_EVERY_S = 5.0


@dataclass(frozen=True)
class SoakSpec:
    base_config: dict[str, Any]
    minutes: float = 10.0
    concurrency: int | None = None  # None: twice the configured slots
    max_tokens: int = 32
    request_timeout_s: float = 120.0
    drop_after_s: float = 0.5
    stop_s: float = 20.0
    chaos: bool = True
    poll_s: float = 0.5
    seed: int = 12


@dataclass
class _Run:
    spec: SoakSpec
    daemon: PrivateDaemon
    admin: Target
    keys: dict[str, str]
    ledger: Ledger = field(default_factory=Ledger)
    t0: float = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0


def soak_config(base: dict[str, Any]) -> tuple[dict[str, Any], str, dict[str, str]]:
    """The daemon's config: the base with a free port, the soak's tenants and fresh keys (digests only in
    the file). Returns the config, the admin key and the inference key of each tenant."""
    tenants = [
        {"name": n, "max_concurrency": c, "max_queue": q, "queue_timeout_s": t} for n, c, q, t in TENANTS
    ]
    tenants.append({"name": "ops", "max_concurrency": 1, "max_queue": 0})
    keys: dict[str, str] = {}
    admin_key, admin = new_key_config("ops", ADMIN)
    entries = [admin]
    for name, *_ in TENANTS:
        keys[name], entry = new_key_config(name)
        entries.append(entry)
    overrides = {"proxy": {"host": "127.0.0.1", "port": free_port()}, "tenants": tenants, "keys": entries}
    return deep_merge(base, overrides), admin_key, keys


def chaos_plan(duration_s: float) -> list[tuple[float, str]]:
    return [(duration_s * frac, action) for action, frac in CHAOS]


def pick_kind(rng: random.Random) -> str:
    return rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]


# --- one client call ------------------------------------------------------------------------------------
def _classify_status(status: int) -> Ending:
    return "refused" if status in (408, 413, 429, 503) else "failed"


def _streamed(ex: Exchange, spec: SoakSpec) -> tuple[Ending, int | None, str | None]:
    if ex.outcome == "timeout":
        return "hung", ex.status, f"no end within {spec.request_timeout_s:g} s"
    if ex.status is not None and ex.status != 200:
        return _classify_status(ex.status), ex.status, ex.reason
    if ex.left:
        return "abandoned", 200, None  # it left after the first token: stream_chat closed the connection
    if ex.outcome == "ok":
        return "completed", 200, None
    return "failed", ex.status, ex.reason


async def one_call(
    client: httpx.AsyncClient, target: Target, kind: str, body: dict[str, Any], spec: SoakSpec
) -> tuple[Ending, int | None, str | None]:
    """Send one request of ``kind``; return how it ended. Never raises (but for cancellation)."""
    if kind in ("stream", "drop_stream"):
        payload = {**body, "stream": True}
        ex = await stream_chat(
            client, target, payload, spec.request_timeout_s, leave_after_first=kind == "drop_stream"
        )
        return _streamed(ex, spec)
    url = target.api_root + "/chat/completions"
    payload = {**body, "stream": False}
    status: int | None = None
    try:
        async with asyncio.timeout(spec.request_timeout_s):
            if kind == "drop_plain":
                try:
                    async with asyncio.timeout(spec.drop_after_s):
                        r = await client.post(url, json=payload, headers=target.headers())
                except TimeoutError:
                    return "abandoned", None, None
            else:
                r = await client.post(url, json=payload, headers=target.headers())
            status = r.status_code
            if status != 200:
                return _classify_status(status), status, f"HTTP {status}"
            choices = r.json().get("choices")
            return ("completed", 200, None) if choices else ("failed", 200, "answer without choices")
    except TimeoutError:
        return "hung", status, f"no end within {spec.request_timeout_s:g} s"
    except (httpx.HTTPError, ValueError) as exc:
        return "failed", status, type(exc).__name__


async def _client_loop(run: _Run, index: int, end_t: float) -> None:
    rng = random.Random(run.spec.seed * 1000 + index)  # noqa: S311 - a reproducible mix, not a secret
    names = [n for n, *_ in TENANTS]
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    timeout = httpx.Timeout(run.spec.request_timeout_s)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        i = 0
        while run.now() < end_t:
            tenant = names[(index + i) % len(names)]
            kind = pick_kind(rng)
            max_tokens = run.spec.max_tokens * (2 if kind.startswith("drop") else 1)
            # No "model": the daemon serves one, whatever the config calls it.
            body = {
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"Note {rng.randrange(10**6)} about the sea."}],
            }
            ticket = run.ledger.start()
            ending, status, reason = await one_call(
                client, Target(run.daemon.base_url, run.keys[tenant]), kind, body, run.spec
            )
            run.ledger.finish(ticket, kind, ending, status=status, reason=reason)
            if ending == "refused":
                await asyncio.sleep(0.2 + rng.random() * 0.3)  # a polite client backs off a little
            i += 1


# --- monitor ---------------------------------------------------------------------------------------------
def parse_gauges(text: str) -> dict[str, float]:
    out = dict.fromkeys(GAUGES, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in out:
            out[family.name] = sum(s.value for s in family.samples)
    return out


def parse_replays(text: str) -> dict[str, float]:
    """``llamagate_replays_total`` by reason, summed over models: the requests the daemon ran again on
    the next child because theirs died before any byte of the answer reached the client."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llamagate_replays_total":
                reason = sample.labels.get("reason", "?")
                out[reason] = out.get(reason, 0.0) + sample.value
    return out


async def _replays(admin: Target) -> dict[str, float] | None:
    try:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            r = await client.get(admin.server_root + "/metrics", headers=admin.headers())
            r.raise_for_status()
            return parse_replays(r.text)
    except httpx.HTTPError:
        return None


async def _gauges(client: httpx.AsyncClient, admin: Target) -> dict[str, float]:
    r = await client.get(admin.server_root + "/metrics", headers=admin.headers())
    r.raise_for_status()
    return parse_gauges(r.text)


async def _ready_generation(client: httpx.AsyncClient, admin: Target) -> int | None:
    """The child's generation when /readyz says ready, else None."""
    body = (await client.get(admin.server_root + "/readyz")).json()
    return int(body["generation"]) if body.get("ready") is True else None


def _permits(g: dict[str, float]) -> int:
    return int(g["llamagate_in_flight_requests"] + g["llamagate_lingering_slots"])


async def _monitor(run: _Run, stop: asyncio.Event) -> None:
    proc = psutil.Process(run.daemon.pid)
    every_s = min(RESOURCE_EVERY_S, run.spec.minutes * 60.0 / 40)  # enough samples in a short run too
    last_resource = -every_s
    async with httpx.AsyncClient(timeout=3.0, trust_env=False) as client:
        while not stop.is_set():
            if run.now() - last_resource >= every_s:
                last_resource = run.now()
                with contextlib.suppress(psutil.Error):
                    run.ledger.resource(ResourceSample(run.now(), proc.memory_info().rss, proc.num_fds()))
            try:
                ready_before = await _ready_generation(client, run.admin)
                before = await _gauges(client, run.admin)
                r = await client.get(run.admin.server_root + "/slots", headers=run.admin.headers())
                r.raise_for_status()
                busy = sum(1 for s in r.json() if isinstance(s, dict) and s.get("is_processing"))
                after = await _gauges(client, run.admin)
                ready_after = await _ready_generation(client, run.admin)
                if ready_before is None or ready_before != ready_after:
                    # Not READY (or restarted in between): the supervisor's own readiness decode may be
                    # using a slot, and the proxy admits nothing; not a sample of the gate.
                    run.ledger.slot_not_ready += 1
                else:
                    run.ledger.slots(SlotSample(run.now(), busy, _permits(before), _permits(after)))
            except (httpx.HTTPError, ValueError, TypeError):
                run.ledger.slot_errors += 1  # the child stopped or restarting: no sample, counted
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), run.spec.poll_s)


# --- chaos -----------------------------------------------------------------------------------------------
def _child_pid(run: _Run) -> int | None:
    try:
        return run.daemon.child_pid
    except (httpx.HTTPError, ValueError, KeyError):
        return None  # the daemon did not say (busy, or between children): no target for this step


async def _chaos(run: _Run, plan: Sequence[tuple[float, str]]) -> None:
    flip = False
    for at_s, action in plan:
        await asyncio.sleep(max(0.0, at_s - run.now()))
        event: dict[str, Any] = {"action": action, "at_s": round(run.now(), 1)}
        if action == "sighup":
            flip = not flip
            tenants = [dict(t) for t in run.daemon.config["tenants"]]
            tenants[0]["max_queue"] = 3 if flip else 4  # a real change, so the reload applies something
            run.daemon.write_config({"tenants": tenants})
            run.daemon.signal(signal.SIGHUP)
        else:
            pid = await asyncio.to_thread(_child_pid, run)
            event["child_pid"] = pid
            if pid is None:
                event["skipped"] = "no child running"
            elif action == "sigkill":
                _signal(pid, signal.SIGKILL, event)
            elif action == "sigstop":
                _signal(pid, signal.SIGSTOP, event)
                await asyncio.sleep(run.spec.stop_s)
                _signal(pid, signal.SIGCONT, event)  # the supervisor may have killed it meanwhile
                event["stopped_s"] = run.spec.stop_s
        run.ledger.chaos.append(event)


def _signal(pid: int, sig: int, event: dict[str, Any]) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        event.setdefault("gone", []).append(signal.Signals(sig).name)


# --- the end ---------------------------------------------------------------------------------------------
async def _settle(run: _Run) -> dict[str, float] | None:
    """Wait (bounded) for the gauges to reach 0; return the last reading and /readyz's counts beside."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last: dict[str, float] | None = None
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                gauges = await _gauges(client, run.admin)
                ready = (await client.get(run.admin.server_root + "/readyz")).json()
                last = {
                    **gauges,
                    "readyz_in_flight": float(ready.get("in_flight", -1)),
                    "readyz_queued": float(ready.get("queued", -1)),
                }
                if all(v == 0 for v in last.values()):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.5)
    return last


def _fds_settled(pid: int, start: int, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    fds: int | None = None
    while True:
        try:
            fds = psutil.Process(pid).num_fds()
        except psutil.Error:
            return fds
        if fds <= start or time.monotonic() >= deadline:
            return fds
        time.sleep(0.5)


async def _warm_up(run: _Run) -> None:
    """One answered request and one monitor round before the descriptors are counted, so that pooled
    connections the daemon keeps in steady state (to the child, for probes and scrapes) are in the
    start count, not mistaken for a leak at the end."""
    async with httpx.AsyncClient(timeout=run.spec.request_timeout_s, trust_env=False) as client:
        body = {"max_tokens": 4, "messages": [{"role": "user", "content": "warm up"}]}
        await one_call(client, run.admin, "plain", body, run.spec)
        with contextlib.suppress(httpx.HTTPError):
            await _gauges(client, run.admin)
            await client.get(run.admin.server_root + "/slots", headers=run.admin.headers())
    await asyncio.sleep(1.0)


def _describe(c: Any) -> str:
    local = c.laddr.port if c.laddr else "-"
    remote = c.raddr.port if c.raddr else "-"
    return f"{c.type.name}:{c.status}:{local}->{remote}"


def _fd_detail(pid: int) -> dict[str, Any]:
    """What the daemon's descriptors are, by kind (for a leak's diagnosis; no addresses beyond ports)."""
    try:
        proc = psutil.Process(pid)
        conns = proc.net_connections(kind="all")
        return {
            "fds": proc.num_fds(),
            "files": len(proc.open_files()),
            "connections": sorted(_describe(c) for c in conns if not isinstance(c.laddr, str)),
            "unix_sockets": sum(1 for c in conns if isinstance(c.laddr, str)),
        }
    except psutil.Error as exc:
        return {"error": type(exc).__name__}


async def _drive(run: _Run) -> dict[str, Any]:
    spec = run.spec
    duration_s = spec.minutes * 60.0
    slots = validate(run.daemon.config, "soak config").llama.slots
    concurrency = spec.concurrency or 2 * slots
    pid = run.daemon.pid
    await _warm_up(run)
    fds_start = psutil.Process(pid).num_fds()
    detail = {"start": _fd_detail(pid)}
    run.t0 = time.monotonic()
    stop = asyncio.Event()
    monitor = asyncio.create_task(_monitor(run, stop))
    chaos = asyncio.create_task(_chaos(run, chaos_plan(duration_s) if spec.chaos else []))
    clients = [asyncio.create_task(_client_loop(run, i, duration_s)) for i in range(concurrency)]
    try:
        await asyncio.gather(*clients)
        load_end_t = run.now()
        await chaos
        gauges = await _settle(run)
        replays = await _replays(run.admin)
        stop.set()
        await monitor  # its connection closed before the descriptors are counted
        fds_end = await asyncio.to_thread(_fds_settled, pid, fds_start, 30.0)
        detail["end"] = _fd_detail(pid)
    finally:
        stop.set()
        chaos.cancel()
        for task in clients:
            task.cancel()
        await asyncio.gather(monitor, chaos, *clients, return_exceptions=True)
    window = min(300.0, duration_s / 2)
    targets = evaluate(
        run.ledger,
        gauges_at_end=gauges,
        fds_start=fds_start,
        fds_end=fds_end,
        load_end_t=load_end_t,
        rss_window_s=window,
    )
    result = report(run.ledger, targets)
    result.update(
        {
            "concurrency": concurrency,
            "slots": slots,
            "duration_s": round(load_end_t, 1),
            "gauges_at_end": gauges,
            "replays": replays,
            "fd_detail": detail,
            "slots_over_samples": [asdict(x) for x in run.ledger.slot_samples if x.over][:50],
        }
    )
    return result


def run_soak(
    spec: SoakSpec, out: Path, argv: Sequence[str], progress: Progress | None = None
) -> dict[str, Any]:
    """Start the daemon, soak it, stop it; write ``soak.json`` into ``out`` and return the result."""
    progress = progress or NullProgress()
    out.mkdir(parents=True, exist_ok=True)
    config, admin_key, keys = soak_config(spec.base_config)
    folder = out / "llamagate"
    daemon = start_llamagate(config, admin_key, folder, progress=progress)
    try:
        # Before the run: the checkout's commit is the code the daemon imported, not a later one.
        record = provenance.collect(argv, {}, launched={"llamagate": daemon.identity})
        run = _Run(spec, daemon, daemon.target, keys)
        result = asyncio.run(_drive(run))
        result["final_child_pid"] = _child_pid(run)
    finally:
        exit_code = daemon.stop()
    result["schema"] = SCHEMA
    result["spec"] = {k: v for k, v in asdict(spec).items() if k != "base_config"}
    result["daemon_exit_code"] = exit_code
    result["daemon_pid"] = daemon.pid
    result["provenance"] = record
    (out / "soak.json").write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    return result
