"""``llamagate bench conversations``: do conversations stay on their cache? Against bare llama-server.

Starts each target in turn from the config (the embedded default unless ``--config``), runs the same
multi-turn workload against it (``supervisor.bench.conversations``), stops it, and writes
``conversations.json``, ``conversations.md`` and ``provenance.json`` into the result folder. Targets:
- ``bare-defaults``: llama-server with llamagate's argv but its own slot choice and cache settings
  (``--slot-prompt-similarity 0.1``, idle slots copied to the cache): what llamagate gave its child
  before conversations were placed;
- ``bare``: llama-server with exactly the argv llamagate gives its child;
- ``llamagate``: one daemon (the gateway chooses each turn's slot), one tenant admitting the child's
  slots and queueing the rest;
- ``replicas``: ``--replicas`` such daemons behind a real nginx running the shipped
  deploy/nginx/llamagate.conf (a conversation hashed to one replica);
- ``replicas-least-conn``: the same with ``least_conn`` in the hash's place (load first, no affinity).
Each starts with an empty cache. With ``--repeats`` above 1 every other round runs the targets in
reverse order. Exit 0 when every turn was answered, 1 when a target failed, 2 on bad usage, 130 when
interrupted (SIGTERM too: what was started is stopped first).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from supervisor.bench import conversations, hostload, options
from supervisor.bench.client import Target
from supervisor.bench.commands.run import write_provenance
from supervisor.bench.launcher import (
    Launched,
    PrivateDaemon,
    deep_merge,
    llamagate_overrides,
    read_base_config,
    start_llama_server,
    start_llamagate,
)
from supervisor.bench.nginx import Mode, Nginx, start_nginx
from supervisor.bench.provenance import collect
from supervisor.child.spawn import free_port
from supervisor.errors import UsageError
from supervisor.interrupts import interruptible
from supervisor.progress import ConsoleProgress, Progress

TARGETS = ("bare-defaults", "bare", "llamagate", "replicas", "replicas-least-conn")
DEFAULT_TARGETS = ("bare-defaults", "bare", "llamagate")
# llamagate's slot flags (supervisor/launch/flags.py), replaced by llama-server's defaults for
# ``bare-defaults``.
_OURS = {"-sps": 1, "--no-cache-idle-slots": 0}


def llama_server_defaults(argv: list[str]) -> list[str]:
    """``argv`` without llamagate's slot flags: llama-server's own slot choice and idle-slot copies."""
    out: list[str] = []
    skip = 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg in _OURS:
            skip = _OURS[arg]
        else:
            out.append(arg)
    return out


class _ReplicaSet:
    """``count`` daemons behind a private nginx running the shipped site file."""

    def __init__(self, daemons: list[PrivateDaemon], nginx: Nginx, key: str) -> None:
        self.daemons = daemons
        self.nginx = nginx
        self.target = Target(nginx.url, key)
        self.identity: dict[str, Any] = {"replicas": [d.identity for d in daemons], "nginx": nginx.prefix}

    def stop(self) -> None:
        try:
            self.nginx.stop()
        finally:
            for d in self.daemons:
                d.stop()


def _replicas(
    config: dict[str, object], count: int, mode: Mode, folder: Path, progress: Progress
) -> _ReplicaSet:
    overrides, key = _one_tenant(config)
    daemons: list[PrivateDaemon] = []
    try:
        for i in range(count):
            port = {"proxy": {"port": free_port()}}
            cfg = deep_merge(deep_merge(config, overrides), port)
            daemons.append(start_llamagate(cfg, key, folder / f"replica{i}", progress=progress))
        nginx = start_nginx([f"127.0.0.1:{d.port}" for d in daemons], folder / "nginx", mode=mode)
    except BaseException:
        for d in daemons:
            d.stop()
        raise
    return _ReplicaSet(daemons, nginx, key)


def _one_tenant(config: dict[str, object]) -> tuple[dict[str, Any], str]:
    """One tenant admitting the child's slots, queueing the rest (every conversation waits its turn)."""
    llama = config.get("llama")
    slots = llama.get("slots", 2) if isinstance(llama, dict) else 2
    return llamagate_overrides(slots, max_queue=256, queue_timeout_s=600)


def _start(
    name: str, config: dict[str, object], folder: Path, progress: Progress, replicas: int
) -> Launched | _ReplicaSet:
    if name == "llamagate":
        overrides, key = _one_tenant(config)
        return start_llamagate(deep_merge(config, overrides), key, folder, progress=progress)
    if name.startswith("replicas"):
        mode: Mode = "least-conn" if name == "replicas-least-conn" else "balanced"
        return _replicas(config, replicas, mode, folder, progress)
    edit = llama_server_defaults if name == "bare-defaults" else None
    server, _ = start_llama_server(config, folder, progress=progress, edit_argv=edit)
    return server


def _handle(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise UsageError(f"--targets: choose from {', '.join(TARGETS)} (got {args.targets!r})")
    for flag in ("conversations", "turns", "concurrency", "answer_tokens", "repeats", "replicas"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.system_tokens < 20 or args.user_tokens < 10:
        raise UsageError("--system-tokens must be >= 20 and --user-tokens >= 10")
    work = conversations.Workload(
        args.conversations,
        args.turns,
        args.concurrency,
        args.system_tokens,
        args.user_tokens,
        args.answer_tokens,
        args.seed,
    )
    config = read_base_config(args.config)
    out = options.out_dir(args, "conversations")
    progress = ConsoleProgress()
    # Written first: it holds the load average at the start (``hostload``); the launches join it at the end.
    write_provenance(out, collect(sys.argv, {}))
    results: list[conversations.TargetResult] = []
    launches: dict[str, object] = {}
    for round_ in range(args.repeats):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            launched = _start(name, config, out / "servers" / f"{name}-{round_}", progress, args.replicas)
            try:
                launches.setdefault(name, launched.identity)
                result = conversations.run(launched.target, name, work, progress)
            finally:
                launched.stop()
            result.target = name if args.repeats == 1 else f"{name} (round {round_ + 1})"
            results.append(result)
    provenance = json.loads((out / "provenance.json").read_text(encoding="utf-8"))
    write_provenance(out, {**provenance, "launched": launches})
    window = hostload.record_end(out)
    notes = [f"host: {hostload.describe(window)}"]
    text = conversations.markdown(results, work, notes)
    (out / "conversations.md").write_text(text, encoding="utf-8")
    record = {**conversations.to_dict(results, work), "load_average": window}
    (out / "conversations.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(text)
    print(f"results: {out}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "conversations",
        help="multi-turn chats: prompt tokens served from cache, llamagate against bare llama-server",
        description="C conversations of T turns at a concurrency, sharing a system prompt; per target the "
        "share of later turns' prompt tokens served from cache against the reusable maximum, the turns "
        "below 50 %%, the prompt tokens evaluated and the TTFT by turn.",
    )
    p.add_argument("--conversations", type=int, default=8, help="conversations, all open at once (8)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (4)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at most (4)")
    p.add_argument("--system-tokens", type=int, default=300, help="shared system prompt, ~tokens (300)")
    p.add_argument("--user-tokens", type=int, default=150, help="each user message, ~tokens (150)")
    p.add_argument("--answer-tokens", type=int, default=8, help="each answer, tokens (8)")
    p.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"comma-separated, of {', '.join(TARGETS)} ({','.join(DEFAULT_TARGETS)})",
    )
    p.add_argument(
        "--replicas", type=int, default=3, help="daemons behind nginx for the replicas targets (3)"
    )
    p.add_argument("--repeats", type=int, default=1, help="rounds; every other one in reverse order (1)")
    p.add_argument("--seed", type=int, default=1, help="the workload's text (1)")
    p.add_argument("--config", type=Path, help="llamagate config to start from (default: embedded)")
    options.add_output_options(p)
    p.set_defaults(func=interruptible(_handle))
