"""``llamagate bench conversations``: do conversations stay on their cache? Against bare llama-server.

Starts each target in turn from the config (the embedded default unless ``--config``), runs the same
multi-turn workload against it (``supervisor.bench.conversations``), stops it, and writes
``conversations.json``, ``conversations.md`` and ``provenance.json`` into the result folder. Targets:
- ``bare-defaults``: llama-server with llamagate's argv but its own slot choice and cache settings
  (``--slot-prompt-similarity 0.1``, idle slots copied to the cache): what llamagate gave its child
  before conversations were placed;
- ``bare``: llama-server with exactly the argv llamagate gives its child;
- ``llamagate``: one daemon (the gateway chooses each turn's slot), one tenant admitting the child's
  slots and queueing the rest; conversation states on disk (the disk tier, ``llama.state_disk_mib``) in
  the run's own folder, empty at the start;
- ``llamagate-nodisk``: the same with the disk tier off (``llama.state_disk_mib: 0``);
- ``replicas``: ``--replicas`` such daemons behind a real nginx running the shipped
  deploy/nginx/llamagate.conf (a conversation hashed to one replica);
- ``replicas-least-conn``: the same with ``least_conn`` in the hash's place (load first, no affinity);
- ``replicas-shared``: ``replicas`` with one states folder for all of them (``llama.state_dir``; the
  replicas serve one identity, so they use one folder of it), where ``replicas`` gives each its own.
Each starts with an empty cache. With ``--repeats`` above 1 every other round runs the targets in
reverse order. ``--across`` puts an event between turn ``--event-after`` and the next of every
conversation: ``reload`` (SIGHUP with llama.threads changed: a new child of the same identity),
``unload`` (the model is on_demand with a 2 s idle_unload_s: the run waits until it is unloaded, and the
next turn loads it), ``restart`` (the daemon stopped and started again on the same states folder and port),
``kill`` (the child SIGKILLed: the supervisor restarts it); bare llama-server is stopped and started for
any of them (its states are lost: the comparison point). ``handover`` is for the replicas targets: the
replica that served the most conversations (nginx's access log names each turn's conversation and
replica) is stopped (a planned stop: its slots' states are saved), nginx moves its conversations to the
next replica on the hash ring, and the result says how much of their reusable maximum those moved
conversations got from then on, against the ones that stayed. Exit 0 when every turn was answered, 1 when a
target failed, 2 on bad usage, 130 when interrupted (SIGTERM too: what was started is stopped first).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from proxy.conversations.key import conversation_id
from supervisor.bench import conversations, hostload, options
from supervisor.bench.client import Target
from supervisor.bench.commands.run import write_provenance
from supervisor.bench.conversations import ConversationFailed
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

TARGETS = (
    "bare-defaults",
    "bare",
    "llamagate",
    "llamagate-nodisk",
    "replicas",
    "replicas-least-conn",
    "replicas-shared",
)
EVENTS = ("reload", "unload", "restart", "kill", "handover")
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
        self.stopped: list[PrivateDaemon] = []  # left the ring (``handover``)

    def running(self) -> list[PrivateDaemon]:
        return [d for d in self.daemons if d not in self.stopped]

    def handover(self, work: conversations.Workload, turns_played: int) -> list[int]:
        """Stop the replica that served the most conversations; the conversations it served."""
        expected = work.conversations * turns_played
        _until(lambda: len(self.nginx.access_log()) >= expected, "nginx's access log of every turn", 30.0)
        ids = [conversation_id([], {"messages": m}) for m in conversations.openings(work)]
        where: dict[str, str] = {}
        for record in self.nginx.access_log():
            if record.status == 200 and record.conversation:
                where[record.conversation] = record.tried[-1]
        served: dict[str, list[int]] = {}
        for c, cid in enumerate(ids):
            if cid is None or cid not in where:
                raise ConversationFailed(f"nginx's access log does not say where conversation {c} went")
            served.setdefault(where[cid], []).append(c)
        addr, moved = max(served.items(), key=lambda kv: len(kv[1]))
        (leaving,) = [d for d in self.daemons if f"127.0.0.1:{d.port}" == addr]
        leaving.stop()  # a planned stop: the daemon saves its slots' states first
        self.stopped.append(leaving)
        return moved

    def stop(self) -> None:
        try:
            self.nginx.stop()
        finally:
            for d in self.running():
                d.stop()


def _replicas(
    config: dict[str, object], count: int, mode: Mode, folder: Path, progress: Progress, shared: bool
) -> _ReplicaSet:
    overrides, key = _one_tenant(config)
    if shared:  # one folder for all (one identity: one folder of it inside), else each its own
        overrides = deep_merge(overrides, {"llama": {"state_dir": str(folder / "shared-states")}})
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
    if name in ("llamagate", "llamagate-nodisk"):
        overrides, key = _one_tenant(config)
        if name == "llamagate-nodisk":
            overrides = deep_merge(overrides, {"llama": {"state_disk_mib": 0}})
        return start_llamagate(deep_merge(config, overrides), key, folder, progress=progress)
    if name.startswith("replicas"):
        mode: Mode = "least-conn" if name == "replicas-least-conn" else "balanced"
        return _replicas(config, replicas, mode, folder, progress, shared=name == "replicas-shared")
    edit = llama_server_defaults if name == "bare-defaults" else None
    server, _ = start_llama_server(config, folder, progress=progress, edit_argv=edit)
    return server


class _Across:
    """The event between two turns (``--across``) for one launched target; ``stop`` stops whatever runs
    at the end (a restart replaces the daemon)."""

    def __init__(
        self,
        kind: str,
        launched: Launched | _ReplicaSet,
        config: dict[str, object],
        folder: Path,
        progress: Progress,
        edit: Callable[[list[str]], list[str]] | None,
    ) -> None:
        self.kind, self.launched, self.config = kind, launched, config
        self.folder, self.progress, self.edit = folder, progress, edit
        self.moved: list[int] | None = None  # ``handover``: the conversations that moved

    def act(self, work: conversations.Workload, turns_played: int) -> Target:
        launched = self.launched
        if isinstance(launched, PrivateDaemon):
            return self._daemon(launched)
        if isinstance(launched, _ReplicaSet):
            if self.kind != "handover":
                raise UsageError("--across for the replicas targets is handover")
            self.moved = launched.handover(work, turns_played)
            return launched.target
        # Bare llama-server: every event is a new process (its slots and RAM cache start empty).
        launched.stop()
        self.launched, _ = start_llama_server(
            self.config, self.folder / "after", progress=self.progress, edit_argv=self.edit
        )
        return self.launched.target

    def _daemon(self, d: PrivateDaemon) -> Target:
        generation = d.readyz()[1].get("generation", 0)
        if self.kind == "reload":
            llama = d.config.get("llama") or {}
            d.write_config({"llama": {"threads": 2 if llama.get("threads") == 1 else 1}})
            d.signal(signal.SIGHUP)
        elif self.kind == "kill":
            pid = d.child_pid
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        elif self.kind == "unload":
            _until(lambda: not _loaded(d), "the idle unload", 120.0)
            return d.target
        else:  # restart: the same config (states folder, port), a new daemon
            d.stop()
            self.launched = d = start_llamagate(
                d.config, d.keys["admin"], self.folder / "restarted", progress=self.progress
            )
            return d.target
        d.wait_for(
            lambda code, body: (
                code == 200 and body.get("ready") is True and body.get("generation", 0) > generation
            ),
            f"a new child after the {self.kind}",
        )
        return d.target

    def stop(self) -> None:
        self.launched.stop()


_TIER = "llamagate_conversation_state_"


def _tier_figures(launched: object) -> dict[str, float] | None:
    """A daemon's disk tier figures, summed over tenants, from its /metrics; a replica set's summed over
    the replicas still running (None for another target)."""
    if isinstance(launched, _ReplicaSet):
        summed: dict[str, float] = {}
        for d in launched.running():
            for name, value in (_tier_figures(d) or {}).items():
                summed[name] = summed.get(name, 0.0) + value
        return summed
    if not isinstance(launched, PrivateDaemon):
        return None
    r = httpx.get(
        launched.base_url + "/metrics", headers=launched.target.headers(), timeout=30, trust_env=False
    )
    r.raise_for_status()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        if family.name.startswith(_TIER) and family.type == "counter":
            name = family.name.removeprefix(_TIER)
            out[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name == "llamagate_prompt_tokens_by_source":
            for s in family.samples:
                if s.name.endswith("_total"):
                    key = "prompt_tokens_" + s.labels["source"]
                    out[key] = out.get(key, 0.0) + s.value
    return out


def _loaded(d: PrivateDaemon) -> bool:
    models = d.admin_identity().get("models") or {}
    return any(isinstance(m, dict) and m.get("loaded") for m in models.values())


def _until(check: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise ConversationFailed(f"timed out waiting for {what}")
        time.sleep(0.2)


def _on_demand(config: dict[str, object]) -> dict[str, object]:
    """``config`` with its model on_demand and a 2 s idle_unload_s (preloaded): for ``--across unload``."""
    llama = config.get("llama")
    model = llama.get("model") if isinstance(llama, dict) else None
    if not isinstance(model, dict):
        model = {}
    entry: dict[str, object] = {
        "name": model.get("alias", "smollm2-135m-instruct"),
        "residency": "on_demand",
        "idle_unload_s": 2,
        "preload": True,
    }
    if model.get("path"):
        entry.update(path=model["path"], sha256=model.get("sha256"))
    return deep_merge(config, {"models": [entry]})


def _handle(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise UsageError(f"--targets: choose from {', '.join(TARGETS)} (got {args.targets!r})")
    for flag in ("conversations", "turns", "concurrency", "answer_tokens", "repeats", "replicas"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.across is not None and not 1 <= args.event_after < args.turns:
        raise UsageError("--event-after must be at least 1 and less than --turns")
    replicas = [n for n in names if n.startswith("replicas")]
    if args.across == "handover" and replicas != names:
        raise UsageError("--across handover: only the replicas targets (replicas, replicas-shared, ...)")
    if args.across is not None and args.across != "handover" and replicas:
        raise UsageError(f"--across {args.across}: not for the replicas targets (they take handover)")
    if args.across == "handover" and args.replicas < 2:
        raise UsageError("--across handover needs --replicas 2 or more")
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
    if args.across == "unload":
        config = _on_demand(config)
    out = options.out_dir(args, "conversations")
    progress = ConsoleProgress()
    # Written first: it holds the load average at the start (``hostload``); the launches join it at the end.
    write_provenance(out, collect(sys.argv, {}))
    results: list[conversations.TargetResult] = []
    launches: dict[str, object] = {}
    for round_ in range(args.repeats):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            folder = out / "servers" / f"{name}-{round_}"
            launched = _start(name, config, folder, progress, args.replicas)
            edit = llama_server_defaults if name == "bare-defaults" else None
            across = _Across(args.across or "", launched, config, folder, progress, edit)
            event = None
            if args.across is not None:
                split = args.event_after

                def act(a: _Across = across, played: int = split) -> Target:
                    return a.act(work, played)

                event = conversations.Event(args.across, args.event_after, act)
            try:
                launches.setdefault(name, launched.identity)
                result = conversations.run(launched.target, name, work, progress, event)
                result.tier = _tier_figures(across.launched)
                result.moved = across.moved
            finally:
                across.stop()
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
    p.add_argument(
        "--across",
        choices=EVENTS,
        help="an event between two turns of every conversation: a SIGHUP reload, an idle unload, a stop"
        " and start of the daemon, a SIGKILL of the child; handover (replicas targets): the busiest"
        " replica stopped, its conversations moved on the hash ring",
    )
    p.add_argument("--event-after", type=int, default=2, help="turns played before the event (2)")
    p.add_argument("--config", type=Path, help="llamagate config to start from (default: embedded)")
    options.add_output_options(p)
    p.set_defaults(func=interruptible(_handle))
