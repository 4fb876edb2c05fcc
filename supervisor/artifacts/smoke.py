"""The smoke test: start llama-server privately, wait for /health, decode ONE token, stop it.

A binary that links and starts can still die on its first decode (a ``-march=native`` build on a VM
that hides AMX dies with SIGILL there), so nothing counts as verified until a token came back.

The child is started the way the supervisor starts it: loopback only, on a free port, behind a random
per-run secret passed in ``LLAMA_API_KEY`` (never argv: argv is visible in ``ps``), with a scrubbed
environment and ``XDG_CONFIG_HOME`` pointing at an empty folder so no ``LLAMA_ARG_*`` variable or
``config.ini`` changes what is tested.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from supervisor.child.log import offload_fact
from supervisor.child.osseam import describe_exit as _describe_exit
from supervisor.child.probes import ProbeError, ServedModel, get_health, get_models, one_token_completion
from supervisor.child.spawn import free_port, spawn_tied
from supervisor.errors import StartupError
from supervisor.launch.flags import CHILD_HOST, build_env, new_secret
from supervisor.launch.knobs import LlamaKnobs

_LOG_TAIL_LINES = 15


@dataclass(frozen=True)
class SmokeResult:
    ready_seconds: float
    token_text: str
    token_seconds: float
    models: tuple[ServedModel, ...]
    # Where the loader put the layers (child.log.offload_fact): "19/19" and the devices, or None/().
    offloaded: str | None = None
    devices: tuple[str, ...] = ()


def describe_exit(returncode: int) -> str:
    """How the smoke child died; nobody in llamagate had signalled it yet."""
    return _describe_exit(returncode, we_killed=False)


def _tail(log_path: Path) -> str:
    try:
        lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n    ".join(lines[-_LOG_TAIL_LINES:]) or "(empty log)"


async def smoke_decode(
    binary: Path,
    model: Path,
    *,
    alias: str,
    ready_timeout_s: float = 120.0,
    token_timeout_s: float = 120.0,
    stop_grace_s: float = 5.0,
    gpu_layers: int = 0,
    knobs: LlamaKnobs | None = None,
) -> SmokeResult:
    """``gpu_layers``: -ngl (0: CPU only); ``knobs``: the device ones, as a config would set them
    (``device`` becomes --device, ``vulkan_devices`` the child's GGML_VK_VISIBLE_DEVICES)."""
    with tempfile.TemporaryDirectory(prefix="llamagate-smoke-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "config").mkdir()
        secret = new_secret()
        port = free_port()
        base_url = f"http://{CHILD_HOST}:{port}"
        argv = [str(binary), "-m", str(model), "--alias", alias, "--host", CHILD_HOST]
        argv += ["--port", str(port), "-ngl", str(gpu_layers), "-np", "1", "-c", "512", "--no-ui"]
        if knobs is not None and knobs.device is not None:
            argv += ["--device", knobs.device]
        if gpu_layers:
            # Where the layers went is said by libllama's INFO lines, which print at -lv 4 only. That
            # level also prints the last 4 characters of this run's secret and a line per request:
            # acceptable for a private one-token child whose secret dies with it (the daemon's stay at 3).
            argv += ["-lv", "4"]
        log_path = tmp / "llama-server.log"
        started = time.monotonic()
        with log_path.open("wb") as log_fh:
            # Tied to us like the daemon's child (dies with us, even on SIGKILL), and in our process
            # group: a group signal (Ctrl-C, ``timeout``) stops it as it stops us.
            proc = await spawn_tied(argv, build_env(secret, tmp, knobs), tmp, stdout=log_fh, own_group=False)
        try:
            # trust_env=False: an HTTP(S)_PROXY from the environment must not carry loopback probes.
            async with httpx.AsyncClient(trust_env=False) as client:
                await _wait_healthy(proc, client, base_url, started + ready_timeout_s, log_path)
                ready = time.monotonic() - started
                try:
                    models = await get_models(client, base_url, secret)
                    if alias not in [m.id for m in models]:
                        raise ProbeError("GET /v1/models", f"alias {alias!r} not served: {models}")
                    token = await one_token_completion(client, base_url, secret, timeout_s=token_timeout_s)
                except (httpx.HTTPError, ProbeError) as exc:
                    raise await _failed(
                        proc, f"llama-server failed the one-token decode: {exc}", log_path
                    ) from None
            offloaded, devices = _offload(log_path)
            return SmokeResult(
                ready_seconds=ready,
                token_text=token.text,
                token_seconds=token.seconds,
                models=tuple(models),
                offloaded=offloaded,
                devices=devices,
            )
        finally:
            await stop_child(proc, grace_s=stop_grace_s)


def _offload(log_path: Path) -> tuple[str | None, tuple[str, ...]]:
    layers, devices = None, []
    for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines():
        fact = offload_fact(line)
        if fact is not None and fact[0] == "layers":
            layers = fact[1]
        elif fact is not None and fact[1] not in devices:
            devices.append(fact[1])
    return layers, tuple(devices)


async def _wait_healthy(
    proc: asyncio.subprocess.Process,
    client: httpx.AsyncClient,
    base_url: str,
    deadline: float,
    log_path: Path,
) -> None:
    while True:
        if proc.returncode is not None:
            raise await _failed(proc, "llama-server exited during startup", log_path)
        try:
            if await get_health(client, base_url, timeout_s=2.0) == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise StartupError(
                f"llama-server not healthy before the deadline; last log lines:\n    {_tail(log_path)}"
            )
        await asyncio.sleep(0.1)


async def _failed(proc: asyncio.subprocess.Process, what: str, log_path: Path) -> StartupError:
    # Give a dying child a moment to be reaped, so the message can say how it died.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), timeout=2.0)
    how = "still running" if proc.returncode is None else describe_exit(proc.returncode)
    return StartupError(f"{what} ({how}); last log lines:\n    {_tail(log_path)}")


async def stop_child(proc: asyncio.subprocess.Process, *, grace_s: float) -> None:
    """SIGTERM, a grace period, then SIGKILL, always reaped: llama-server may ignore SIGTERM."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), timeout=grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
