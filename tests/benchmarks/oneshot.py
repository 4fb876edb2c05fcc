"""``python -m tests.benchmarks.oneshot``: what the disk tier writes for one-shot traffic (issue 56).

One-shot chat requests (``gen:TOKENS`` prompts: each a fresh document and a question, no shared prefix,
so every request is a conversation of its own that never comes back), ``--concurrency`` in flight, short
answers, against a private daemon (the embedded default unless ``--config``), started fresh with its own
states folder for every target and round: ``on`` (the disk tier as shipped: ``llama.state_disk_mib``
null) and ``off`` (``state_disk_mib: 0``), alternating (``--rounds``; every other round in reverse
order, the host being shared). ``--blocks N`` runs both targets' daemons at once instead, on the same
prompts, in N blocks taken in turn (ABBA), one serving while the other idles: a host whose speed
drifts between runs by more than the difference measured slows both alike. ``--baseline PATH`` runs
the ``on`` daemon from another checkout (its ``PYTHONPATH``): the code before a change, on the same
load.

Recorded per run: requests per second, the daemon's RSS (``psutil``, the daemon process alone) after a
warm-up and every ``--rss-every`` requests, and the tier's counters from ``/metrics`` (saves and bytes
written, restores and bytes read, states not written by reason). Prints a markdown table and, with
``--out``, the JSON record. It measures; it has no target. Exit status 0, or 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
    parser.add_argument(
        "--blocks",
        type=int,
        default=0,
        help="both targets' daemons at once, the requests in this many blocks taken in turn (0: one run"
        " after the other)",
    )
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


class _Runner:
    """One daemon's share of the load: its requests, timed, counted and its RSS sampled."""

    def __init__(
        self,
        daemon: PrivateDaemon,
        args: argparse.Namespace,
        seed: int,
        progress: ConsoleProgress | None = None,
    ) -> None:
        self.daemon, self.args, self.progress = daemon, args, progress
        self.prompts = load_prompts(f"gen:{args.prompt_tokens}", seed)
        self.url = daemon.target.server_root + "/v1/chat/completions"
        self.headers = daemon.target.headers()
        self.proc = psutil.Process(daemon.pid)
        self.rss: list[tuple[int, int]] = []
        self.done = self.failed = self.prompt_tokens = self.cached_tokens = 0
        self.child_ms = 0.0  # the child's own prompt and generation time, summed (its ``timings``)
        self.by_request: list[tuple[int, float]] = []  # (request, the child's ms)
        self.seconds = 0.0  # the measured phases' wall time
        self.phases: list[float] = []  # each measured phase's (interleaved: block's) wall time
        self.cpu = (0.0, 0.0)

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        body = {
            "messages": list(self.prompts.get(i).messages),
            "max_tokens": self.args.answer_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = await client.post(self.url, json=body, headers=self.headers)
        if r.status_code != 200:
            self.failed += 1
        else:
            answer = r.json()
            self.prompt_tokens += answer["usage"]["prompt_tokens"]
            details = answer["usage"].get("prompt_tokens_details") or {}
            self.cached_tokens += details.get("cached_tokens") or 0
            timings = answer.get("timings") or {}
            ms = (timings.get("prompt_ms") or 0.0) + (timings.get("predicted_ms") or 0.0)
            self.child_ms += ms
            self.by_request.append((i, round(ms, 1)))
        self.done += 1
        measured = self.done - WARMUP
        if measured > 0 and measured % self.args.rss_every == 0:
            self.rss.append((measured, self.proc.memory_info().rss))
            if self.progress is not None:
                self.progress.update("one-shot requests", self.done / (WARMUP + self.args.requests))

    async def phase(self, client: httpx.AsyncClient, indices: range, timed: bool = True) -> None:
        queue = list(reversed(indices))

        async def worker() -> None:
            while queue:
                await self._one(client, queue.pop())

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))
        if timed:
            self.phases.append(round(time.monotonic() - started, 2))
            self.seconds += self.phases[-1]

    async def warm_up(self, client: httpx.AsyncClient) -> None:
        await self.phase(client, range(WARMUP), timed=False)
        self.rss.append((0, self.proc.memory_info().rss))
        self.cpu = daemon_cpu_seconds(self.daemon)

    def result(self) -> dict[str, Any]:
        (daemon_after, child_after), (daemon_before, child_before) = daemon_cpu_seconds(self.daemon), self.cpu
        daemon_cpu, child_cpu = daemon_after - daemon_before, child_after - child_before
        if self.failed:
            raise RuntimeError(f"{self.failed} requests failed")
        n, total = self.args.requests, self.done
        return {
            "requests": n,
            "seconds": round(self.seconds, 2),
            "phase_seconds": self.phases,
            "requests_per_s": round(n / self.seconds, 3),
            "prompt_tokens_mean": round(self.prompt_tokens / total, 1),
            "cached_tokens_mean": round(self.cached_tokens / total, 1),
            # The share of the slots' time the child spent on the requests: what is left is time the
            # slots waited for the gateway (or the client) between them.
            "child_ms_mean": round(self.child_ms / total, 1),
            # CPU seconds per request, the daemon's own and its children's (the llama-server): on a host
            # with as many cores as the child has threads, the daemon's time is taken from the child's.
            # Interleaved, it includes what the daemon spent idle while the other one served (its probes).
            "daemon_cpu_ms": round(1000 * daemon_cpu / n, 2),
            "child_cpu_ms": round(1000 * child_cpu / n, 1),
            "child_ms": sorted(self.by_request),
            "rss": self.rss,
            "rss_growth_mib": round((self.rss[-1][1] - self.rss[0][1]) / 2**20, 2),
            "plateau": plateau(self.rss, self.args.plateau_after),
        }


def _client(args: argparse.Namespace) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.concurrency)
    return httpx.AsyncClient(timeout=600, limits=limits, trust_env=False)


async def _load(
    daemon: PrivateDaemon, args: argparse.Namespace, seed: int, progress: ConsoleProgress
) -> dict[str, Any]:
    runner = _Runner(daemon, args, seed, progress)
    async with _client(args) as client:
        await runner.warm_up(client)
        await runner.phase(client, range(WARMUP, WARMUP + args.requests))
    return runner.result()


async def _interleaved(
    daemons: dict[str, PrivateDaemon], args: argparse.Namespace, progress: ConsoleProgress
) -> dict[str, dict[str, Any]]:
    """Both targets on the same prompts, in ``--blocks`` blocks taken in turn (ABBA: the first target
    leads every other block), so the host's drift falls on both alike; one daemon idles while the
    other serves."""
    runners = {t: _Runner(d, args, 0) for t, d in daemons.items()}
    names = list(runners)
    async with _client(args) as client:
        for runner in runners.values():
            await runner.warm_up(client)
        size = -(-args.requests // args.blocks)
        for b, first in enumerate(range(WARMUP, WARMUP + args.requests, size)):
            block = range(first, min(first + size, WARMUP + args.requests))
            for t in names if b % 2 == 0 else names[::-1]:
                await runners[t].phase(client, block)
            progress.update("one-shot requests, interleaved", (b + 1) / args.blocks)
    return {t: r.result() for t, r in runners.items()}


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
    if args.blocks < 0 or (args.blocks and (sorted(targets) != ["off", "on"] or args.rounds != 1)):
        raise UsageError("--blocks: with both targets (on,off) and one round")
    base = read_base_config(args.config)
    progress = ConsoleProgress()
    loads: list[dict[str, float] | None] = [hostload.load_average()]
    runs: list[dict[str, Any]] = []
    started: list[PrivateDaemon] = []
    with contextlib.ExitStack() as stack:

        def start(target: str, round_: int) -> PrivateDaemon:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="llamagate-bench-oneshot-"))
            progress.update(f"{target} (round {round_ + 1}): starting", None)
            daemon = _start_target(base, target, args, Path(folder))
            stack.callback(daemon.stop)  # before its folder goes (last in, first out)
            started.append(daemon)
            return daemon

        if args.blocks:
            daemons = {t: start(t, 0) for t in targets}
            for target, run in asyncio.run(_interleaved(daemons, args, progress)).items():
                run["tier"] = _tier(daemons[target])
                runs.append(_finish(run, target, 0, args, progress))
        else:
            for round_ in range(args.rounds):
                for target in targets if round_ % 2 == 0 else targets[::-1]:
                    daemon = start(target, round_)
                    run = asyncio.run(_load(daemon, args, round_, progress))
                    run["tier"] = _tier(daemon)
                    daemon.stop()  # one child at a time: the next run has the host to itself
                    runs.append(_finish(run, target, round_, args, progress))
    results = {
        "command": cli.command_line("oneshot"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average": {"start": loads[0], "end": hostload.load_average()},
        "identity": started[0].identity,
        "runs": runs,
    }
    print(markdown(runs))
    print(f"load average: {results['load_average']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


def _start_target(base: dict[str, Any], target: str, args: argparse.Namespace, folder: Path) -> PrivateDaemon:
    overrides, key = llamagate_overrides(args.concurrency, max_queue=256, queue_timeout_s=600)
    if target == "off":
        overrides = deep_merge(overrides, {"llama": {"state_disk_mib": 0}})
    return _start(deep_merge(base, overrides), key, folder, args.baseline if target == "on" else None)


def _finish(
    run: dict[str, Any], target: str, round_: int, args: argparse.Namespace, progress: ConsoleProgress
) -> dict[str, Any]:
    baseline = args.baseline if target == "on" else None
    run.update(target=target if baseline is None else f"on ({baseline.name})", round=round_ + 1)
    if args.blocks:
        run["blocks"] = args.blocks
    progress.done(f"{run['target']} round {round_ + 1}", f"{run['requests_per_s']} req/s")
    run["load_average_after"] = hostload.load_average()
    print(json.dumps({k: v for k, v in run.items() if k not in ("rss", "child_ms")}), flush=True)
    return run


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
