"""``python -m tests.benchmarks.startup``: what supervision costs at start and how fast it recovers.

In one run, interleaved so both see the same machine load:
- bare: the same llama-server argv and scrubbed environment, spawned directly, until /health 200;
- serve: ``llamagate serve`` as a fresh process until READY (all three gates passed), split into
  process start -> child spawned (Python, config, verification, budget) and child spawned -> READY;
- recovery: ``kill -9`` of the child of one running daemon until READY again.
READY is taken from the daemon's own log line (read live from its stderr, the same instant /readyz
turns 200); bare /health is probed the way the readiness gate probes, so neither side pays for an
outside poller competing for the CPU the child loads on.

Targets: serve at most 0.5 s over bare (medians); kill -9 to READY at most the restarted child's own
load time + 2 s (every run). Writes ``startup.json`` and ``startup.md`` with the identity of what was
measured; exit 0 when both targets hold, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import queue
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from supervisor.bench.launcher import PrivateDaemon
from supervisor.child.gate import HttpProbes, wait_health_200
from supervisor.child.spawn import RealOs, free_port
from supervisor.commands.config import add_config_argument
from supervisor.config.keys import ADMIN, new_key_config
from supervisor.config.load import config_to_dict, load_config, resolve_config_path
from supervisor.config.schema import Config
from supervisor.daemon.prepare import prepare
from supervisor.launch.flags import build_argv, build_env, new_secret
from supervisor.progress import ConsoleProgress
from tests.benchmarks import cli

TIMEOUT_S = 300.0
SERVE_OVER_BARE_TARGET_S = 0.5
KILL_OVER_LOAD_TARGET_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser)
    parser.add_argument("--runs", type=int, default=5, help="repetitions of each measurement (default 5)")
    parser.add_argument("--out", help="result folder (default bench-results/startup-<time>)")


async def _bare_once(spec_argv: list[str], port: int, workdir: Path) -> float:
    """Spawn to /health 200, probed the way the readiness gate probes (on each log line, else 50 ms)."""
    secret = new_secret()
    (workdir / "config").mkdir(parents=True, exist_ok=True)
    probes = HttpProbes()
    wake = asyncio.Event()
    started = time.monotonic()
    child = await RealOs().spawn(spec_argv, build_env(secret, workdir), workdir)

    async def pump() -> None:
        async for _ in child.output():
            wake.set()

    drain = asyncio.create_task(pump())
    try:
        await asyncio.wait_for(wait_health_200(probes, f"http://127.0.0.1:{port}", wake=wake), TIMEOUT_S)
        return time.monotonic() - started
    finally:
        child.send_signal(signal.SIGKILL)
        await child.wait()
        await drain
        await probes.aclose()


def _config(cfg: Config, kills: int = 0) -> tuple[dict[str, Any], str]:
    """The measured daemon's config (``cfg`` on a free port, JSON logs) and its admin key."""
    admin_key, entry = new_key_config(cfg.tenants[0].name, ADMIN)
    raw = config_to_dict(cfg)
    raw["proxy"]["port"] = free_port()
    raw["keys"] = [entry]
    # READY for 1 s counts as stable, so every kill below meets the first (shortest) backoff.
    raw["supervision"]["stable_after_s"] = 1.0
    # Deliberate kills are not a crash loop: leave room for all of them within the restart window.
    raw["supervision"]["max_restarts"] = max(raw["supervision"]["max_restarts"], kills + 1)
    raw["logging"] = {"format": "json", "level": "INFO", "access_log": False}
    return raw, admin_key


class _Daemon:
    """A private daemon whose JSON log lines are read as they come (``log_pipe``): READY is seen the
    moment the daemon logs it (the same instant /readyz turns 200), with no polling load on the 2 cores
    the child is loading on."""

    def __init__(self, cfg: Config, folder: Path, kills: int = 0) -> None:
        config, key = _config(cfg, kills)
        self.daemon = PrivateDaemon.start(config, folder, {"admin": key}, log_pipe=True)
        self.records: queue.Queue[tuple[float, dict[str, Any]]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        stderr = self.daemon.proc.stderr
        assert stderr is not None
        for line in stderr:
            with contextlib.suppress(ValueError):
                self.records.put((time.monotonic(), json.loads(line)))
        self.records.put((time.monotonic(), {"msg": "<exited>"}))

    def wait_log(self, pred: Any, deadline_s: float = TIMEOUT_S) -> tuple[float, dict[str, Any]]:
        end = time.monotonic() + deadline_s
        while (left := end - time.monotonic()) > 0:
            try:
                at, rec = self.records.get(timeout=left)
            except queue.Empty:
                break
            if rec.get("msg") == "<exited>":
                raise RuntimeError("llamagate serve exited before the expected log line")
            if pred(rec):
                return at, rec
        raise RuntimeError(f"no matching log line within {deadline_s} s")

    def stop(self) -> None:
        self.daemon.stop(60)


def _is_ready(rec: dict[str, Any], after_generation: int = 0) -> bool:
    return bool(rec.get("msg") == "llama-server READY" and int(rec.get("generation", 0)) > after_generation)


def _serve_once(cfg: Config, folder: Path) -> dict[str, float]:
    daemon = _Daemon(cfg, folder)
    started = daemon.daemon.started_at
    try:
        spawned, _ = daemon.wait_log(lambda rec: rec.get("msg") == "starting llama-server")
        ready, rec = daemon.wait_log(_is_ready)
        _, body = daemon.daemon.readyz()
        if not body.get("ready"):
            raise RuntimeError(f"logged READY but /readyz says {body}")
    finally:
        daemon.stop()
    return {"total_s": ready - started, "to_spawn_s": spawned - started, "load_s": float(rec["load_seconds"])}


def _kill_runs(cfg: Config, folder: Path, runs: int) -> list[dict[str, float]]:
    daemon = _Daemon(cfg, folder, kills=runs)
    out = []
    try:
        daemon.wait_log(_is_ready)
        for _ in range(runs):
            # Wait (polling, with a deadline) until the child counts as stable again.
            body = daemon.daemon.wait_for(
                lambda _, body: (body.get("ready_for_s") or 0) >= 1.2, "a stable child", TIMEOUT_S
            )
            generation = body["generation"]
            pid = daemon.daemon.child_pid
            assert pid is not None
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            back, rec = daemon.wait_log(lambda r, g=generation: _is_ready(r, g))
            out.append({"kill_to_ready_s": back - killed, "load_s": float(rec["load_seconds"])})
    finally:
        daemon.stop()
    return out


def _dist(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def handle(args: argparse.Namespace) -> int:
    cfg = load_config(resolve_config_path(args.config))
    prepared = prepare(cfg, progress=ConsoleProgress())  # builds/fetches on first use; warms the hash cache
    out = Path(args.out or f"bench-results/startup-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    bare: list[float] = []
    serve: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="llamagate-bench-") as tmp:
        for i in range(args.runs):
            port = free_port()
            argv = build_argv(replace(prepared.spec, port=port))
            bare.append(asyncio.run(_bare_once(argv, port, Path(tmp) / f"bare{i}")))
            serve.append(_serve_once(cfg, Path(tmp) / f"serve{i}"))
            print(
                f"run {i + 1}/{args.runs}: bare {bare[-1]:.3f} s, serve {serve[-1]['total_s']:.3f} s",
                flush=True,
            )
        kills = _kill_runs(cfg, Path(tmp) / "kill", args.runs)
    result = _summarize(bare, serve, kills, prepared.identity)
    (out / "startup.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "startup.md").write_text(_markdown(result))
    print(_markdown(result))
    print(f"results: {out}")
    return (
        0
        if result["targets"]["serve_over_bare"]["pass"] and result["targets"]["kill_to_ready"]["pass"]
        else 1
    )


def _summarize(
    bare: list[float],
    serve: list[dict[str, float]],
    kills: list[dict[str, float]],
    identity: dict[str, object],
) -> dict[str, Any]:
    bare_d = _dist(bare)
    total = _dist([s["total_s"] for s in serve])
    supervised = _dist([s["load_s"] for s in serve])
    kill = _dist([k["kill_to_ready_s"] for k in kills])
    over = total["median"] - bare_d["median"]
    over_load = [k["kill_to_ready_s"] - k["load_s"] for k in kills]
    return {
        "schema": "llamagate.bench.startup/1",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": cli.command_line("startup"),
        "bare_spawn_to_health_s": bare_d,
        "serve_start_to_ready_s": total,
        "serve_start_to_child_spawn_s": _dist([s["to_spawn_s"] for s in serve]),
        "serve_child_spawn_to_ready_s": supervised,
        "kill9_to_ready_s": kill,
        "raw": {"bare": bare, "serve": serve, "kill": kills},
        "targets": {
            "serve_over_bare": {
                "median_s": over,
                "supervised_over_bare_s": supervised["median"] - bare_d["median"],
                "target_s": SERVE_OVER_BARE_TARGET_S,
                "pass": over <= SERVE_OVER_BARE_TARGET_S,
            },
            # Per kill: time to READY minus that restart's own load (spawn -> READY, gates included),
            # i.e. what supervision adds: noticing the exit, the backoff, the spawn. Robust to a
            # noisy machine, where load times themselves vary by seconds.
            "kill_to_ready": {
                "median_s": kill["median"],
                "max_over_load_s": max(over_load),
                "target_s": KILL_OVER_LOAD_TARGET_S,
                "pass": max(over_load) <= KILL_OVER_LOAD_TARGET_S,
            },
        },
        "identity": identity,
    }


def _markdown(r: dict[str, Any]) -> str:
    def row(name: str, d: dict[str, float]) -> str:
        return f"| {name} | {d['median']:.3f} | {d['min']:.3f} | {d['max']:.3f} | {d['n']} |"

    t = r["targets"]
    ident = r["identity"]
    serving, model, binary, host = ident["serving"], ident["model"], ident["binary"], ident["host"]
    build = ident["llama_cpp"]
    verdict = {True: "PASS", False: "FAIL"}
    mem_gib = int(host["memory_total_bytes"]) / 2**30
    return "\n".join(
        [
            f"Measured {r['date']} with `{r['command']}`.",
            "",
            "| seconds | median | min | max | n |",
            "|---|---:|---:|---:|---:|",
            row("bare llama-server: spawn -> /health 200", r["bare_spawn_to_health_s"]),
            row("`llamagate serve`: process start -> READY (/readyz 200)", r["serve_start_to_ready_s"]),
            row("  of which: process start -> child spawned", r["serve_start_to_child_spawn_s"]),
            row("  of which: child spawned -> READY (3 gates)", r["serve_child_spawn_to_ready_s"]),
            row("`kill -9` of the child -> READY again", r["kill9_to_ready_s"]),
            "",
            f"- serve over bare (medians): {t['serve_over_bare']['median_s']:+.3f} s, target <= "
            f"{t['serve_over_bare']['target_s']} s: **{verdict[t['serve_over_bare']['pass']]}** "
            f"(supervised part only: {t['serve_over_bare']['supervised_over_bare_s']:+.3f} s)",
            f"- kill -9 to READY minus that restart's load (worst run): "
            f"{t['kill_to_ready']['max_over_load_s']:.3f} s,"
            f" target <= {t['kill_to_ready']['target_s']} s: **{verdict[t['kill_to_ready']['pass']]}**",
            "",
            f"Identity: llama.cpp {build.get('commit') or build.get('version')}, binary sha256 "
            f"`{binary['sha256']}`, model `{Path(str(model['path'])).name}` sha256 `{model['sha256']}`, "
            f"{serving['slots']} slots x {serving['ctx_per_slot']}, threads {serving['threads']}/"
            f"{serving['threads_batch']}; host {host['cpu_model']}, {host['cpu_physical']} cores "
            f"({host['cpu_logical']} logical), {mem_gib:.1f} GiB, {host['os']}, "
            f"kernel {host['kernel']}, Python {host['python']}.",
            "",
        ]
    )


def main() -> int:
    return cli.run("startup", __doc__, add_arguments, handle)


if __name__ == "__main__":
    raise SystemExit(main())
