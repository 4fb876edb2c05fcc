"""The proxy alone in its own process, in front of a fixed upstream: what ``tests.benchmarks.proxy`` measures.

It runs the same ``create_app`` and the same uvicorn settings as the daemon, minus the supervisor (the
upstream is given: a fake or a llama-server the benchmark started), so the process's CPU time is the
proxy's and nothing else's. The one key's id and digest come from the command line (never the key).

``--store PATH``: with the accounts store on, as a daemon with ``store:`` runs it (its key view, budgets,
usage ledger and writer thread), and the tenant given budgets far above what a run uses, so every
request is checked, held and charged but none refused. The key is then looked up in the store (the
benchmark puts it there), not in the config.

``--count-opcodes FILE``: SIGUSR1 starts counting the bytecode instructions the event loop's thread runs,
per function (``sys.settrace`` with opcode events: slow, but exact and the same on a busy host as on a
quiet one); SIGUSR2 stops and writes them to FILE as JSON (``tests.benchmarks.proxy_opcodes``).

``python -m tests.benchmarks.proxy_server --upstream URL --port N --key-id ID --key-digest D ...``
prints ``listening on http://127.0.0.1:PORT`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping
from types import CodeType, FrameType
from typing import Any

import uvicorn

from proxy.accounts.service import Accounts
from proxy.app import create_app
from proxy.listener.guard import FrontDoor, uvicorn_config
from proxy.models.lane import ModelEntry
from proxy.settings import (
    BudgetSettings,
    KeyEntry,
    ProxySettings,
    StoreSettings,
    TelemetrySettings,
    TenantSettings,
)
from proxy.source import UpstreamSnapshot
from supervisor import logs


class FixedUpstream:
    def __init__(self, snap: UpstreamSnapshot) -> None:
        self._snap = snap

    def snapshot(self) -> UpstreamSnapshot:
        return self._snap

    def identity(self) -> Mapping[str, object]:
        return {"upstream": self._snap.base_url, "benchmark": True}


# Budgets that are checked, held and charged on every request, and never refuse one in a benchmark.
UNREACHED = BudgetSettings(tokens_per_minute=10**12, tokens_per_day=10**15, requests_per_minute=10**9)


def build_settings(args: argparse.Namespace) -> ProxySettings:
    tenant = TenantSettings(
        "bench",
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        queue_timeout_s=args.queue_timeout_s,
        budgets=UNREACHED if args.store else BudgetSettings(),
    )
    telemetry = None
    if args.telemetry_endpoint:
        telemetry = TelemetrySettings(endpoint=args.telemetry_endpoint, metrics_interval_s=5.0)
    if args.store:
        store = StoreSettings(args.store)
        return ProxySettings(
            tenants=(tenant,),
            access_log=args.access_log,
            store=store,
            telemetry=telemetry,
            unknown_fields="pass",
        )
    key = KeyEntry(args.key_id, args.key_digest, "bench", frozenset({"inference", "admin"}))
    # The fake child's switches (fake_token_interval_ms...) are body fields no route declares: passed.
    return ProxySettings(
        tenants=(tenant,),
        keys=(key,),
        access_log=args.access_log,
        telemetry=telemetry,
        unknown_fields="pass",
        admin_unknown_fields="pass",
    )


async def _serve(args: argparse.Namespace) -> None:
    snap = UpstreamSnapshot(
        state="READY",
        ready=True,
        reason=None,
        base_url=args.upstream,
        secret=os.environ.get("LLAMAGATE_BENCH_UPSTREAM_SECRET") or None,
        model_alias=args.alias,
        slots=args.slots,
        ctx_per_slot=args.ctx_per_slot,
        generation=1,
        retry_after_s=1.0,
    )
    settings = build_settings(args)
    source = FixedUpstream(snap)
    accounts = Accounts.open(settings.store, settings.tenants) if settings.store else None
    if accounts is not None:
        accounts.start()
    app = create_app(settings, source, [ModelEntry(args.alias, (), source)], accounts=accounts)
    config = uvicorn_config(
        app,
        FrontDoor(lambda: settings.door),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    try:
        await task
    finally:
        if accounts is not None:
            await asyncio.to_thread(accounts.close)


class OpcodeCounter:
    """Bytecode instructions run per function, between SIGUSR1 and SIGUSR2 (the loop's thread only: the
    writer's and the key view's threads are left out)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.counts: dict[CodeType, int] = {}

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        if event == "opcode":
            code = frame.f_code
            self.counts[code] = self.counts.get(code, 0) + 1
        return self._trace

    def start(self, *_: object) -> None:
        self.counts.clear()
        sys.settrace(self._trace)

    def stop(self, *_: object) -> None:
        sys.settrace(None)
        rows = [[n, f"{c.co_filename}:{c.co_firstlineno}:{c.co_qualname}"] for c, n in self.counts.items()]
        with open(self.out, "w", encoding="utf-8") as f:
            json.dump(sorted(rows, reverse=True), f)

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self.start)
        signal.signal(signal.SIGUSR2, self.stop)


def main() -> None:
    parser = argparse.ArgumentParser(description="llamagate's proxy alone, for benchmarks")
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--key-id", required=True)
    parser.add_argument("--key-digest", required=True)
    parser.add_argument("--alias", default="gemma-3-270m")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--ctx-per-slot", type=int, default=4096)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--max-queue", type=int, default=1024)
    parser.add_argument("--queue-timeout-s", type=float, default=30.0)
    parser.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--store", help="the accounts store's file (its key is looked up there); default: none"
    )
    parser.add_argument(
        "--telemetry-endpoint", help="export OpenTelemetry traces and metrics to this OTLP/HTTP receiver"
    )
    parser.add_argument("--log-file", default=os.devnull)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--count-opcodes", metavar="FILE", help="count bytecode between SIGUSR1 and SIGUSR2")
    args = parser.parse_args()
    if args.count_opcodes:
        OpcodeCounter(args.count_opcodes).install()
    # Access lines are formatted and written as in the daemon (JSON lines), to a file instead of a terminal.
    logs.setup("json", "INFO")
    with open(args.log_file, "a", encoding="utf-8") as sink:
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr:
                handler.setStream(sink)
        if args.loop == "uvloop":
            try:  # optional, not a dependency (`pip install uvloop` to compare loops); typed as a module
                uvloop = importlib.import_module("uvloop")
            except ImportError:
                raise SystemExit("--loop uvloop: the uvloop package is not installed") from None
            uvloop.run(_serve(args))
        else:
            asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
