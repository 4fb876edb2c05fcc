"""``llamagate bench scaleout``: replicas behind real nginx, least-loaded with retries vs plain round robin,
or (``--compare limits``) tenant limits shared through Redis and PostgreSQL vs each replica's own.

Starts ``--replicas`` private llamagate daemons (1 slot each, no queue: a busy replica refuses at once
with 429), then, in alternating order for each round, puts a real nginx in front of them in two ways and
offers the same closed-loop load (by default twice the set's slots) for the same time:

  balanced     the shipped deploy/nginx/llamagate.conf with least_conn in place of its conversation hash
               (this benchmark's requests are one-turn: it measures balancing by load), and a request
               refused with 429/503 is tried on the next replica
  round-robin  the same file without the balancing line and without the retry rule

With ``--compare limits`` it starts two replica sets instead, both behind the shipped file (``balanced``),
and alternates between them:

  per-replica  each replica holds the tenant's limit (``max_concurrency: 1``) in its own memory, and its
               own SQLite ledger: the set admits N at once only because there are N replicas
  shared       the tenant's limit is N for the whole set, held as leases in the operator's Redis
               (``--redis-url``, as ``cluster.redis_url``), and the keys and the ledger are in a
               database of the run's own on the operator's PostgreSQL (``--store-url``, as ``store.url``)

The command starts no Redis and no PostgreSQL: it takes the operator's, and takes back what it wrote
there (``supervisor.bench.shared_state``: the run's tenant's keys, the run's database).

Same capacity either way, so the difference is what sharing costs: a lease round trip per request, its
renewals, and the ledger's writes over the network.

Clients are the benchmark's own closed-loop users: a refused user waits Retry-After (as the OpenAI SDK
does) before its next request. It reports, per mode, goodput (requests within the latency gates) per
second, completions, refusals seen by clients, latency distributions, and how often nginx passed a
request on. Exit 0 when the balanced set's goodput per second is at least the round-robin set's in every
round (``--compare limits``: when no request failed in either set, each completing or refused with a
status, and the shared set's replicas report ``llamagate_cluster_mode`` cluster), 1 otherwise, 2 on bad
usage.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from supervisor.bench import options
from supervisor.bench.client import Target
from supervisor.bench.launcher import (
    BENCH_TENANT,
    PrivateDaemon,
    deep_merge,
    llamagate_overrides,
    read_base_config,
    start_llamagate,
)
from supervisor.bench.loadgen import LoadSpec
from supervisor.bench.nginx import SHIPPED_CONF, Mode, start_nginx
from supervisor.bench.provenance import collect
from supervisor.bench.runner import RunSpec, run
from supervisor.bench.shared_state import (
    SharedState,
    check_redis_url,
    check_store_url,
    run_tenant,
    shared_state,
)
from supervisor.child.spawn import free_port
from supervisor.errors import UsageError
from supervisor.interrupts import interruptible
from supervisor.progress import ConsoleProgress

SCHEMA = "llamagate.bench.scaleout/1"
LIMIT_VARIANTS = ("per-replica", "shared")
# The nginx file each variant runs: the limit variants both run the shipped one.
MODE_OF: dict[str, Mode] = {
    "balanced": "least-conn",
    "round-robin": "round-robin",
    "per-replica": "least-conn",
    "shared": "least-conn",
}
ROUTING_VARIANTS = ("balanced", "round-robin")
VERDICTS = {
    "routing": "balanced goodput/s >= round-robin goodput/s in every round",
    "limits": "no request failed either way, and the shared set held its limits in Redis",
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "scaleout",
        help="replicas behind real nginx: least-loaded with retries vs round robin, goodput in one run",
        description="Start N one-slot llamagate replicas and compare, under the same closed-loop load, the "
        "shipped nginx configuration (least_conn, retry on 429/503) with plain round robin. Exit 0 when the "
        "shipped configuration's goodput per second is at least round robin's in every round.",
    )
    parser.add_argument("--config", type=Path, help="base llamagate config (default: the embedded default)")
    parser.add_argument("--replicas", type=int, default=3, help="llamagate replicas, 1 slot each (3)")
    parser.add_argument("--concurrency", type=int, help="closed-loop users (default: 2 x replicas)")
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds of load per mode and round (60)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="rounds of (balanced, round-robin) (1)")
    parser.add_argument("--ctx-per-slot", type=int, default=1024, help="each replica's context (1024)")
    parser.add_argument(
        "--compare",
        choices=("routing", "limits"),
        default="routing",
        help="routing: the shipped nginx vs round robin; limits: tenant limits shared through Redis and "
        "PostgreSQL vs each replica's own, both behind the shipped nginx (routing); limits needs "
        "--redis-url and --store-url",
    )
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        help="with --compare limits: your Redis (redis://, rediss:// or unix://) for the shared set's "
        "leases; written only under llamagate:{scaleout-RUN}:* (the run's own tenant), deleted at the end",
    )
    parser.add_argument(
        "--store-url",
        metavar="URL",
        help="with --compare limits: your PostgreSQL (postgresql://; the user needs CREATEDB) for the shared "
        "set's keys and ledger, in a database of the run's own (llamagate_scaleout_RUN), dropped at the end",
    )
    parser.add_argument(
        "--nginx-conf", type=Path, default=SHIPPED_CONF, help="the nginx site file to test (the shipped one)"
    )
    options.add_request_options(parser)
    options.add_gate_options(parser)
    options.add_output_options(parser)
    parser.set_defaults(func=interruptible(_handle), max_tokens=64)


def replica_overrides(tenant: str = BENCH_TENANT) -> tuple[dict[str, Any], str]:
    """Overrides shared by every replica: one tenant admitting 1 request with no queue, and one key valid
    on every replica (as a real replica set shares its ConfigMap and Secret). Each replica adds its port."""
    overrides, key = llamagate_overrides(admit=1, max_queue=0, queue_timeout_s=1.0, tenant=tenant)
    overrides["proxy"].pop("port", None)
    return overrides, key


def _summary_row(mode: str, round_no: int, summary: Any, passed_on: int, records: int) -> dict[str, Any]:
    return {
        "mode": mode,
        "round": round_no,
        "submitted": summary.submitted,
        "completed": summary.completed,
        "rejected": summary.rejected,
        "failed": summary.failed,
        "goodput": summary.goodput,
        "goodput_per_s": summary.goodput_per_s,
        "ttft_ms_p50": summary.ttft_ms.p50,
        "ttft_ms_p95": summary.ttft_ms.p95,
        "tpot_ms_p50": summary.tpot_ms.p50,
        "nginx_requests": records,
        "nginx_passed_on": passed_on,
    }


def _table(rows: list[dict[str, Any]]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    limits = any(r["mode"] in LIMIT_VARIANTS for r in rows)
    out = [
        "| round | mode | submitted | completed | refused (client saw 429/503) | goodput | goodput/s | "
        "TTFT p50 ms | TTFT p95 ms | passed on by nginx |" + (" cluster mode |" if limits else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if limits else ""),
    ]
    for r in rows:
        out.append(
            f"| {r['round']} | {r['mode']} | {r['submitted']} | {r['completed']} | {r['rejected']} | "
            f"{r['goodput']} | {f(r['goodput_per_s'], '.3f')} | {f(r['ttft_ms_p50'], '.0f')} | "
            f"{f(r['ttft_ms_p95'], '.0f')} | {r['nginx_passed_on']} of {r['nginx_requests']} |"
            + (f" {', '.join(r.get('cluster_mode') or ['?'])} |" if limits else "")
        )
    return "\n".join(out)


_CLUSTER_MODE = re.compile(r'^llamagate_cluster_mode\{mode="(\w+)"\} 1(?:\.0)?$', re.MULTILINE)


def cluster_modes(replicas: list[PrivateDaemon]) -> list[str]:
    """Each replica's ``llamagate_cluster_mode`` after a run: ``cluster`` where the limits were held in
    Redis throughout, ``off`` without ``cluster.redis_url``, ``refuse`` if Redis failed (``?``: unread)."""
    modes = []
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        for launch in replicas:
            try:
                r = client.get(f"{launch.base_url}/metrics", headers=launch.target.headers())
                found = _CLUSTER_MODE.search(r.text)
                modes.append(found.group(1) if r.status_code == 200 and found else "?")
            except httpx.HTTPError:
                modes.append("?")
    return modes


def verdict(rows: list[dict[str, Any]]) -> bool:
    """Balanced goodput/s >= round-robin goodput/s in every round; with the limit variants, no request
    failed in either (each completed or was refused with a status) and each set ran as configured: the
    shared one's replicas in cluster mode, the per-replica one's with no cluster."""
    if any(r["mode"] in LIMIT_VARIANTS for r in rows):
        expect = {"shared": "cluster", "per-replica": "off"}
        return all(
            r["failed"] == 0 and set(r.get("cluster_mode") or ["?"]) == {expect[r["mode"]]} for r in rows
        )
    by_round: dict[int, dict[str, float]] = {}
    for r in rows:
        by_round.setdefault(r["round"], {})[r["mode"]] = r["goodput_per_s"] or 0.0
    return all(m.get("balanced", 0.0) >= m.get("round-robin", 0.0) for m in by_round.values())


def check_shared_options(args: argparse.Namespace) -> None:
    """``--compare limits`` needs the operator's Redis and PostgreSQL; the other comparison takes neither."""
    given = [
        opt for opt, value in (("--redis-url", args.redis_url), ("--store-url", args.store_url)) if value
    ]
    if args.compare != "limits":
        if given:
            raise UsageError(f"{' and '.join(given)}: only with --compare limits")
        return
    missing = [opt for opt in ("--redis-url", "--store-url") if opt not in given]
    if missing:
        raise UsageError(
            f"--compare limits needs {' and '.join(f'{opt} URL' for opt in missing)}: the Redis and the "
            "PostgreSQL the shared set uses (the command starts neither)"
        )
    check_redis_url(args.redis_url)
    check_store_url(args.store_url)


def _handle(args: argparse.Namespace) -> int:
    check_shared_options(args)
    if args.replicas < 2:
        raise UsageError("--replicas: at least 2 (one replica has nothing to balance)")
    if args.rounds < 1 or args.duration <= 0:
        raise UsageError("--rounds must be >= 1 and --duration > 0")
    concurrency = args.concurrency or 2 * args.replicas
    progress = ConsoleProgress()
    out = options.out_dir(args, "scaleout")
    out.mkdir(parents=True, exist_ok=True)
    # limits: the tenant is named for the run, its namespace in the operator's Redis (shared_state).
    shared, key = replica_overrides(run_tenant() if args.compare == "limits" else BENCH_TENANT)
    base = read_base_config(args.config)
    per_replica = {"llama": {"slots": 1, "threads": 1, "ctx_per_slot": args.ctx_per_slot}}
    launched: list[PrivateDaemon] = []
    rows: list[dict[str, Any]] = []
    variants = LIMIT_VARIANTS if args.compare == "limits" else ROUTING_VARIANTS
    sets: dict[str, list[PrivateDaemon]] = {}
    state: SharedState | None = None
    with contextlib.ExitStack() as stack:
        try:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llamagate-scaleout-")))
            # routing: one set, fronted two ways; limits: one set per variant, each fronted the shipped way.
            set_overrides: dict[str, dict[str, Any]] = {"": {}}
            if args.compare == "limits":
                tenant = shared["tenants"][0]["name"]
                state = stack.enter_context(
                    shared_state(args.redis_url, args.store_url, tenant, args.replicas, progress)
                )
                # The same tenant, its limit now the whole set's: as many at once as there are replicas.
                whole_set = [{**shared["tenants"][0], "max_concurrency": args.replicas}]
                set_overrides = {"per-replica": {}, "shared": {**state.overrides, "tenants": whole_set}}
            for name, extra in set_overrides.items():
                sets[name] = []
                for i in range(args.replicas):
                    cfg = deep_merge(deep_merge(deep_merge(base, per_replica), shared), extra)
                    cfg = deep_merge(cfg, {"proxy": {"port": free_port()}})
                    folder = tmp / f"{name or 'replica'}{i}"
                    launched.append(start_llamagate(cfg, key, folder, progress=progress))
                    sets[name].append(launched[-1])
            for round_no in range(1, args.rounds + 1):
                order = list(variants) if round_no % 2 else list(reversed(variants))
                for variant in order:
                    replicas = sets[variant if args.compare == "limits" else ""]
                    addrs = [f"127.0.0.1:{launch.port}" for launch in replicas]
                    folder = tmp / f"nginx-{variant}-{round_no}"
                    nginx = start_nginx(addrs, folder, mode=MODE_OF[variant], site_conf=args.nginx_conf)
                    try:
                        spec = RunSpec(
                            target=Target(nginx.url, key),
                            load=LoadSpec(
                                "concurrency", concurrency, duration_s=args.duration, warmup=0, seed=args.seed
                            ),
                            prompts=options.prompts(args),
                            options=options.request_options(args),
                            gates=options.gates(args),
                        )
                        result = run(spec, out / f"round{round_no}-{variant}", progress)
                    finally:
                        nginx.stop()
                    access = nginx.access_log()
                    passed_on = sum(1 for r in access if len(r.tried) > 1)
                    row = _summary_row(variant, round_no, result.summary, passed_on, len(access))
                    row["cluster_mode"] = cluster_modes(replicas)
                    rows.append(row)
        finally:
            identities = [launch.identity for launch in launched]
            replica_pids = [launch.proc.pid for launch in launched]
            for launch in launched:
                launch.stop()
    ok = verdict(rows)
    report = {
        "schema": SCHEMA,
        "recorded_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "compare": args.compare,
        "replicas": args.replicas,
        "concurrency": concurrency,
        "duration_s": args.duration,
        "max_tokens": args.max_tokens,
        "rows": rows,
        "passed": ok,
        # What the command started (nginx is stopped after each run), to check that none outlives it.
        "pids": {"replicas": replica_pids},
        "shared_state": None if state is None else state.record,
        "provenance": collect(sys.argv, {}, {"replicas": identities[:1]}),
    }
    (out / "scaleout.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    print(_table(rows))
    print(f"verdict: {'PASS' if ok else 'FAIL'}: {VERDICTS[args.compare]}")
    print(f"results: {out}")
    for what in state.record["left_behind"] if state else []:
        print(f"warning: left behind: {what}", file=sys.stderr)
    return 0 if ok else 1
