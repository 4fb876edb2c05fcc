"""Targets the benchmark starts itself: a bare llama-server, or a whole llamagate daemon, from one config.

Both come from the same llamagate config (YAML mapping), so a comparison differs only in what is being
compared: ``start_llama_server`` verifies and budgets through ``supervisor.daemon.prepare`` and launches the
binary with exactly the argv the daemon would give its child (``launch.flags.build_argv``), on a free port,
with a random API key; ``start_llamagate`` runs ``llamagate serve --config`` as a subprocess with a
fresh admin key. Each waits for readiness against a deadline while watching the process, and ``stop``
always ends what it started (SIGTERM, grace, SIGKILL: an idle llama-server may ignore SIGTERM).

Both are started tied (``child.spawn.popen_tied``: PR_SET_PDEATHSIG, from the main thread): if the bench
process dies without running ``stop`` (SIGKILL, a crash), the kernel kills them with SIGKILL, and a
private daemon's own child dies with it the same way. Each runs in a session of its own, so a Ctrl-C
on the terminal reaches only the bench, which then stops them in order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from supervisor.bench.client import Target
from supervisor.child.spawn import free_port, popen_tied, stop_popen
from supervisor.config.keys import ADMIN, new_key_config
from supervisor.config.load import parse_config
from supervisor.config.schema import Config
from supervisor.daemon.prepare import Prepared, prepare
from supervisor.errors import StartupError, UsageError
from supervisor.launch.flags import build_argv, build_env
from supervisor.progress import NullProgress, Progress

READY_TIMEOUT_S = 300.0
STOP_GRACE_S = 15.0
BENCH_TENANT = "bench"
# Config keys holding paths; made absolute so a derived config written elsewhere still finds them.
_PATH_KEYS = (("llama", "lock"), ("llama", "binary"), ("llama", "model", "path"))


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_base_config(path: Path | None) -> dict[str, Any]:
    """The user's config as a plain mapping (``{}``: the embedded default), paths made absolute."""
    if path is None:
        return {}
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise UsageError(f"--config {path}: invalid YAML ({exc})") from exc
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UsageError(f"--config {path}: expected a mapping at the top level")
    base_dir = path.resolve().parent
    for keys in _PATH_KEYS:
        node: Any = raw
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(keys[-1]), str) and "${" not in node[keys[-1]]:
            value = Path(node[keys[-1]]).expanduser()
            node[keys[-1]] = str(value if value.is_absolute() else base_dir / value)
    return raw


def validate(config: Mapping[str, Any], source: str) -> Config:
    return parse_config(yaml.safe_dump(dict(config)), source=source)


@dataclass
class Launched:
    kind: str  # "llama-server" or "llamagate"
    proc: subprocess.Popen[bytes]
    target: Target
    log_path: Path
    identity: dict[str, Any] = field(default_factory=dict)

    def server_pid(self) -> int | None:
        """The llama-server process (for llamagate: its child, as the daemon reports it)."""
        if self.kind == "llama-server":
            return self.proc.pid
        status = self.identity.get("status")
        pid = status.get("child_pid") if isinstance(status, dict) else None
        return int(pid) if isinstance(pid, int) else None

    def rss_bytes(self) -> int | None:
        pid = self.server_pid()
        if pid is None:
            return None
        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return None

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        return stop_popen(self.proc, grace_s)


def _log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-chars:]
    except OSError:
        return ""


def _wait(
    launched: Launched, probe: Callable[[httpx.Client], bool], what: str, timeout_s: float, progress: Progress
) -> None:
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            code = launched.proc.poll()
            if code is not None:
                raise StartupError(
                    f"{what} exited with {code} before it was ready:\n{_log_tail(launched.log_path)}"
                )
            try:
                if probe(client):
                    progress.done(f"starting {what}", f"{time.monotonic() - started:.1f} s")
                    return
            except (httpx.HTTPError, ValueError):
                pass  # not listening yet, or still loading
            progress.update(f"starting {what}", None, f"{time.monotonic() - started:.0f} s")
            time.sleep(0.25)
    launched.stop()
    raise StartupError(f"{what} not ready within {timeout_s:g} s:\n{_log_tail(launched.log_path)}")


def start_llama_server(
    config: Mapping[str, Any],
    folder: Path,
    *,
    progress: Progress | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> tuple[Launched, Prepared]:
    """llama-server alone, with the argv llamagate would give it; returns the launch and its identity."""
    progress = progress or NullProgress()
    cfg = validate(config, "bench config")
    prepared = prepare(cfg, progress=progress)
    port = free_port()
    spec = dataclasses.replace(prepared.spec, port=port)
    folder.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(24)
    private = folder / "home"
    private.mkdir(exist_ok=True)
    log_path = folder / "llama-server.log"
    with log_path.open("wb") as log:
        proc = popen_tied(
            build_argv(spec),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=build_env(key, private),
            start_new_session=True,
        )
    launched = Launched("llama-server", proc, Target(f"http://127.0.0.1:{port}", key), log_path)
    launched.identity = {
        "served": prepared.identity,
        "budget": prepared.budget.as_dict(),
        "argv": build_argv(spec),
    }

    def ready(client: httpx.Client) -> bool:
        return client.get(f"{launched.target.base_url}/health").status_code == 200

    try:
        _wait(launched, ready, "llama-server", ready_timeout_s, progress)
    except BaseException:
        launched.stop()
        raise
    return launched, prepared


def llamagate_overrides(admit: int, max_queue: int, queue_timeout_s: float) -> tuple[dict[str, Any], str]:
    """Config overrides for a private bench daemon: a free port, one tenant admitting ``admit`` requests
    at once (normally the slot count), and one fresh admin+inference key (returned in plaintext, stored
    only as a digest)."""
    key, entry = new_key_config(BENCH_TENANT, ADMIN)
    overrides: dict[str, Any] = {
        "proxy": {"host": "127.0.0.1", "port": free_port()},
        "tenants": [
            {
                "name": BENCH_TENANT,
                "max_concurrency": admit,
                "max_queue": max_queue,
                "queue_timeout_s": queue_timeout_s,
            }
        ],
        "keys": [entry],
    }
    return overrides, key


def start_llamagate(
    config: Mapping[str, Any],
    key: str,
    folder: Path,
    *,
    progress: Progress | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Launched:
    """``llamagate serve --config`` (this Python, this checkout) with ``config`` written into ``folder``."""
    progress = progress or NullProgress()
    validate(config, "bench config")  # fail here, with every problem listed, not in a subprocess log
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "llamagate.yaml"
    config_path.write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
    config_path.chmod(0o600)
    port = int(config["proxy"]["port"])
    log_path = folder / "llamagate.log"
    argv = [sys.executable, "-m", "supervisor", "--log-format", "json", "serve", "--config", str(config_path)]
    with log_path.open("wb") as log:
        proc = popen_tied(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
            start_new_session=True,
        )
    launched = Launched("llamagate", proc, Target(f"http://127.0.0.1:{port}", key), log_path)

    def ready(client: httpx.Client) -> bool:
        response = client.get(f"{launched.target.base_url}/readyz")
        return response.status_code == 200 and response.json().get("ready") is True

    try:
        _wait(launched, ready, "llamagate", ready_timeout_s, progress)
        launched.identity = admin_identity(launched.target)
    except BaseException:
        launched.stop()
        raise
    return launched


def admin_identity(target: Target) -> dict[str, Any]:
    try:
        response = httpx.get(target.server_root + "/admin/identity", headers=target.headers(), timeout=10.0)
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if response.status_code != 200:
        return {"error": f"HTTP {response.status_code}"}
    try:
        body = response.json()
    except json.JSONDecodeError:
        return {"error": "not JSON"}
    return body if isinstance(body, dict) else {"error": "not an object"}
