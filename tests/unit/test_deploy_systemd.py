"""deploy/systemd/llamagate.service: checked by systemd's own tools and against the code it drives."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from supervisor.cli import build_parser
from supervisor.config.schema import Config
from supervisor.errors import ConfigError
from tests.helpers.system import require_tool

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "systemd" / "llamagate.service"
SYSUSERS = REPO / "deploy" / "systemd" / "llamagate.sysusers"
MAX_EXPOSURE = 2.5
# Directives whose absence makes `systemd-analyze security` rate a unit worse; used to prove the
# exposure check can fail.
HARDENING_PREFIXES = (
    "Protect",
    "Private",
    "Restrict",
    "SystemCall",
    "Capability",
    "NoNewPrivileges",
    "User=",
)


def systemd_analyze() -> str:
    return require_tool("systemd-analyze")


def directives(text: str) -> dict[str, list[str]]:
    """``Key`` -> every value it is given (systemd allows repeats, e.g. SystemCallFilter=)."""
    out: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def seconds(value: str) -> float:
    """A systemd time span such as ``90s``, ``10min`` or ``1min 30s``."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total


def installable_copy(tmp_path: Path, text: str) -> Path:
    """The unit with ExecStart pointing at an executable that exists, as verify demands."""
    exe = tmp_path / "bin" / "llamagate"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    unit = tmp_path / "llamagate.service"
    unit.write_text(text.replace("/opt/llamagate/bin/llamagate", str(exe)))
    return unit


def exposure(unit: Path) -> float:
    result = subprocess.run(
        [systemd_analyze(), "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", result.stdout)
    assert match, f"no exposure level in output:\n{result.stdout}\n{result.stderr}"
    return float(match.group(1))


@pytest.fixture(scope="module")
def unit_text() -> str:
    return UNIT.read_text()


@pytest.mark.needs_tool("systemd-analyze")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path, unit_text: str) -> None:
    unit = installable_copy(tmp_path, unit_text)
    result = subprocess.run(
        [systemd_analyze(), "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    ours = [line for line in (result.stdout + result.stderr).splitlines() if unit.name in line]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


@pytest.mark.needs_tool("systemd-analyze")
def test_security_exposure_is_at_most_2_5(tmp_path: Path, unit_text: str) -> None:
    level = exposure(installable_copy(tmp_path, unit_text))
    assert level <= MAX_EXPOSURE, f"exposure {level} > {MAX_EXPOSURE}: check `systemd-analyze security`"
    # The guides quote the rating; keep them honest.
    for doc in ("deploy.md", "security.md"):
        quoted = re.findall(r"rates (?:it|the unit)\s+(\d+\.\d)", (REPO / "docs" / doc).read_text())
        assert quoted == [f"{level:.1f}"], f"docs/{doc} quotes {quoted}, systemd-analyze says {level}"


@pytest.mark.needs_tool("systemd-analyze")
def test_exposure_check_fails_for_an_unhardened_unit(tmp_path: Path, unit_text: str) -> None:
    weakened = "\n".join(line for line in unit_text.splitlines() if not line.startswith(HARDENING_PREFIXES))
    assert exposure(installable_copy(tmp_path, weakened)) > MAX_EXPOSURE


def test_notify_watchdog_and_stop_fit_the_daemon(unit_text: str) -> None:
    d = directives(unit_text)
    defaults = Config()
    assert d["Type"] == ["notify"]
    assert d["NotifyAccess"] == ["main"]
    assert seconds(d["WatchdogSec"][0]) > 0
    # SIGTERM to the daemon alone, so it drains and stops the child itself ...
    assert d["KillMode"] == ["mixed"]
    # ... with time for the drain plus the child's grace before systemd's SIGKILL.
    assert (
        seconds(d["TimeoutStopSec"][0]) > defaults.proxy.drain_timeout_s + defaults.supervision.stop_grace_s
    )
    assert seconds(d["TimeoutStartSec"][0]) > defaults.supervision.load_timeout_s


def test_restart_policy_leaves_the_child_to_the_daemon(unit_text: str) -> None:
    d = directives(unit_text)
    # The daemon restarts its child; systemd restarts the daemon only when it exits non-zero ...
    assert d["Restart"] == ["on-failure"]
    # ... never for a configuration error, which a restart cannot fix ...
    assert str(ConfigError([]).exit_code) in d["RestartPreventExitStatus"][0].split()
    # ... within limits, and an OOM kill of the child does not stop the whole service.
    assert int(d["StartLimitBurst"][0]) >= 1 and seconds(d["StartLimitIntervalSec"][0]) > 0
    assert d["OOMPolicy"] == ["continue"]


def test_exec_start_is_a_real_command_line(unit_text: str) -> None:
    d = directives(unit_text)
    argv = shlex.split(d["ExecStart"][0])
    assert argv[0] == "/opt/llamagate/bin/llamagate"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and callable(args.func)
    assert argv[argv.index("--config") + 1].startswith("/etc/llamagate/")


def test_directories_and_user(unit_text: str) -> None:
    d = directives(unit_text)
    assert d["User"][0] not in ("root", "0")
    assert f"LLAMAGATE_CACHE_DIR=/var/cache/{d['CacheDirectory'][0]}" in d["Environment"]
    assert d["ConfigurationDirectory"] == ["llamagate"]
    # The accounts store's default file lives in the state directory: the service user's alone.
    assert d["StateDirectory"] == ["llamagate"] and d["StateDirectoryMode"] == ["0700"]
    # The secrets file is optional ("-") and read by systemd as root before privileges drop.
    assert d["EnvironmentFile"][0].startswith("-/etc/llamagate/")
    # The static user the unit names is the one the sysusers file creates.
    assert re.search(rf"^u\s+{d['User'][0]}\s", SYSUSERS.read_text(), re.MULTILINE)
