"""Several models, operations: the top level of /readyz and /admin/identity speaks for every model (not
the first one's restarts and failures), and ``llamagate status`` prints a line and an identity per model;
stand-in hosts and a stub daemon, no child process."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from supervisor.child.machine import State
from supervisor.cli import main
from supervisor.daemon.model_hosts import ModelHost, ModelSet
from tests.fakes.fake_upstream import snapshot_for
from tests.helpers.json_stub import json_stub


def host(name: str, *, ready: bool, restarts: int, last_failure: str | None, on_demand: bool = False) -> Any:
    served = SimpleNamespace(
        name=name, on_demand=on_demand, residency="on_demand" if on_demand else "always", idle_unload_s=None
    )
    sup = SimpleNamespace(
        draining=False,
        observers=[],
        state=State.READY if ready else State.BACKOFF,
        machine=SimpleNamespace(restarts=restarts, last_failure=last_failure),
    )
    snap = snapshot_for(
        "http://127.0.0.1:1" if ready else None,
        "s",
        ready=ready,
        state="READY" if ready else "BACKOFF",
        reason=None if ready else "restarting",
        model_alias=name,
        info={"restarts": restarts, "last_failure": last_failure, "uptime_s": 5.0},
    )
    return SimpleNamespace(
        name=name,
        served=served,
        sup=sup,
        running=True,
        snapshot=lambda: snap,
        identity=lambda: {"model": {"alias": name}, "status": {"state": snap.state, "restarts": restarts}},
    )


def model_set(*hosts: Any) -> ModelSet:
    models = ModelSet(1 << 40)
    for h in hosts:
        models.add(cast(ModelHost, h))
    return models


def test_the_top_level_counts_every_models_restarts_and_names_each_failure() -> None:
    models = model_set(
        host("chat", ready=True, restarts=0, last_failure=None),
        host("embed", ready=False, restarts=2, last_failure="exited with status 1"),
        host("lazy", ready=False, restarts=1, last_failure="killed", on_demand=True),
    )
    snap = models.snapshot()
    assert snap.model_alias == "chat"  # the default model's settings stay at the top level
    assert not snap.ready and "'embed'" in (snap.reason or "")
    assert snap.info["restarts"] == 3
    assert snap.info["last_failure"] == "embed: exited with status 1; lazy: killed"

    identity = models.identity()
    status = cast(dict[str, Any], identity["status"])
    assert status["state"] == "BACKOFF" and status["ready"] is False
    assert status["not_ready"] == ["embed"] and status["default_model"] == "chat"
    assert status["restarts"] == 3 and status["last_failure"].startswith("embed: ")
    per_model = cast(dict[str, Any], identity["models"])
    assert per_model["embed"]["status"] == {"state": "BACKOFF", "restarts": 2}


READYZ = {
    "state": "READY",
    "ready": True,
    "reason": None,
    "model": "chat",
    "slots": 1,
    "ctx_per_slot": 512,
    "uptime_s": 61,
    "restarts": 3,
    "last_failure": "embed: killed by SIGKILL from outside (out of memory?)",
    "in_flight": 1,
    "queued": 0,
    "models": {
        "chat": {"state": "READY", "residency": "always", "slots": 1, "ctx_per_slot": 512, "uptime_s": 61,
                 "restarts": 0},
        "embed": {"state": "READY", "residency": "always", "slots": 2, "ctx_per_slot": 256, "uptime_s": 30,
                  "restarts": 3, "last_failure": "killed by SIGKILL from outside (out of memory?)"},
    },
}  # fmt: skip


def _identity(alias: str, sha: str) -> dict[str, Any]:
    return {
        "model": {"alias": alias, "path": f"/m/{alias}.gguf", "size_bytes": 10, "sha256": sha},
        "serving": {"threads": 1, "threads_batch": 1, "slots": 1, "ctx_per_slot": 512},
    }


LAVAPIPE = {"name": "Vulkan0", "description": "llvmpipe (LLVM 15.0.6, 256 bits)"}
IDENTITY = {
    **_identity("chat", "c" * 8),
    "llama_cpp": {"commit": "0c1e570", "variant": "vulkan", "patches": ["p (sha256 ab)"]},
    "binary": {"path": "/bin/llama-server", "sha256": "b" * 8},
    "host": {},
    "models": {
        "chat": {
            **_identity("chat", "c" * 8),
            "device": {"variant": "vulkan", "gpu_layers": 99, "device": LAVAPIPE},
        },
        "embed": {
            **_identity("embed", "e" * 8),
            "device": {"variant": "cpu", "gpu_layers": 0, "device": None},
        },
    },
}


@pytest.fixture
def stub() -> Iterator[int]:
    with json_stub(lambda path: (200, READYZ if path == "/readyz" else IDENTITY)) as port:
        yield port


def test_status_prints_each_model_and_not_the_first_ones_figures_as_the_daemons(
    stub: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--url", f"127.0.0.1:{stub}", "--key", "k"]) == 0
    out = capsys.readouterr().out
    assert "    chat           READY (always), 1 slots x 512 tokens, uptime 1m 1s, restarts 0\n" in out
    assert (
        "    embed          READY (always), 2 slots x 256 tokens, uptime 0m 30s, restarts 3,"
        " last failure killed by SIGKILL from outside (out of memory?)\n"
    ) in out
    assert "  restarts     3 (all models)\n" in out
    assert "  last failure embed: killed by SIGKILL" in out
    # The first model's own figures are not shown as if they were the daemon's.
    assert "  model        chat" not in out and "  uptime " not in out
    # Each model's file and settings from /admin/identity.
    assert "  model chat\n    model file   /m/chat.gguf (10 bytes) sha256 cccccccc\n" in out
    assert "  model embed\n    model file   /m/embed.gguf (10 bytes) sha256 eeeeeeee\n" in out
    # Which build and where the layers go: the variant once, the device per model (the CPU one: none).
    assert "  variant      vulkan (1 patch(es): p (sha256 ab))\n" in out
    assert (
        "    device       vulkan build, gpu_layers 99 on Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits))\n" in out
    )
    assert out.count("    device ") == 1
