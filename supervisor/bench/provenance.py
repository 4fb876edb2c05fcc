"""What was measured, from where, by which command: written as ``provenance.json`` in every result folder.

For a remote URL the bench knows only its own side (llamagate version and commit, the host it runs on,
the exact command line) and whatever the target tells about itself: llamagate's identity for an
admin key, else llama-server's ``/props`` and ``/v1/models``. When a benchmark launched the server
itself it adds the launch record (binary, model, flags, digests).
"""

from __future__ import annotations

import datetime
import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from supervisor import __version__
from supervisor.bench.client import Target
from supervisor.bench.hostload import load_average
from supervisor.daemon.identity import host_identity

PROVENANCE_SCHEMA = "llamagate.bench.provenance/1"
SECRET_FLAGS = ("--api-key", "--direct-api-key", "--gate-api-key")
# Candidate routes on which llamagate serves its identity to admin keys (first that answers wins).
IDENTITY_ROUTES = ("/admin/identity", "/identity")
_PROPS_KEEP = ("build_info", "total_slots", "model_alias", "model_ftype", "model_path")
# A URL's password (scaleout's --redis-url, --store-url): scheme://user:PASSWORD@host.
_URL_PASSWORD = re.compile(r"(://[^:@/\s]*):[^@/\s]*@")


def redact_argv(argv: Sequence[str]) -> list[str]:
    """The command line with secret values replaced: keys and passwords in URLs must never land in a
    results folder."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
        elif arg in SECRET_FLAGS:
            out.append(arg)
            hide_next = True
        elif any(arg.startswith(flag + "=") for flag in SECRET_FLAGS):
            out.append(arg.split("=", 1)[0] + "=***")
        else:
            out.append(_URL_PASSWORD.sub(r"\1:***@", arg))
    return out


def command_line(argv: Sequence[str]) -> dict[str, Any]:
    argv = list(argv)
    if argv:
        argv[0] = Path(argv[0]).name
    clean = redact_argv(argv)
    return {"argv": clean, "command": shlex.join(clean), "cwd": str(Path.cwd())}


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def llamagate_identity() -> dict[str, Any]:
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {"version": __version__, "git_commit": commit, "git_dirty": None if dirty is None else bool(dirty)}


def _get_json(client: httpx.Client, url: str, headers: Mapping[str, str]) -> tuple[Any, str | None]:
    try:
        response = client.get(url, headers=dict(headers))
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return None, f"HTTP {response.status_code}"
    try:
        return response.json(), None
    except ValueError:
        return None, "not JSON"


def target_identity(target: Target, timeout_s: float = 5.0) -> dict[str, Any]:
    """Whatever the target says about itself; every probe that fails is noted, none is fatal."""
    out: dict[str, Any] = {"url": target.base_url, "authenticated": bool(target.api_key)}
    headers = target.headers()
    with httpx.Client(timeout=timeout_s) as client:
        for route in IDENTITY_ROUTES:
            body, err = _get_json(client, target.server_root + route, headers)
            if err is None and isinstance(body, dict):
                out["llamagate"] = body
                break
        props, err = _get_json(client, target.server_root + "/props", headers)
        if isinstance(props, dict):
            kept = {k: props[k] for k in _PROPS_KEEP if k in props}
            settings = props.get("default_generation_settings")
            if isinstance(settings, dict) and "n_ctx" in settings:
                kept["n_ctx_per_slot"] = settings["n_ctx"]
            out["props"] = kept
        else:
            out["props_error"] = err
        models, err = _get_json(client, target.api_root + "/models", headers)
        if isinstance(models, dict) and isinstance(models.get("data"), list):
            out["models"] = [
                {"id": m.get("id"), "meta": m.get("meta")} for m in models["data"] if isinstance(m, dict)
            ]
        else:
            out["models_error"] = err
    return out


def collect(
    argv: Sequence[str],
    targets: Mapping[str, Target],
    launched: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "schema": PROVENANCE_SCHEMA,
        "recorded_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "llamagate": llamagate_identity(),
        "host": host_identity(),
        # How busy the host was (another job's compiler halves a decode rate); hostload adds the end.
        "load_average": {"start": load_average()},
        "command": command_line(argv),
        "targets": {name: target_identity(t) for name, t in targets.items()},
        "launched": dict(launched) if launched else None,
    }
