"""``python -m tests.benchmarks.oneshot``: what the disk tier writes for one-shot traffic (issue 56).

One-shot chat requests (``gen:TOKENS`` prompts: each a fresh document and a question, no shared prefix,
so every request is a conversation of its own that never comes back), ``--concurrency`` in flight, short
answers, against a private daemon (the embedded default unless ``--config``), started fresh with its own
states folder for every target and round: ``on`` (the disk tier as shipped: ``llama.state_disk_mib``
null) and ``off`` (``state_disk_mib: 0``), alternating (``--rounds``; every other round in reverse
order, the host being shared). ``--baseline PATH`` runs the ``on`` daemon from another checkout (its
``PYTHONPATH``): the code before a change, on the same load.

Recorded per run: requests per second, the daemon's RSS (``psutil``, the daemon process alone) after a
warm-up and every ``--rss-every`` requests, and the tier's counters from ``/metrics`` (saves and bytes
written, restores and bytes read, states not written by reason). Prints a markdown table and, with
``--out``, the JSON record. It measures; it has no target. Exit status 0, or 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from supervisor.bench import hostload
from supervisor.bench.launcher import (
    PrivateDaemon,
    deep_merge,
    llamagate_overrides,
    read_base_config,
    validate,
)
from supervisor.bench.prompts import load_prompts
from supervisor.errors import UsageError
from supervisor.progress import ConsoleProgress
from tests.benchmarks import cli
from tests.benchmarks.proxycost import daemon_cpu_seconds

_TIER = "llamagate_conversation_state_"
WARMUP = 8  # requests before the first RSS sample: the daemon's first allocations are not growth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="base llamagate config (default: the embedded default)")
    parser.add_argument("--requests", type=int, default=400, help="one-shot requests per run (400)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (4)")
    parser.add_argument("--prompt-tokens", type=int, default=400, help="each prompt, ~tokens (400)")
    parser.add_argument("--answer-tokens", type=int, default=8, help="each answer, tokens (8)")
    parser.add_argument("--targets", default="on,off", help="on, off, or both in order (on,off)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds; every other one reversed (1)")
    parser.add_argument("--rss-every", type=int, default=100, help="requests between RSS samples (100)")
    parser.add_argument(
        "--plateau-after",
        type=int,
        default=2000,
        help="report the RSS after this many requests against the highest sample after it (2000)",
    )
    parser.add_argument("--baseline", type=Path, help="run the 'on' daemon from this checkout instead")
    parser.add_argument("--out", type=Path, help="write the full results as JSON here")


def _start(config: dict[str, Any], key: str, folder: Path, pythonpath: Path | None) -> PrivateDaemon:
    config = deep_merge({"llama": {"state_dir": str(folder / "states")}}, config)
    validate(config, "bench config")
    # ``python -m supervisor`` puts the working directory (this checkout, when the benchmark runs from it)
    # ahead of PYTHONPATH: without PYTHONSAFEPATH the baseline daemon ran this checkout's code.
    env = {"PYTHONPATH": str(pythonpath), "PYTHONSAFEPATH": "1"} if pythonpath is not None else None
    daemon = PrivateDaemon.start(config, folder, {"admin": key}, env=env)
    try:
        daemon.wait_ready()
        daemon.identity = daemon.admin_identity()
    except BaseException:
        daemon.stop()
        raise
    return daemon


def _tier(daemon: PrivateDaemon) -> dict[str, float]:
    r = httpx.get(daemon.base_url + "/metrics", headers=daemon.target.headers(), timeout=30, trust_env=False)
    r.raise_for_status()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        if family.name.startswith(_TIER) and family.type == "counter":
            for s in family.samples:
                if s.name.endswith("_total"):
                    name = family.name.removeprefix(_TIER)
                    if "reason" in s.labels:
                        name += ":" + s.labels["reason"]
                    out[name] = out.get(name, 0.0) + s.value
    return out


async def _load(
    daemon: PrivateDaemon, args: argparse.Namespace, seed: int, progress: ConsoleProgress
) -> dict[str, Any]:
    prompts = load_prompts(f"gen:{args.prompt_tokens}", seed)
    url = daemon.target.server_root + "/v1/chat/completions"
    headers = daemon.target.headers()
    proc = psutil.Process(daemon.pid)
    total = WARMUP + args.requests
    rss: list[tuple[int, int]] = []
    done = failed = prompt_tokens = cached_tokens = 0
    child_ms = 0.0  # the child's own prompt and generation time, summed over requests (its ``timings``)
    by_request: list[tuple[int, float]] = []  # (request, the child's ms)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:

        async def worker(indices: list[int]) -> None:
            nonlocal done, failed, prompt_tokens, cached_tokens, child_ms
            while indices:
                i = indices.pop()
                body = {
                    "messages": list(prompts.get(i).messages),
                    "max_tokens": args.answer_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                r = await client.post(url, json=body, headers=headers)
                if r.status_code != 200:
                    failed += 1
                else:
                    answer = r.json()
                    prompt_tokens += answer["usage"]["prompt_tokens"]
                    details = answer["usage"].get("prompt_tokens_details") or {}
                    cached_tokens += details.get("cached_tokens") or 0
                    timings = answer.get("timings") or {}
                    ms = (timings.get("prompt_ms") or 0.0) + (timings.get("predicted_ms") or 0.0)
                    child_ms += ms
                    by_request.append((i, round(ms, 1)))
                done += 1
                measured = done - WARMUP
                if measured > 0 and measured % args.rss_every == 0:
                    rss.append((measured, proc.memory_info().rss))
                    progress.update("one-shot requests", done / total)

        async def phase(indices: range) -> None:
            queue = list(reversed(indices))
            await asyncio.gather(*(worker(queue) for _ in range(args.concurrency)))

        await phase(range(WARMUP))
        rss.append((0, proc.memory_info().rss))
        cpu = daemon_cpu_seconds(daemon)
        started = time.monotonic()
        await phase(range(WARMUP, total))
    seconds = time.monotonic() - started
    (daemon_after, child_after), (daemon_before, child_before) = daemon_cpu_seconds(daemon), cpu
    daemon_cpu, child_cpu = daemon_after - daemon_before, child_after - child_before
    if failed:
        raise RuntimeError(f"{failed} requests failed")
    return {
        "requests": args.requests,
        "seconds": round(seconds, 2),
        "requests_per_s": round(args.requests / seconds, 3),
        "prompt_tokens_mean": round(prompt_tokens / total, 1),
        "cached_tokens_mean": round(cached_tokens / total, 1),
        # The share of the slots' time the child spent on the requests: what is left is time the slots
        # waited for the gateway (or the client) between them.
        "child_ms_mean": round(child_ms / total, 1),
        # CPU seconds per request, the daemon's own and its children's (the llama-server): on a host with
        # as many cores as the child has threads, the daemon's time is taken from the child's.
        "daemon_cpu_ms": round(1000 * daemon_cpu / args.requests, 2),
        "child_cpu_ms": round(1000 * child_cpu / args.requests, 1),
        "child_ms": sorted(by_request),
        "rss": rss,
        "rss_growth_mib": round((rss[-1][1] - rss[0][1]) / 2**20, 2),
        "plateau": plateau(rss, args.plateau_after),
    }


def plateau(rss: list[tuple[int, int]], after: int) -> dict[str, float] | None:
    """The RSS once ``after`` requests were served against the highest sample after it (issue 56: "RSS
    flat after the first 2,000, within 5 %"); None when the run was not longer than ``after``."""
    at = [b for n, b in rss if n >= after]
    if len(at) < 2:
        return None
    start, highest = at[0], max(at[1:])
    return {
        "after": after,
        "rss_mib": round(start / 2**20, 2),
        "highest_mib": round(highest / 2**20, 2),
        "growth_pct": round(100 * (highest - start) / start, 2),
    }


def handle(args: argparse.Namespace) -> int:
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not targets or any(t not in ("on", "off") for t in targets):
        raise UsageError("--targets: on, off, or on,off")
    if min(args.requests, args.concurrency, args.rounds, args.rss_every) < 1:
        raise UsageError("--requests, --concurrency, --rounds and --rss-every must be >= 1")
    base = read_base_config(args.config)
    progress = ConsoleProgress()
    loads: list[dict[str, float] | None] = [hostload.load_average()]
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for target in targets if round_ % 2 == 0 else targets[::-1]:
            overrides, key = llamagate_overrides(args.concurrency, max_queue=256, queue_timeout_s=600)
            if target == "off":
                overrides = deep_merge(overrides, {"llama": {"state_disk_mib": 0}})
            baseline = args.baseline if target == "on" else None
            with tempfile.TemporaryDirectory(prefix="llamagate-bench-oneshot-") as folder:
                progress.update(f"{target} (round {round_ + 1}): starting", None)
                daemon = _start(deep_merge(base, overrides), key, Path(folder), baseline)
                try:
                    run = asyncio.run(_load(daemon, args, round_, progress))
                    run["tier"] = _tier(daemon)
                finally:
                    daemon.stop()
            run.update(target=target if baseline is None else f"on ({baseline.name})", round=round_ + 1)
            progress.done(f"{run['target']} round {round_ + 1}", f"{run['requests_per_s']} req/s")
            run["load_average_after"] = hostload.load_average()
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k not in ("rss", "child_ms")}), flush=True)
    results = {
        "command": cli.command_line("oneshot"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average": {"start": loads[0], "end": hostload.load_average()},
        "identity": daemon.identity,
        "runs": runs,
    }
    print(markdown(runs))
    print(f"load average: {results['load_average']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| run | req/s | RSS growth (MiB) | RSS plateau | saves | written (MB) | restores | read (MB) "
        "| not written |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        t = r["tier"]
        skipped = sum(v for k, v in t.items() if k.startswith("writes_skipped"))
        p = r.get("plateau")
        flat = (
            f"{p['rss_mib']:.1f} MiB at {p['after']:,}, at most {p['highest_mib']:.1f} after "
            f"({p['growth_pct']:+.1f} %)"
            if p
            else "-"
        )
        lines.append(
            f"| {r['target']} (round {r['round']}) | {r['requests_per_s']:.3f} | {r['rss_growth_mib']:+.1f} "
            f"| {flat} | {t.get('saves', 0):.0f} | {t.get('save_bytes', 0) / 1e6:,.0f} "
            f"| {t.get('restores', 0):.0f} | {t.get('restore_bytes', 0) / 1e6:,.0f} | {skipped:.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return cli.run("oneshot", __doc__, add_arguments, handle)


if __name__ == "__main__":
    raise SystemExit(main())
