"""Targets a benchmark starts itself, from one llamagate config (YAML mapping): a private llamagate daemon
(``PrivateDaemon``, ``start_llamagate``) or a bare llama-server (``start_llama_server``).

``PrivateDaemon`` is the one launcher of a private ``llamagate serve``: every benchmark and the integration
tests' ``daemon_factory`` start their daemons with it. It runs
``python -m supervisor serve --config`` (this Python, this checkout) on a config written into a folder of
its own (mode 0600: it holds key digests), with JSON log lines on stderr in ``llamagate.log``.

``start_llama_server`` verifies and budgets through ``supervisor.daemon.prepare`` and launches the binary
with exactly the argv the daemon would give its child (``launch.flags.build_argv``), on a free port, with
a random API key, so a comparison of the two differs only in what is being compared. Each waits for
readiness against a deadline while watching the process, and ``stop`` always ends what it started
(SIGTERM, grace, SIGKILL: an idle llama-server may ignore SIGTERM).

Both are started tied (``child.spawn.popen_tied``: PR_SET_PDEATHSIG, from the main thread): if the bench
process dies without running ``stop`` (SIGKILL, a crash), the kernel kills them with SIGKILL, and a
private daemon's own child dies with it the same way. A benchmark's targets run in a session of their
own, so a Ctrl-C on the terminal reaches only the bench, which then stops them in order.
"""

from __future__ import annotations

import contextlib
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
from typing import IO, Any, Protocol, Self

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

ReadyzCheck = Callable[[int, dict[str, Any]], bool]


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` laid on top: mappings merge key by key, anything else (lists too) replaces."""
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


def llamagate_overrides(
    admit: int, max_queue: int, queue_timeout_s: float, tenant: str = BENCH_TENANT
) -> tuple[dict[str, Any], str]:
    """Config overrides for a private bench daemon: a free port, one tenant admitting ``admit`` requests
    at once (normally the slot count), and one fresh admin+inference key (returned in plaintext, stored
    only as a digest)."""
    key, entry = new_key_config(tenant, ADMIN)
    overrides: dict[str, Any] = {
        "proxy": {"host": "127.0.0.1", "port": free_port()},
        "tenants": [
            {
                "name": tenant,
                "max_concurrency": admit,
                "max_queue": max_queue,
                "queue_timeout_s": queue_timeout_s,
            }
        ],
        "keys": [entry],
    }
    return overrides, key


class Launched(Protocol):
    """What a benchmark reads from a target it started, whichever kind."""

    proc: subprocess.Popen[bytes]
    identity: dict[str, Any]

    @property
    def target(self) -> Target: ...

    def rss_bytes(self) -> int | None: ...

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None: ...


def _rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None


def _tail(path: Path | None, chars: int = 3000) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-chars:] if path else ""
    except OSError:
        return ""


class PrivateDaemon:
    """``llamagate serve --config`` as a tied subprocess, on a config written into ``folder``.

    ``keys`` are plaintext keys by name (the config holds their digests); the first is the one
    ``target`` and the admin reads use, so give an admin key first."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        config: dict[str, Any],
        config_path: Path,
        keys: Mapping[str, str],
        log_path: Path | None,
        stdout_path: Path,
        started_at: float,
    ) -> None:
        self.proc = proc
        self.config = config
        self.config_path = config_path
        self.keys = dict(keys)
        self.log_path = log_path  # None: stderr is a pipe the caller reads (proc.stderr)
        self.stdout_path = stdout_path
        self.started_at = started_at  # monotonic, just before the fork
        self.port = int(config["proxy"]["port"])
        self.identity: dict[str, Any] = {}

    @classmethod
    def start(
        cls,
        config: Mapping[str, Any],
        folder: Path,
        keys: Mapping[str, str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        new_session: bool = True,
        log_pipe: bool = False,
    ) -> Self:
        """Write ``config`` (it must name ``proxy.port``) and start the daemon; it does not wait.

        ``new_session``: a session of its own, so a Ctrl-C on the terminal reaches only the caller.
        ``log_pipe``: stderr (the JSON log lines) as ``proc.stderr``, for a caller that times them."""
        folder.mkdir(parents=True, exist_ok=True)
        config_path = folder / "llamagate.yaml"
        config_path.write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
        config_path.chmod(0o600)
        log_path = None if log_pipe else folder / "llamagate.log"
        stdout_path = folder / "stdout.txt"
        argv = [
            sys.executable,
            "-m",
            "supervisor",
            "--log-format",
            "json",
            "serve",
            "--config",
            str(config_path),
        ]
        with contextlib.ExitStack() as files:
            out = files.enter_context(stdout_path.open("wb"))
            err: IO[bytes] | int = (
                subprocess.PIPE if log_path is None else files.enter_context(log_path.open("wb"))
            )
            started_at = time.monotonic()
            proc = popen_tied(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env={**os.environ, **(env or {})},
                start_new_session=new_session,
            )
        return cls(proc, dict(config), config_path, keys or {}, log_path, stdout_path, started_at)

    # --- where and who -------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def key(self) -> str | None:
        return next(iter(self.keys.values()), None)

    @property
    def target(self) -> Target:
        return Target(self.base_url, self.key)

    # --- what it says ---------------------------------------------------------------------------------
    def readyz(self, client: httpx.Client | None = None) -> tuple[int, dict[str, Any]]:
        if client is None:
            with httpx.Client(timeout=10.0, trust_env=False) as own:
                return self.readyz(own)
        r = client.get(f"{self.base_url}/readyz")
        body: dict[str, Any] = r.json()
        return r.status_code, body

    def admin_identity(self) -> dict[str, Any]:
        r = httpx.get(
            f"{self.base_url}/admin/identity", headers=self.target.headers(), timeout=10.0, trust_env=False
        )
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    def admin_status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.admin_identity()["status"]
        return status

    @property
    def child_pid(self) -> int | None:
        pid = self.admin_status().get("child_pid")
        return int(pid) if pid is not None else None

    @property
    def child_port(self) -> int | None:
        port = self.admin_status().get("child_port")
        return int(port) if port is not None else None

    def rss_bytes(self) -> int | None:
        """The resident memory of its llama-server child (the daemon's own is ``psutil`` of ``pid``)."""
        try:
            return _rss(self.child_pid)
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def log_text(self) -> str:
        return _tail(self.log_path, chars=1 << 30)

    def log_records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    # --- waiting --------------------------------------------------------------------------------------
    def wait_for(self, check: ReadyzCheck, what: str, timeout: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """Poll /readyz until ``check(status, body)``; StartupError (with the log's tail) when the daemon
        exits first or the deadline passes."""
        deadline = time.monotonic() + timeout
        last: Any = None
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if (code := self.proc.poll()) is not None:
                    raise StartupError(
                        f"llamagate exited ({code}) waiting for {what}:\n{_tail(self.log_path)}"
                    )
                try:
                    code, body = self.readyz(client)
                    last = (code, body)
                    if check(code, body):
                        return body
                except (httpx.HTTPError, ValueError) as exc:
                    last = exc  # not listening yet
                time.sleep(0.1)
        raise StartupError(f"timed out waiting for {what}; last /readyz: {last}\n{_tail(self.log_path)}")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict[str, Any]:
        return self.wait_for(lambda code, body: code == 200 and body.get("ready") is True, "READY", timeout)

    # --- changing and ending it -------------------------------------------------------------------------
    def write_config(self, overrides: Mapping[str, Any]) -> None:
        """Change the config file (deep merge); send SIGHUP to apply it."""
        self.config = deep_merge(self.config, overrides)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False), encoding="utf-8")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM (the daemon drains and stops its child), SIGKILL after ``grace_s``; the exit code."""
        return stop_popen(self.proc, grace_s)


def start_llamagate(
    config: Mapping[str, Any],
    key: str,
    folder: Path,
    *,
    progress: Progress | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> PrivateDaemon:
    """A private daemon for a benchmark: ``config`` checked here (every problem listed, not left in a
    subprocess log), started, READY, its identity read with ``key`` (an admin key)."""
    progress = progress or NullProgress()
    # Its own conversation states (the disk tier): a benchmark starts from empty disks, as from empty
    # caches, unless the config names a folder (a run across a restart reuses it).
    config = deep_merge({"llama": {"state_dir": str(folder / "states")}}, config)
    validate(config, "bench config")
    daemon = PrivateDaemon.start(config, folder, {"admin": key})
    try:
        progress.update("starting llamagate", None)
        daemon.wait_ready(ready_timeout_s)
        progress.done("starting llamagate", f"{time.monotonic() - daemon.started_at:.1f} s")
        daemon.identity = daemon.admin_identity()
    except BaseException:
        daemon.stop()
        raise
    return daemon


@dataclass
class BareServer:
    """A llama-server the benchmark started itself (``start_llama_server``)."""

    proc: subprocess.Popen[bytes]
    target: Target
    log_path: Path
    identity: dict[str, Any] = field(default_factory=dict)

    def server_pid(self) -> int | None:
        """The llama-server process (the experiments sample its memory)."""
        return self.proc.pid

    def rss_bytes(self) -> int | None:
        return _rss(self.proc.pid)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        return stop_popen(self.proc, grace_s)


def start_llama_server(
    config: Mapping[str, Any],
    folder: Path,
    *,
    progress: Progress | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    edit_argv: Callable[[list[str]], list[str]] | None = None,
) -> tuple[BareServer, Prepared]:
    """llama-server alone, with the argv llamagate would give it (``edit_argv``: changed for a comparison
    of llamagate's settings with llama-server's own); returns the launch and its identity."""
    progress = progress or NullProgress()
    cfg = validate(deep_merge({"llama": {"state_dir": str(folder / "states")}}, config), "bench config")
    prepared = prepare(cfg, progress=progress)
    port = free_port()
    spec = dataclasses.replace(prepared.spec, port=port)
    folder.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(24)
    private = folder / "home"
    private.mkdir(exist_ok=True)
    log_path = folder / "llama-server.log"
    argv = build_argv(spec) if edit_argv is None else edit_argv(build_argv(spec))
    with log_path.open("wb") as log:
        proc = popen_tied(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=build_env(key, private),
            start_new_session=True,
        )
    server = BareServer(proc, Target(f"http://127.0.0.1:{port}", key), log_path)
    server.identity = {
        "served": prepared.identity,
        "budget": prepared.budget.as_dict(),
        "argv": argv,
    }
    try:
        _wait_health(server, ready_timeout_s, progress)
    except BaseException:
        server.stop()
        raise
    return server, prepared


def _wait_health(server: BareServer, timeout_s: float, progress: Progress) -> None:
    started = time.monotonic()
    deadline = started + timeout_s
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            code = server.proc.poll()
            if code is not None:
                raise StartupError(
                    f"llama-server exited with {code} before it was ready:\n{_tail(server.log_path)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{server.target.base_url}/health").status_code == 200:
                    progress.done("starting llama-server", f"{time.monotonic() - started:.1f} s")
                    return
            progress.update("starting llama-server", None, f"{time.monotonic() - started:.0f} s")
            time.sleep(0.25)
    raise StartupError(f"llama-server not ready within {timeout_s:g} s:\n{_tail(server.log_path)}")
