"""An operator unloads and loads a model of a running daemon with ``llamagate models``, against the real
llama-server and the demo model served twice: "chat" (always) and "embed" (on_demand, preloaded at start).
Unloading the always model is refused; unloading "embed" stops its child; loading it again brings it to
READY while a request for it waits and is served, and /readyz's progress for it only rises, to 1.0."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.integration.conftest import Daemon, DaemonFactory, process_gone, wait_until
from tests.integration.test_multi_model_e2e import child_pid, embed, listed, model

pytestmark = pytest.mark.integration


def models_cli(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "supervisor", "models", *args, "--url", d.base_url, "--key", d.admin_key]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)


def test_models_unload_then_load_an_on_demand_model_while_a_request_waits(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory(
        {
            "llama": {"prompt_cache_mib": 0, "ctx_checkpoints": 0},
            "models": [
                model(daemon_factory, "chat"),
                model(
                    daemon_factory,
                    "embed",
                    embeddings=True,
                    extra_args=["--pooling", "mean"],
                    residency="on_demand",
                    preload=True,
                    idle_unload_s=3600,
                ),
            ],
        }
    )
    # preload: the on_demand model is loaded at start, without a request.
    d.wait_for(lambda code, b: b["models"]["embed"]["state"] == "READY", "the preloaded model")
    pid = child_pid(d, "embed")
    assert pid is not None

    refused = models_cli(d, "unload", "chat")
    assert refused.returncode == 1 and "residency 'always'" in refused.stdout, refused

    done = models_cli(d, "unload", "embed")
    assert done.returncode == 0 and done.stdout.split()[:2] == ["embed", "UNLOADED"], done
    wait_until(lambda: process_gone(pid), "the unloaded model's child to exit", timeout=60)
    assert child_pid(d, "embed") is None and listed(d)["embed"] == "unloaded"

    argv = [sys.executable, "-m", "supervisor", "models", "load", "embed"]
    argv += ["--url", d.base_url, "--key", d.admin_key]
    samples: list[dict[str, object]] = []
    served: list[list[float]] = []
    waiter: threading.Thread | None = None
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as loading:
        try:
            # Sample the load from /readyz until READY; a request for the model waits meanwhile.
            deadline = time.monotonic() + 180
            with httpx.Client(timeout=10, trust_env=False) as c:
                while time.monotonic() < deadline:
                    row = c.get(f"{d.base_url}/readyz").json()["models"]["embed"]
                    samples.append(row)
                    if row["state"] == "READY":
                        break
                    if row["state"] == "STARTING" and waiter is None:
                        waiter = threading.Thread(target=lambda: served.append(embed(d)))
                        waiter.start()
                    time.sleep(0.02)
            out, err = loading.communicate(timeout=180)
        finally:
            if loading.poll() is None:
                loading.kill()
    assert loading.returncode == 0 and out.split()[:2] == ["embed", "READY"], (out, err)
    if waiter is not None:
        waiter.join(180)
    assert waiter is not None, [s["state"] for s in samples]  # the load was seen in progress
    assert served and served[0], "the request during the load was served"

    loading_samples = [s for s in samples if s["state"] == "STARTING"]
    progress = [s["progress"] for s in loading_samples if s["progress"] is not None]
    assert progress and progress == sorted(progress), progress
    assert samples[-1]["state"] == "READY" and samples[-1]["progress"] == 1.0
    # The second load knows how long the first (the preload) took: one load record for every supervisor.
    assert any(s["load_eta_s"] is not None for s in loading_samples), loading_samples
