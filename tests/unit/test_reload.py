"""SIGHUP with new llama settings, decided with fakes (no process, no model): the binary's dry parse
refuses bad arguments before the working child is stopped, a child that fails to load is rolled back,
nothing of a rejected reload is applied, and the outcome shows in status and /readyz."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import supervisor.daemon.service as daemon_mod
from supervisor.child.driver import ChildSupervisor
from supervisor.child.machine import State, Tick
from supervisor.child.osseam import ServedModel
from supervisor.child.preflight import error_line, refused_arguments
from supervisor.config.load import load_config
from supervisor.config.schema import Config
from supervisor.daemon.prepare import Prepared
from supervisor.daemon.service import Daemon
from supervisor.errors import StartupError
from tests.unit.test_daemon import one_model, prepared
from tests.unit.test_process_driver import FakeChild, FakeOs, FakeProbes

USAGE = "----- common params -----\n\n-h,    --help, --usage                  print usage and exit\n"


class LlamaOs(FakeOs):
    """Children that behave like the pinned llama-server for the flags these tests use:
    ``--help`` first is a dry parse (exit 0 after the usage, or exit 1 with the parser's error line);
    ``--bogus-flag`` is refused by the parser; ``--lora MISSING`` parses but fails to load (exit 1, and
    /health never turns 200 meanwhile)."""

    def __init__(self, probes: LoadingProbes) -> None:
        super().__init__()
        self.probes = probes
        self.dry_runs: list[list[str]] = []

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> FakeChild:
        if argv[1:2] == ["--help"]:
            self.dry_runs.append(list(argv))
            child = FakeChild(9000 + len(self.dry_runs))
            if "--bogus-flag" in argv:
                child.say("build: 1 (0c1e570) with cc\nerror: invalid argument: --bogus-flag\n")
                child.exit(1)
            else:
                child.say(USAGE)
                child.exit(0)
            return child
        child = await super().spawn(argv, env, cwd)
        if "--lora" in argv:
            self.probes.loading.add(f"http://127.0.0.1:{argv[argv.index('--port') + 1]}")
            child.say("llama_adapter_lora_init: failed to open /missing.gguf\n")
            child.exit(1)
        return child


class LoadingProbes(FakeProbes):
    def __init__(self) -> None:
        super().__init__()
        self.loading: set[str] = set()

    async def health(self, base_url: str, timeout_s: float) -> int:
        return 503 if base_url in self.loading else await super().health(base_url, timeout_s)

    async def models(self, base_url: str, secret: str) -> list[ServedModel]:
        return [ServedModel("gemma-3-270m", self.n_ctx)]


def fake_prepare(cfg: Config, **kwargs: object) -> Prepared:
    """What prepare() would give for ``cfg``, without files: the llama settings the tests change, on a
    host with room for one child, not two (so a change stops the old child first)."""
    p = prepared()
    spec = p.spec.with_llama(slots=cfg.llama.slots, extra_args=tuple(cfg.llama.extra_args))
    budget = replace(p.budget, available_bytes=p.budget.required_bytes * 3 // 2, headroom_bytes=0)
    identity = {"model": {"alias": "gemma-3-270m"}, "slots": cfg.llama.slots}
    return replace(p, spec=spec, budget=budget, identity=identity)


async def until(pred: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + 10.0
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class Harness:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(daemon_mod, "prepare", fake_prepare)
        self.path = tmp_path / "llamagate.yaml"
        self.write("")
        self.probes = LoadingProbes()
        self.os = LlamaOs(self.probes)
        cfg = load_config(self.path)
        self.daemon = Daemon(cfg, one_model(cfg), config_path=self.path, child_os=self.os, probes=self.probes)

    @property
    def sup(self) -> ChildSupervisor:
        """The one model's supervisor now."""
        (host,) = self.daemon.models.hosts.values()
        return host.sup

    def write(self, llama: str, tenants: str = "") -> None:
        text = (f"llama:\n{llama}" if llama else "") + (f"tenants:\n{tenants}" if tenants else "")
        self.path.write_text(text)

    def max_queue(self) -> int:
        return self.daemon.proxy.runtime.tenant("default").max_queue  # type: ignore[no-any-return]

    def readyz_info(self) -> Mapping[str, Any]:
        return self.sup.snapshot().info


@pytest.fixture
async def h(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    harness = Harness(tmp_path, monkeypatch)
    task = asyncio.create_task(harness.daemon.models.run())
    try:
        await until(lambda: harness.sup.state is State.READY, "READY")
        yield harness
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await harness.daemon._close()


NEW_TENANT = "  - name: default\n    max_queue: 1\n"


async def test_an_argument_the_binary_refuses_is_rejected_before_the_child_is_stopped(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    assert h.max_queue() == 8
    h.write("  extra_args: [--bogus-flag]\n", NEW_TENANT)
    await h.daemon.reload()
    expected = (
        "reload rejected: llama-server refused its arguments: error: invalid argument: --bogus-flag; "
        "kept the previous settings"
    )
    assert h.sup.last_reload == expected and h.readyz_info()["last_reload"] == expected
    assert expected in caplog.text
    # The binary parsed the new command line (--help first); the serving child was never touched.
    (dry,) = h.os.dry_runs
    assert dry[1] == "--help" and dry[-1] == "--bogus-flag"
    assert len(h.os.children) == 1 and h.os.children[0].signals == []
    assert h.sup.state is State.READY and h.sup.machine.generation == 1
    # Nothing of the reload applied: not the tenant change either, and the next SIGHUP diffs from here.
    assert h.max_queue() == 8 and h.daemon.cfg.llama.extra_args == ()


async def test_settings_whose_child_fails_to_load_roll_back_and_nothing_is_applied(h: Harness) -> None:
    h.write("  extra_args: [--lora, /missing.gguf]\n", NEW_TENANT)
    await h.daemon.reload()
    assert h.sup.last_reload == (
        "reload rejected: llama-server exited during load: exited with code 1; kept the previous settings"
    )
    await until(lambda: h.sup.state is State.READY, "READY on the previous settings")
    argvs = [argv for argv, _ in h.os.spawned]
    assert ["--lora" in argv for argv in argvs] == [False, True, False]
    assert h.sup.machine.generation == 3 and h.sup.machine.failures == {}
    assert h.max_queue() == 8 and h.daemon.cfg.llama.extra_args == ()
    assert "slots" not in h.sup.served_identity  # the identity given at start, not the rejected one


async def test_settings_that_work_are_applied_with_the_rest_of_the_reload(h: Harness) -> None:
    h.write("  slots: 3\n", NEW_TENANT)
    await h.daemon.reload()
    assert h.sup.last_reload == "applied" and h.readyz_info()["last_reload"] == "applied"
    assert h.sup.state is State.READY and h.sup.snapshot().slots == 3
    assert h.max_queue() == 1 and h.daemon.cfg.llama.slots == 3
    assert len(h.os.dry_runs) == 1  # checked once, before the working child was stopped


async def test_sighup_while_failed_tries_again_on_the_same_settings(h: Harness) -> None:
    h.probes.n_ctx = 2048  # every child from now on fails the gate
    h.sup.machine.policy = replace(h.sup.machine.policy, max_restarts=0)
    h.sup.machine.window.max_restarts = 0
    h.os.children[0].exit(-9)  # a crash of the ready child: restarted after its backoff, never FAILED
    await until(lambda: h.sup.state is State.BACKOFF, "BACKOFF")
    h.os.t += 60.0  # the fake clock passes the backoff (at most backoff_max_s)
    h.sup.post(Tick())
    await until(lambda: h.sup.state is State.FAILED, "FAILED")  # its restart failed the gate
    assert h.sup.machine.failures == {"exit": 1, "gate": 1}
    assert h.sup.snapshot().retry_after_s is None and "SIGHUP" in str(h.readyz_info()["recovery"])
    h.probes.n_ctx = 4096  # the cause went away (outside the config)
    await h.daemon.reload()
    await until(lambda: h.sup.state is State.READY, "READY again")
    assert h.sup.last_reload == "applied"


# --- the dry parse itself ----------------------------------------------------------------------------
async def test_the_dry_parse_puts_help_first_and_reports_the_parsers_line(tmp_path: Path) -> None:
    probes = LoadingProbes()
    os_ = LlamaOs(probes)
    argv = ["/bin/llama-server", "-m", "/m.gguf", "--alias"]
    assert await refused_arguments(os_, argv, {}, tmp_path) is None
    assert os_.dry_runs[-1] == ["/bin/llama-server", "--help", "-m", "/m.gguf", "--alias"]
    refused = await refused_arguments(os_, [*argv, "x", "--bogus-flag"], {}, tmp_path)
    assert refused == "error: invalid argument: --bogus-flag"


async def test_a_dry_parse_that_cannot_run_or_hangs_is_not_a_verdict(tmp_path: Path) -> None:
    class Hangs(FakeOs):
        async def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> FakeChild:
            child = await super().spawn(argv, env, cwd)
            if self.spawn_error is None and len(self.children) == 1:
                return child  # never exits
            return child

    os_ = Hangs()
    assert await refused_arguments(os_, ["/bin/x", "-m", "m"], {}, tmp_path, timeout_s=0.05) is None
    assert os_.children[0].signals == [9]  # killed, not left behind
    os_.spawn_error = FileNotFoundError(2, "No such file or directory")
    assert await refused_arguments(os_, ["/bin/x"], {}, tmp_path) is None


def test_error_line_prefers_the_error() -> None:
    out = 'build: 1 (0c1e570)\nerror while handling argument "-c": stoi\n\nusage:\n-c N\n'
    assert error_line(out, 1) == 'error while handling argument "-c": stoi'
    assert error_line("something odd\nlast words\n", 1) == "last words"
    assert error_line("", 134) == "exited with code 134"


async def test_a_reload_refused_before_the_child_says_so_without_details(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h.path.write_text("llama:\n  slots: 0\n")
    await h.daemon.reload()
    invalid = "the config file does not validate (see the daemon's log)"
    assert h.sup.last_reload == f"reload rejected: {invalid}; kept the previous settings"

    def wrong_sha(*args: object, **kwargs: object) -> Prepared:
        raise StartupError("/models/secret-name.gguf: sha256 mismatch")

    monkeypatch.setattr(daemon_mod, "prepare", wrong_sha)
    h.write("  slots: 3\n")
    loop = asyncio.create_task(h.daemon._reload_on_hup())
    try:
        h.daemon._hup.set()
        await until(lambda: "did not verify" in str(h.sup.last_reload), "the reload to be refused")
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert "secret-name" not in str(h.readyz_info()) and h.sup.machine.generation == 1


async def test_what_a_reload_cannot_change_is_kept_with_a_warning_and_the_rest_applies(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    port, listener = h.daemon.cfg.proxy.port, h.daemon.cfg.proxy.metrics_listener
    h.path.write_text(
        "proxy: {port: 18099, metrics_listener: {port: 18098}}\nlogging: {format: json}\nstore: {}\n"
        f"tenants:\n{NEW_TENANT}"
    )
    await h.daemon.reload()
    assert (
        "SIGHUP: proxy.host/port/metrics_listener, logging.format/level, store take effect at the next"
        " daemon start; keeping the current ones"
    ) in caplog.text
    cfg = h.daemon.cfg
    assert (cfg.proxy.port, cfg.proxy.metrics_listener, cfg.logging.format, cfg.store) == (
        port,
        listener,
        "text",
        None,
    )
    assert h.max_queue() == 1 and h.sup.last_reload == "applied" and h.sup.machine.generation == 1


async def test_a_reload_keeps_the_cluster_settings_with_a_warning(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    h.path.write_text(f"cluster: {{redis_url: 'redis://127.0.0.1:9/0'}}\ntenants:\n{NEW_TENANT}")
    await h.daemon.reload()
    assert "SIGHUP: cluster take effect at the next daemon start; keeping the current ones" in caplog.text
    assert h.daemon.cfg.cluster is None
    assert h.max_queue() == 1 and h.sup.last_reload == "applied"
