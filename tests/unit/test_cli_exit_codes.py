"""Exit codes as documented, and messages instead of tracebacks, for the command line itself.

No llama-server here: a mistake found at start (model file missing, wrong sha256, budget does not
fit) is refused before any child is spawned, so ``llamagate serve`` runs as a real subprocess and
exits 2 within a second. Ctrl-C to a serving daemon is in tests/integration/test_exit_codes.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest
import yaml

from supervisor.artifacts.files import sha256_fresh
from supervisor.child.spawn import free_port
from supervisor.cli import main
from tests.helpers.json_stub import json_stub
from tests.unit.test_daemon import make_daemon

REPO = Path(__file__).resolve().parents[2]


def write_gguf(path: Path) -> Path:
    """A header-only GGUF: enough for the sha256, the magic and the memory budget."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(4)
    w.add_head_count(8)
    w.add_head_count_kv(2)
    w.add_embedding_length(512)
    w.add_context_length(2048)
    w.add_token_list([f"tok{i}" for i in range(16)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def fake_binary(folder: Path) -> Path:
    path = folder / "llama-server"
    path.write_text("#!/bin/sh\necho 'version: 1 (0c1e570)'\nexit 0\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def setup(tmp_path: Path) -> dict[str, Any]:
    model = write_gguf(tmp_path / "model.gguf")
    return {
        "proxy": {"port": free_port()},
        "llama": {
            "binary": str(fake_binary(tmp_path)),
            "model": {"path": str(model), "sha256": sha256_fresh(model)},
            "threads": 1,
            "slots": 1,
            "ctx_per_slot": 256,
        },
        "supervision": {"memory_headroom_mib": 0},
    }


def write(tmp_path: Path, cfg: dict[str, Any], name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=REPO,
    )


# --- flags ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (
            ["--log-level", "nonsense", "config", "check", "--offline"],
            "--log-level: invalid choice: 'NONSENSE'",
        ),
        (["serve", "--port", "70000"], "--port: 70000 is not a port number (1-65535)"),
        (["serve", "--port", "0"], "--port: 0 is not supported"),
        (["serve", "--port", "-1"], "--port: -1 is not a port number"),
        (["serve", "--port", "eighty"], "--port: not a port number: 'eighty'"),
        (["serve", "--host", ""], "--host: empty"),
        (
            ["keys", "new", "--tenant", "a", "--admin", "--admin-only"],
            "--admin-only: not allowed with argument --admin",
        ),
        (
            ["keys", "hash", "--tenant", "a", "--admin", "--admin-only"],
            "--admin-only: not allowed with argument --admin",
        ),
        (["status", "--url", "ftp://127.0.0.1:8080"], "--url 'ftp://127.0.0.1:8080': not an http(s) URL"),
        (["status", "--timeout", "0"], "--timeout 0.0: must be > 0"),
    ],
)
def test_a_bad_flag_is_a_usage_error_naming_it(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err
    assert "Traceback" not in err


def test_log_level_is_case_insensitive() -> None:
    assert main(["--log-level", "debug", "config", "check", "--offline"]) == 0


# --- config check checks what serve would refuse --------------------------------------------------------
def test_config_check_passes_when_serve_would_start(
    tmp_path: Path, setup: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "check", "--config", str(write(tmp_path, setup))]) == 0
    out = capsys.readouterr().out
    assert "ok (" in out and "checked on this host: binary, model file and sha256, memory budget" in out


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda c, t: c["llama"]["model"].update(path=str(t / "gone.gguf")),
            "llama.model.path: model file not found",
        ),
        (lambda c, t: c["llama"]["model"].update(sha256="0" * 64), "llama.model.sha256: model "),
        (
            lambda c, t: (
                (t / "x.gguf").write_text("not a model"),
                c["llama"]["model"].update(path=str(t / "x.gguf")),
            ),
            "llama.model.path: not a GGUF model file",
        ),
        (lambda c, t: c["llama"].update(binary=str(t / "missing")), "llama.binary: not a file"),
        (lambda c, t: c["llama"].update(binary_sha256="0" * 64), "llama.binary_sha256: "),
        (lambda c, t: c["supervision"].update(memory_headroom_mib=2**40), "memory budget does not fit"),
    ],
    ids=["model-missing", "model-sha256", "not-a-gguf", "binary-missing", "binary-sha256", "budget"],
)
def test_what_serve_refuses_config_check_refuses_and_serve_exits_2(
    tmp_path: Path, setup: dict[str, Any], change: Any, expected: str
) -> None:
    change(setup, tmp_path)
    path = write(tmp_path, setup)
    checked = cli("config", "check", "--config", str(path))
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert expected in checked.stdout
    if expected.startswith("llama.model.sha256"):
        assert "sha256 mismatch: expected " + "0" * 64 in checked.stdout
    # --offline checks the file only: it passes.
    offline = cli("config", "check", "--offline", "--config", str(path))
    assert offline.returncode == 0 and "the file only (--offline)" in offline.stdout
    # The real `llamagate serve`: refused at start, exit 2 (systemd's RestartPreventExitStatus=2),
    # the same message, no child started.
    served = cli("serve", "--config", str(path))
    assert served.returncode == 2, served.stderr
    assert expected in served.stderr and "Traceback" not in served.stderr
    assert "starting llama-server" not in served.stderr


def test_config_check_does_not_build_or_fetch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # An empty cache and the embedded default: what serve would build or fetch is a note, not a problem.
    env = {"LLAMAGATE_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "config", "check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "note: llama-server will be built at the first start" in done.stdout
    assert "note: the demo model will be fetched at the first start" in done.stdout
    assert not (tmp_path / "cache" / "models").exists()


# --- plan ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--systemd", "--kubernetes"])
def test_plan_limits_for_a_budget_that_does_not_fit_are_refused_on_stderr(
    tmp_path: Path, setup: dict[str, Any], flag: str
) -> None:
    fits = cli("plan", flag, "--config", str(write(tmp_path, setup)))
    assert fits.returncode == 0 and ("MemoryMax=" in fits.stdout or "limits:" in fits.stdout)
    setup["supervision"]["memory_headroom_mib"] = 2**40
    refused = cli("plan", flag, "--config", str(write(tmp_path, setup)))
    assert refused.returncode == 1
    assert refused.stdout == ""  # nothing that looks like usable limits
    assert "memory budget does not fit" in refused.stderr


# --- output into a closed pipe --------------------------------------------------------------------------
def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """Like ``llamagate ... | head -0``: the reader is gone before the first write."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "supervisor", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)


def test_output_into_a_closed_pipe_ends_quietly_with_the_commands_own_status(
    tmp_path: Path, setup: dict[str, Any]
) -> None:
    path = str(write(tmp_path, setup))
    port = str(free_port())
    for args, status in [
        (("plan", "--json", "--config", path), 0),
        (("plan", "--config", path), 0),
        (("config", "check", "--config", path), 0),
        (("status", "--url", f"127.0.0.1:{port}"), 2),
        (("status", "--json", "--url", f"127.0.0.1:{port}"), 2),
        (("keys", "new", "--tenant", "a"), 0),
    ]:
        done = run_into_closed_pipe(*args)
        assert done.returncode == status, (args, done.stderr)
        assert done.stderr == "", (args, done.stderr)


# --- status ---------------------------------------------------------------------------------------------
@pytest.fixture
def daemon_stub() -> Iterator[int]:
    body = {"state": "READY", "ready": True, "model": "m", "slots": 1}
    with json_stub(lambda path: (200 if path == "/readyz" else 404, body)) as port:
        yield port


def test_status_url_without_scheme_works(daemon_stub: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--url", f"127.0.0.1:{daemon_stub}"]) == 0
    assert f"http://127.0.0.1:{daemon_stub}: READY" in capsys.readouterr().out


def test_status_json_when_unreachable_is_json(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    assert main(["status", "--json", "--url", f"http://127.0.0.1:{port}"]) == 2
    body = json.loads(capsys.readouterr().out)
    assert body["reachable"] is False and body["readyz"] is None
    assert body["url"] == f"http://127.0.0.1:{port}" and "ConnectError" in body["error"]


def test_status_reads_only_the_listener_from_a_config(
    tmp_path: Path, daemon_stub: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The model's digest comes from an environment variable set only for the service: status runs
    # without it.
    monkeypatch.delenv("LLAMAGATE_TEST_MODEL_SHA", raising=False)
    monkeypatch.delenv("LLAMAGATE_URL", raising=False)
    cfg = {
        "proxy": {"host": "0.0.0.0", "port": daemon_stub},
        "llama": {"model": {"path": "/models/m.gguf", "sha256": "${LLAMAGATE_TEST_MODEL_SHA}"}},
        "tenants": [{"name": "a"}],
    }
    path = write(tmp_path, cfg)
    assert main(["status", "--json", "--config", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["url"] == f"http://127.0.0.1:{daemon_stub}"
    # A mistake in the listener itself is still reported by its path.
    cfg["proxy"]["port"] = 70000
    assert main(["status", "--config", str(write(tmp_path, cfg))]) == 2
    assert "proxy.port: must be a port number" in capsys.readouterr().err


# --- Ctrl-C ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
async def test_sigint_makes_the_daemon_exit_130_and_sigterm_0(sig: signal.Signals, code: int) -> None:
    d = make_daemon()
    task = asyncio.create_task(d._dispatch_signals())
    try:
        d._signals.put_nowait(sig)
        await asyncio.wait_for(d._stop.wait(), 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await d._close()
    assert d.exit_code == code
