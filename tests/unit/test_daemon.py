"""The daemon's own robustness, with the fake OS seam and fake probes: no process, no model."""

from __future__ import annotations

import asyncio
import signal
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.budget.gguf_info import ModelShape
from supervisor.budget.plan import MIB, plan_budget
from supervisor.config.models import served_models
from supervisor.config.schema import Config, ListenerConfig
from supervisor.daemon.listener import bind_listener
from supervisor.daemon.prepare import Binary, Model, Prepared
from supervisor.daemon.prepare_models import PreparedModel
from supervisor.daemon.service import Daemon
from supervisor.errors import StartupError
from supervisor.launch.flags import LaunchSpec
from supervisor.launch.knobs import LlamaKnobs
from tests.unit.test_process_driver import FakeOs, FakeProbes

SHAPE = ModelShape("llama", 4, 8, (2,) * 4, 64, 64, 2048, None, None)


def prepared() -> Prepared:
    spec = LaunchSpec(
        Path("/bin/llama-server"),
        Path("/m.gguf"),
        "gemma-3-270m",
        0,
        LlamaKnobs(threads=2, threads_batch=2, slots=2, ctx_per_slot=4096),
    )
    budget = plan_budget(
        SHAPE,
        weights=100 * MIB,
        slots=2,
        ctx_per_slot=4096,
        type_k="f16",
        type_v="f16",
        headroom_bytes=0,
        available=8192 * MIB,
    )
    return Prepared(
        spec,
        Binary(spec.binary, "0" * 64, None),
        Model(spec.model, "1" * 64, 100 * MIB, SHAPE),
        budget,
        {"model": {"alias": "gemma-3-270m"}},
    )


def one_model(cfg: Config, p: Prepared | None = None) -> tuple[PreparedModel, ...]:
    """A ``llama:`` config's set of one, as ``prepare_models`` gives it (without files)."""
    return (PreparedModel(served_models(cfg)[0], p or prepared()),)


def make_daemon(cfg: Config | None = None) -> Daemon:
    cfg = cfg or Config()
    return Daemon(cfg, one_model(cfg), config_path=None, child_os=FakeOs(), probes=FakeProbes())


async def test_a_failing_reload_does_not_stop_signal_handling(caplog: pytest.LogCaptureFixture) -> None:
    # A reload that fails with anything (a bug, an OSError from a file) must leave the daemon able to
    # reload again and to stop on SIGTERM.
    d = make_daemon()
    calls: list[int] = []
    failed = asyncio.Event()

    async def broken_reload() -> None:
        calls.append(1)
        failed.set()
        raise RuntimeError("unexpected")

    d.reload = broken_reload  # type: ignore[method-assign]
    task = asyncio.create_task(d._dispatch_signals())
    try:
        for _ in range(2):
            failed.clear()
            d._signals.put_nowait(signal.SIGHUP)
            await asyncio.wait_for(failed.wait(), 5)
        d._signals.put_nowait(signal.SIGTERM)
        await asyncio.wait_for(d._stop.wait(), 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await d._close()
    assert len(calls) == 2
    assert "reload failed" in caplog.text


async def test_the_private_folder_is_removed_when_start_fails() -> None:
    # The optional metrics listener's port is taken: run() fails before serving, and cleans up.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = Config()
        cfg = replace(cfg, proxy=replace(cfg.proxy, metrics_listener=ListenerConfig("127.0.0.1", port)))
        d = make_daemon(cfg)
        assert d.workdir.is_dir()
        sock = bind_listener("127.0.0.1", 0)
        try:
            with pytest.raises(StartupError):
                await d.run(sock)
        finally:
            sock.close()
    assert not d.workdir.exists()


def test_the_private_folder_is_removed_when_construction_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import tempfile

    import supervisor.daemon.wiring as wiring

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(wiring, "create_app", broken)
    with pytest.raises(RuntimeError):
        make_daemon()
    assert list(tmp_path.iterdir()) == []


async def test_sigterm_is_not_held_up_by_a_slow_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A SIGHUP that changes a llama setting verifies the new files first (a large model takes a while
    # to hash). A SIGTERM arriving meanwhile must stop the daemon now, not after the reload.
    import threading

    import supervisor.daemon.service as daemon_mod

    release = threading.Event()
    started = threading.Event()
    seen: dict[str, object] = {}

    def slow_prepare(*args: object, **kwargs: object) -> Prepared:
        seen.update(kwargs)
        started.set()
        release.wait(30)
        return prepared()

    monkeypatch.setattr(daemon_mod, "prepare", slow_prepare)
    path = tmp_path / "llamagate.yaml"
    path.write_text("llama:\n  slots: 3\n")
    d = Daemon(Config(), one_model(Config()), config_path=path, child_os=FakeOs(), probes=FakeProbes())
    task = asyncio.create_task(d._dispatch_signals())
    try:
        d._signals.put_nowait(signal.SIGHUP)
        await asyncio.wait_for(asyncio.to_thread(started.wait, 10), 15)
        d._signals.put_nowait(signal.SIGTERM)
        await asyncio.wait_for(d._stop.wait(), 5)
        assert seen["fetch"] is False  # a reload verifies; it never builds or downloads
    finally:
        release.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await d._close()


def test_every_supervisor_shares_one_load_record_and_an_unloaded_model_promises_its_estimate() -> None:
    d = make_daemon()
    host = d.models.primary
    # A host gets a fresh supervisor at each load: it must still know how long the previous load took.
    fresh = host.factory(host.name, host.prepared)
    assert fresh.load_times is host.sup.load_times is d.load_times
    assert host.snapshot().state == "UNLOADED" and host.snapshot().retry_after_s == 5.0  # no estimate yet
    host.sup.load_estimate_s = lambda: 42.0  # type: ignore[method-assign]
    assert host.snapshot().retry_after_s == 42.0
