"""``python -m tests.benchmarks.proxy``: what the proxy costs, measured against the same upstream straight,
in one run.

Three processes, so the numbers are honest on a small host: the upstream (the fast fake llama-server, or
the real one), the proxy alone (``tests.benchmarks.proxy_server``, the daemon's app and uvicorn settings
without the supervisor) and the load generator (this process, on a lean HTTP client). The proxy's CPU
is read from its own process.

Phases (targets from issue 4, for a 2-core host):
  fake    added latency p50 at concurrency 1 (<= 1.5 ms), requests/s at concurrency 32 (>= 800),
          proxy CPU per streamed SSE event (<= 0.05 ms)
  model   time per output token with 4 concurrent streams, proxy / direct (within 3 %), and the
          overload picture: 4 slots, 8 concurrent streams, first-token times straight vs through the gate
  accounts  the proxy's CPU per request with the accounts store on (store key, budgets, usage ledger)
          against off (at most 30 % more, issue 38: a regression alarm, not a design target): two
          proxies in front of one fake, alternating rounds of the closed-loop throughput run,
          non-streamed and streamed
  telemetry  the same with OpenTelemetry exporting to a real OTLP/HTTP receiver against off: the added
          CPU per request, recorded (no target; issue 42)

``--store`` runs the fake phase's proxy with the store on.

Exit status 0 when every measured target holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from proxy.accounts.issue import issue_key
from proxy.accounts.sqlite import open_store
from proxy.auth import new_key
from supervisor.artifacts.files import sha256_file
from supervisor.bench.launcher import BareServer, start_llama_server
from supervisor.bench.provenance import llamagate_identity
from supervisor.bench.stats import percentile
from supervisor.child.spawn import popen_tied, stop_popen
from supervisor.daemon.identity import host_identity
from supervisor.errors import StartupError
from supervisor.progress import ConsoleProgress
from tests.benchmarks import cli
from tests.benchmarks import proxycost as pc

TARGETS = {
    "added_p50_ms": 1.5,
    "rps_c32": 800.0,
    "cpu_ms_per_event": 0.05,
    "tpot_ratio": 1.03,
    # A regression alarm (issue 38), not a design target: about 0.1 ms on a 0.4 ms baseline, beside
    # answers that take seconds; no clarity is traded for a few percent of it.
    "accounts_cpu_ratio": 1.30,
}
TTFT_GATE_S = 1.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--phases",
        default="fake,model",
        help="comma list of: fake, model, accounts, telemetry (default fake,model)",
    )
    parser.add_argument(
        "--store", action="store_true", help="the fake phase's proxy with the accounts store on (a temp file)"
    )
    parser.add_argument("--requests", type=int, default=3000, help="latency samples per side (default 3000)")
    parser.add_argument(
        "--duration", type=float, default=10.0, help="seconds of the throughput run (default 10)"
    )
    parser.add_argument("--concurrency", type=int, default=32, help="connections of the throughput run")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams of the SSE CPU run")
    parser.add_argument("--events", type=int, default=1000, help="events per stream of the SSE CPU run")
    parser.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default="asyncio", help="the proxy's event loop"
    )
    parser.add_argument("--binary", type=Path, help="llama-server (default: built from the lock)")
    parser.add_argument("--model", type=Path, help="GGUF model (default: the demo model)")
    parser.add_argument("--threads", type=int, default=2, help="llama-server threads (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating direct/proxy rounds for TPOT")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per stream of the model phase")
    parser.add_argument("--out", type=Path, help="write the full results as JSON here")


# --- processes ---------------------------------------------------------------------------------------
def _python(module: str, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    with tempfile.TemporaryFile("w+") as errors:
        proc = popen_tied(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=cli.python_env(env),
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the child prints its URL once it accepts connections
        if not line.startswith("listening on "):
            proc.kill()
            proc.wait()
            errors.seek(0)
            raise StartupError(f"{module} did not start: {errors.read()[-2000:]}")
    return proc, line.split()[-1]


@contextmanager
def _processes() -> Iterator[list[subprocess.Popen[Any]]]:
    procs: list[subprocess.Popen[Any]] = []
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            stop_popen(proc, 10)


def _proxy(
    upstream: str,
    secret: str,
    key_id: str,
    digest: str,
    loop: str,
    store: Path | None = None,
    extra: tuple[str, ...] = (),
    **limits: int,
) -> tuple[subprocess.Popen[str], str]:
    args = ["--upstream", upstream, "--key-id", key_id, "--key-digest", digest, "--loop", loop, *extra]
    if store is not None:
        args += ["--store", str(store)]
    for name, value in limits.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    return _python("tests.benchmarks.proxy_server", *args, env={"LLAMAGATE_BENCH_UPSTREAM_SECRET": secret})


def _fake(secret: str) -> tuple[subprocess.Popen[str], str]:
    # "--secret=" + it: a token_urlsafe may start with "-", which argparse would take for an option.
    return _python("tests.fakes.fake_llama", f"--secret={secret}", "--tokens", "16")


def _store_with_key(folder: Path) -> tuple[Path, str]:
    """A fresh accounts store holding one key of the bench tenant, with the scopes of the config key the
    proxy is given without a store (inference and admin: the same answers, unfiltered); (file, key)."""
    path = folder / "llamagate.db"
    store = open_store(path)
    try:
        key, record = issue_key("bench", frozenset({"inference", "admin"}), time.time())
        store.add_key(record)
    finally:
        store.close()
    return path, key


# --- phases ------------------------------------------------------------------------------------------
async def _fake_phase(args: argparse.Namespace, procs: list[subprocess.Popen[Any]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="llamagate-bench-store-") as folder:
        return await _measure_fake(args, procs, Path(folder) if args.store else None)


async def _measure_fake(
    args: argparse.Namespace, procs: list[subprocess.Popen[Any]], folder: Path | None
) -> dict[str, Any]:
    secret = secrets.token_urlsafe(16)
    key, entry = new_key("bench", frozenset({"inference"}))
    store = None
    if folder is not None:
        store, key = _store_with_key(folder)
    fake, fake_url = _fake(secret)
    procs.append(fake)
    proxy, proxy_url = _proxy(
        fake_url, secret, entry.key_id, entry.digest, args.loop, store, slots=256, max_concurrency=256
    )
    procs.append(proxy)
    direct_req = pc.chat_request(fake_url, secret, 16, False)
    proxy_req = pc.chat_request(proxy_url, key, 16, False)
    # Warm both paths, then alternate blocks so drift on a shared host hits both sides alike.
    await pc.latencies(fake_url, direct_req, 200)
    await pc.latencies(proxy_url, proxy_req, 200)
    direct: list[float] = []
    via: list[float] = []
    block = max(50, args.requests // 10)
    while len(via) < args.requests:
        direct += await pc.latencies(fake_url, direct_req, block)
        via += await pc.latencies(proxy_url, proxy_req, block)
    d, p = pc.summary_ms(direct), pc.summary_ms(via)
    cpu0 = pc.cpu_seconds(proxy.pid)
    done, elapsed, failed = await pc.throughput(proxy_url, proxy_req, args.concurrency, args.duration)
    cpu_per_request_ms = (pc.cpu_seconds(proxy.pid) - cpu0) / max(1, done) * 1000
    d_done, d_elapsed, _ = await pc.throughput(
        fake_url, direct_req, args.concurrency, min(args.duration, 3.0)
    )
    # Streams paced at 1 ms per token, so each event arrives in its own read, as from llama-server.
    stream_req = pc.chat_request(proxy_url, key, args.events, True, fake_token_interval_ms=1)
    cpu0 = pc.cpu_seconds(proxy.pid)
    results = await pc.streams(proxy_url, stream_req, args.streams)
    cpu = pc.cpu_seconds(proxy.pid) - cpu0
    events = sum(r.chunks for r in results)
    return {
        "store": store is not None,
        "latency_direct_ms": d,
        "latency_proxy_ms": p,
        "added_p50_ms": p["p50"] - d["p50"],
        "added_p99_ms": p["p99"] - d["p99"],
        "rps_c32": done / elapsed,
        "rps_c32_direct": d_done / d_elapsed,
        "non_200": failed,
        "cpu_ms_per_request": cpu_per_request_ms,
        "sse_events": events,
        "sse_tokens": sum(r.ex.content_events for r in results),
        "cpu_ms_per_event": cpu / max(1, events) * 1000,
    }


async def _accounts_phase(args: argparse.Namespace, procs: list[subprocess.Popen[Any]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="llamagate-bench-store-") as folder:
        return await _measure_accounts(args, procs, Path(folder))


async def _measure_accounts(
    args: argparse.Namespace, procs: list[subprocess.Popen[Any]], folder: Path
) -> dict[str, Any]:
    """The same closed loop through a proxy without a store and one with it, alternating which goes first
    round by round, so that a busy shared host's drift hits both alike; CPU per request of each proxy."""
    secret = secrets.token_urlsafe(16)
    key, entry = new_key("bench", frozenset({"inference"}))
    store, store_key = _store_with_key(folder)
    fake, fake_url = _fake(secret)
    procs.append(fake)
    off, off_url = _proxy(
        fake_url, secret, entry.key_id, entry.digest, args.loop, slots=256, max_concurrency=256
    )
    procs.append(off)
    on, on_url = _proxy(
        fake_url, secret, entry.key_id, entry.digest, args.loop, store, slots=256, max_concurrency=256
    )
    procs.append(on)
    sides = {"off": (off, off_url, key), "on": (on, on_url, store_key)}
    # The store side's answers carry the budgets' rate-limit headers (its tenant's budgets were checked
    # and held), the other side's none: what is compared is budgets and ledger on against both off.
    budgeted = {
        name: "x-ratelimit-limit-tokens" in await pc.reply_headers(url, pc.chat_request(url, k, 16, False))
        for name, (_, url, k) in sides.items()
    }
    out = await _alternate(args, sides)
    out["rate_limit_headers"] = budgeted
    out["accounts_cpu_ratio"] = max(out["whole_cpu_ms"]["ratio"], out["stream_cpu_ms"]["ratio"])
    out["ledger_rows"] = _ledger_rows(store)
    out["load_average"] = os.getloadavg()
    return out


Side = tuple[subprocess.Popen[str], str, str]  # (proxy process, its URL, the key to call it with)


async def _alternate(args: argparse.Namespace, sides: dict[str, Side]) -> dict[str, Any]:
    """The same closed loop through the "off" and the "on" proxy, alternating which goes first round by
    round, so that a busy shared host's drift hits both alike; CPU per request of each proxy, non-streamed
    and streamed, and their ratios (on / off)."""
    for stream in (False, True):
        for _, url, k in sides.values():  # warm both: imports, caches, the store's first pages
            await pc.throughput(url, pc.chat_request(url, k, 16, stream), args.concurrency, 1.0)
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        order = ("off", "on") if i % 2 == 0 else ("on", "off")
        row: dict[str, Any] = {"round": i + 1, "first": order[0]}
        for stream in (False, True):
            kind = "stream" if stream else "whole"
            for name in order:
                proc, url, k = sides[name]
                cpu0 = pc.cpu_seconds(proc.pid)
                done, elapsed, failed = await pc.throughput(
                    url, pc.chat_request(url, k, 16, stream), args.concurrency, args.duration
                )
                if failed:
                    raise StartupError(f"{failed} requests through the proxy ({name}) did not answer 200")
                row[f"{kind}_{name}_cpu_ms"] = (pc.cpu_seconds(proc.pid) - cpu0) / max(1, done) * 1000
                row[f"{kind}_{name}_rps"] = done / elapsed
        rounds.append(row)
        print(json.dumps(row), flush=True)
    out: dict[str, Any] = {"rounds": rounds, "concurrency": args.concurrency, "duration_s": args.duration}
    for kind in ("whole", "stream"):
        off_ms = statistics.median(r[f"{kind}_off_cpu_ms"] for r in rounds)
        on_ms = statistics.median(r[f"{kind}_on_cpu_ms"] for r in rounds)
        # The verdict's figure is the ratio of the two sides' medians; beside it, the median of each
        # round's own ratio (the two sides measured back to back, so drift between rounds cancels).
        paired = statistics.median(r[f"{kind}_on_cpu_ms"] / r[f"{kind}_off_cpu_ms"] for r in rounds)
        out[f"{kind}_cpu_ms"] = {"off": off_ms, "on": on_ms, "ratio": on_ms / off_ms, "paired_ratio": paired}
    return out


async def _telemetry_phase(args: argparse.Namespace, procs: list[subprocess.Popen[Any]]) -> dict[str, Any]:
    """OpenTelemetry on (exporting to a real OTLP/HTTP receiver in this process) against off: the proxy's
    added CPU per request, recorded, no target (issue 42)."""
    from tests.helpers.otlp import otlp_receiver  # the otel extra: only this phase needs it

    secret = secrets.token_urlsafe(16)
    key, entry = new_key("bench", frozenset({"inference"}))
    fake, fake_url = _fake(secret)
    procs.append(fake)
    with otlp_receiver() as receiver:
        sides: dict[str, Side] = {}
        for name, extra in (("off", ()), ("on", ("--telemetry-endpoint", receiver.url))):
            proc, url = _proxy(
                fake_url,
                secret,
                entry.key_id,
                entry.digest,
                args.loop,
                None,
                extra,
                slots=256,
                max_concurrency=256,
            )
            procs.append(proc)
            sides[name] = (proc, url, key)
        out = await _alternate(args, sides)
        out["spans_received"] = len(receiver.spans())
    for kind in ("whole", "stream"):
        figures = out[f"{kind}_cpu_ms"]
        figures["added_ms"] = figures["on"] - figures["off"]
    out["load_average"] = os.getloadavg()
    return out


def _ledger_rows(store: Path) -> int:
    """What the ledger wrote (every answered request of the store side): proof the run charged them."""
    opened = open_store(store)
    try:
        return len(opened.usage_records())
    finally:
        opened.close()


def _server_config(args: argparse.Namespace) -> dict[str, Any]:
    """The bare llama-server of the model phase, as a llamagate config (the launcher gives it the argv
    llamagate gives its child): the binary built from the lock and the demo model unless named."""
    llama: dict[str, Any] = {"threads": args.threads, "threads_batch": args.threads, "slots": 4}
    llama["ctx_per_slot"] = 2048
    if args.binary is not None:
        llama["binary"] = str(args.binary.resolve())
    if args.model is not None:
        # Trust on first use: the file as it is now is what gets measured (its digest is recorded).
        llama["model"] = {"path": str(args.model.resolve()), "sha256": sha256_file(args.model)}
    return {"llama": llama}


def _tpot_median(results: list[pc.Streamed]) -> float:
    values = [r.tpot_s for r in results if r.tpot_s is not None]
    return statistics.median(values) if values else float("nan")


def _overload(results: list[pc.Streamed]) -> dict[str, Any]:
    admitted = [r for r in results if r.status == 200]
    ttfts = [r.ttft_s for r in admitted if r.ttft_s is not None]
    refused = [r.latency_s for r in results if r.status == 429]
    return {
        "admitted": len(admitted),
        "refused_429": len(refused),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "ttft_max_s": max(ttfts, default=None),
        "met_gate": sum(t <= TTFT_GATE_S for t in ttfts),
        "refusal_max_ms": max(refused) * 1000 if refused else None,
    }


async def _model_phase(args: argparse.Namespace, procs: list[subprocess.Popen[Any]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="llamagate-bench-proxy-") as folder:
        server, _ = start_llama_server(_server_config(args), Path(folder), progress=ConsoleProgress())
        procs.append(server.proc)
        return await _measure_model(args, procs, server)


async def _measure_model(
    args: argparse.Namespace, procs: list[subprocess.Popen[Any]], server: BareServer
) -> dict[str, Any]:
    llama_url, secret = server.target.base_url, server.target.api_key or ""
    key, entry = new_key("bench", frozenset({"inference"}))
    proxy, proxy_url = _proxy(
        llama_url, secret, entry.key_id, entry.digest, args.loop, slots=4, max_concurrency=4, max_queue=0
    )
    procs.append(proxy)
    direct_req = pc.chat_request(llama_url, secret, args.max_tokens, True, ignore_eos=True)
    proxy_req = pc.chat_request(proxy_url, key, args.max_tokens, True, ignore_eos=True)
    await pc.streams(llama_url, direct_req, 1)  # warm-up
    direct: list[pc.Streamed] = []
    via: list[pc.Streamed] = []
    for _ in range(args.rounds):
        direct += await pc.streams(llama_url, direct_req, 4)
        via += await pc.streams(proxy_url, proxy_req, 4)
    tpot_direct, tpot_proxy = _tpot_median(direct), _tpot_median(via)
    single = await pc.streams(proxy_url, proxy_req, 1)
    over_direct = await pc.streams(llama_url, direct_req, 8)
    over_proxy = await pc.streams(proxy_url, proxy_req, 8)
    return {
        "identity": server.identity["served"],
        "threads": args.threads,
        "slots": 4,
        "ctx_per_slot": 2048,
        "tpot_direct_ms": tpot_direct * 1000,
        "tpot_proxy_ms": tpot_proxy * 1000,
        "tpot_ratio": tpot_proxy / tpot_direct,
        "single_ttft_s": single[0].ttft_s,
        "overload_direct": _overload(over_direct),
        "overload_proxy": _overload(over_proxy),
    }


def _verdict(results: dict[str, Any]) -> list[str]:
    lines = []
    fake, model = results.get("fake"), results.get("model")
    checks: list[tuple[str, float, float, bool]] = []
    if fake:
        checks += [
            (
                "added latency p50 (ms)",
                fake["added_p50_ms"],
                TARGETS["added_p50_ms"],
                fake["added_p50_ms"] <= 1.5,
            ),
            ("requests/s at c32", fake["rps_c32"], TARGETS["rps_c32"], fake["rps_c32"] >= 800),
            (
                "proxy CPU per SSE event (ms)",
                fake["cpu_ms_per_event"],
                0.05,
                fake["cpu_ms_per_event"] <= 0.05,
            ),
        ]
    if model:
        checks.append(("TPOT proxy/direct", model["tpot_ratio"], 1.03, model["tpot_ratio"] <= 1.03))
    accounts = results.get("accounts")
    if accounts:
        ratio, target = accounts["accounts_cpu_ratio"], TARGETS["accounts_cpu_ratio"]
        checks.append(("proxy CPU per request, store on / off", ratio, target, ratio <= target))
    for name, value, target, ok in checks:
        lines.append(f"{'PASS' if ok else 'FAIL'}  {name}: {value:.3f} (target {target})")
    return lines


def handle(args: argparse.Namespace) -> int:
    phases = {p.strip() for p in args.phases.split(",") if p.strip()}
    results: dict[str, Any] = {
        "command": cli.command_line("proxy"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": host_identity(),
        "proxy_loop": args.loop,
        "llamagate": llamagate_identity(),
    }
    with _processes() as procs:
        if "fake" in phases:
            print("phase fake: added latency, requests/s, CPU per SSE event ...", flush=True)
            results["fake"] = asyncio.run(_fake_phase(args, procs))
        if "model" in phases:
            print("phase model: TPOT through the proxy vs direct, overload ...", flush=True)
            results["model"] = asyncio.run(_model_phase(args, procs))
        if "accounts" in phases:
            print("phase accounts: proxy CPU per request, accounts store on vs off ...", flush=True)
            results["accounts"] = asyncio.run(_accounts_phase(args, procs))
        if "telemetry" in phases:
            print("phase telemetry: proxy CPU per request, OpenTelemetry on vs off ...", flush=True)
            results["telemetry"] = asyncio.run(_telemetry_phase(args, procs))
    print(json.dumps(results, indent=2, default=str))
    verdict = _verdict(results)
    print("\n".join(verdict))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0 if all(line.startswith("PASS") for line in verdict) else 1


def main() -> int:
    return cli.run("proxy", __doc__, add_arguments, handle)


if __name__ == "__main__":
    raise SystemExit(main())
