"""``llamagate status``: is the daemon ready, and what does it serve? A health check for cron,
Nagios or a Kubernetes exec probe: exit 0 ready, 1 not ready, 2 unreachable."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import httpx

from supervisor.commands.config import add_config_argument
from supervisor.config.load import load_proxy_config, resolve_config_path
from supervisor.errors import UsageError

URL_ENV = "LLAMAGATE_URL"
KEY_ENV = "LLAMAGATE_ADMIN_KEY"


def add_url_argument(parser: argparse.ArgumentParser) -> None:
    """``--url``, as every command that calls a running daemon takes it (``default_url`` resolves it)."""
    parser.add_argument(
        "--url",
        help=f"daemon URL, e.g. http://127.0.0.1:8080 (default ${URL_ENV}, else proxy.host/port of "
        "--config, else 127.0.0.1:8080)",
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "status", help="readiness and identity of a running daemon (exit 0 ready, 1 not ready, 2 unreachable)"
    )
    add_url_argument(parser)
    add_config_argument(parser)
    parser.add_argument("--key", help=f"admin key, to show the identity (default ${KEY_ENV})")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per request")
    parser.add_argument("--json", action="store_true", help="print the raw answers as JSON")
    parser.set_defaults(func=_status)


def _fmt_duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    s = int(seconds)
    return (
        f"{s // 86400}d {s % 86400 // 3600}h {s % 3600 // 60}m {s % 60}s"
        if s >= 86400
        else (f"{s // 3600}h {s % 3600 // 60}m {s % 60}s" if s >= 3600 else f"{s // 60}m {s % 60}s")
    )


def default_url(args: argparse.Namespace) -> str:
    if os.environ.get(URL_ENV):
        return os.environ[URL_ENV]
    path = resolve_config_path(args.config)
    if path is None:
        return "http://127.0.0.1:8080"
    proxy = load_proxy_config(path)  # the listener only: other sections' ${VAR}s need not be set here
    host = "127.0.0.1" if proxy.host in ("0.0.0.0", "::", "") else proxy.host  # noqa: S104 - reading, not binding
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{proxy.port}"


def normalize_url(text: str) -> str:
    """``127.0.0.1:8080`` means ``http://127.0.0.1:8080``; anything else that is not an http(s) URL
    is a usage error that says what to write."""
    url = text.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as exc:
        raise UsageError(f"--url {text!r}: {exc}; write http://HOST:PORT") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise UsageError(f"--url {text!r}: not an http(s) URL; write http://HOST:PORT")
    return url


def _unreachable(args: argparse.Namespace, url: str, error: str) -> int:
    if args.json:
        print(json.dumps({"url": url, "reachable": False, "error": error, "readyz": None, "identity": None}))
    else:
        print(f"unreachable: {error}")
    return 2


def _status(args: argparse.Namespace) -> int:
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout}: must be > 0 seconds")
    url = normalize_url(args.url or default_url(args))
    key = args.key or os.environ.get(KEY_ENV)
    with httpx.Client(timeout=args.timeout, trust_env=False) as client:
        try:
            response = client.get(f"{url}/readyz")
            ready_body = response.json()
        except httpx.HTTPError as exc:
            return _unreachable(args, url, f"{url}: {type(exc).__name__}: {exc}")
        except ValueError:
            code = response.status_code
            return _unreachable(
                args, url, f"{url}/readyz did not answer JSON (HTTP {code}); is this llamagate?"
            )
        if not isinstance(ready_body, dict):
            return _unreachable(args, url, f"{url}/readyz did not answer a JSON object; is this llamagate?")
        identity: Any = None
        identity_error = None
        if key:
            try:
                r = client.get(f"{url}/admin/identity", headers={"Authorization": f"Bearer {key}"})
                identity = r.json() if r.status_code == 200 else None
                if r.status_code != 200:
                    identity_error = f"HTTP {r.status_code}"
            except (httpx.HTTPError, ValueError) as exc:
                identity_error = str(exc)
    ready = bool(ready_body.get("ready")) and response.status_code == 200
    if args.json:
        out = {"url": url, "reachable": True, "readyz": ready_body, "identity": identity}
        print(json.dumps(out, indent=2))
        return 0 if ready else 1
    print(f"{url}: {'READY' if ready else 'NOT READY'}")
    print(
        f"  state        {ready_body.get('state')}"
        + (f" ({ready_body['reason']})" if ready_body.get("reason") else "")
    )
    b = ready_body
    # The top level speaks for every model at once (restarts summed); each model's own on its line.
    print(f"  restarts     {b.get('restarts', '-')} (all models)")
    print(f"  last failure {b.get('last_failure') or '-'}")
    if b.get("last_reload"):
        print(f"  last reload  {b['last_reload']}")
    if b.get("recovery"):
        print(f"  recovery     {b['recovery']}")
    print(f"  in flight    {b.get('in_flight', '-')}, queued {b.get('queued', '-')}")
    _print_models(b.get("models") or {}, b.get("last_reload"))
    if identity_error:
        print(f"  identity     not available: {identity_error}")
    elif isinstance(identity, dict):
        _print_identity(identity)
    return 0 if ready else 1


def _print_models(models: dict[str, Any], last_reload: object) -> None:
    """One line per served model, from /readyz (no key needed)."""
    print("  models")
    for name, m in models.items():
        line = (
            f"    {name:<14} {m.get('state')} ({m.get('residency')}), {m.get('slots')} slots x"
            f" {m.get('ctx_per_slot')} tokens, uptime {_fmt_duration(m.get('uptime_s'))},"
            f" restarts {m.get('restarts', '-')}"
        )
        if m.get("last_failure"):
            line += f", last failure {m['last_failure']}"
        if m.get("last_reload") not in (None, last_reload):  # its own outcome, when not the daemon's
            line += f", last reload {m['last_reload']}"
        print(line)


def _print_identity(identity: dict[str, Any]) -> None:
    build = identity.get("llama_cpp") or {}
    binary = identity.get("binary") or {}
    host = identity.get("host") or {}
    print(f"  llama.cpp    {build.get('commit') or build.get('version') or build.get('source')}")
    print(f"  binary       {binary.get('path')} sha256 {binary.get('sha256')}")
    if build.get("variant"):
        patches = build.get("patches") or []
        print(
            f"  variant      {build['variant']}"
            + (f" ({len(patches)} patch(es): {'; '.join(patches)})" if patches else "")
        )
    if build.get("cmake_args"):
        print(f"  cmake        {' '.join(build['cmake_args'])}")
    for name, record in (identity.get("models") or {}).items():  # each served model's file and settings
        if isinstance(record, dict):
            print(f"  model {name}")
            _print_model(record, indent="    ")
    mem = host.get("memory_total_bytes")
    mem_s = f"{mem / 2**30:.1f} GiB" if isinstance(mem, int) else "-"
    print(
        f"  host         {host.get('cpu_model')}, {host.get('cpu_physical')} cores "
        f"({host.get('cpu_logical')} logical), {mem_s}, {host.get('os')} {host.get('kernel')}"
    )


def _print_model(identity: dict[str, Any], indent: str) -> None:
    model = identity.get("model") or {}
    serving = identity.get("serving") or {}
    print(
        f"{indent}model file   {model.get('path')} ({model.get('size_bytes')} bytes)"
        f" sha256 {model.get('sha256')}"
    )
    device = identity.get("device") or {}
    if device.get("gpu_layers"):
        chosen = device.get("device") or {}
        where = f"{chosen.get('name')} ({chosen.get('description')})" if chosen else "a device not listed"
        note = f"; {device['note']}" if device.get("note") else ""
        layers = f"gpu_layers {device['gpu_layers']}"
        print(f"{indent}device       {device.get('variant')} build, {layers} on {where}{note}")
    threads = f"{serving.get('threads')}/{serving.get('threads_batch')}"
    print(
        f"{indent}serving      alias {model.get('alias')}, threads {threads}, "
        f"{serving.get('slots')} slots x {serving.get('ctx_per_slot')}"
    )
    disk = identity.get("state_disk")
    if isinstance(disk, dict):
        print(f"{indent}states disk  {_disk_line(disk)}")


def _disk_line(disk: dict[str, Any]) -> str:
    """The conversation states on disk: used of the budget, where; or why off."""
    budget, used = disk.get("budget_bytes"), disk.get("used_bytes")
    if not budget or not isinstance(budget, int):
        return str(disk.get("why") or "off")
    used_mib = used / 2**20 if isinstance(used, int) else 0.0
    return f"{used_mib:,.0f} of {budget / 2**20:,.0f} MiB in {disk.get('folder')}"
