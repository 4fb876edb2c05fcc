"""Log lines an operator can read: reload changes field by field, failures in the child's own words,
no GPU notice leading the tail of a CPU child, one text record per line."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.child.log import first_error, is_noise
from supervisor.child.machine import State
from supervisor.config.diff import diff
from supervisor.config.load import parse_config
from supervisor.daemon.service import Daemon
from supervisor.logs import JsonFormatter, TextFormatter
from tests.unit.test_daemon import one_model
from tests.unit.test_process_driver import SPEC, FakeOs, FakeProbes, make, settle, start

DIGEST_A = "sha256:" + "a" * 64
DIGEST_B = "sha256:" + "b" * 64

BASE = f"""
tenants:
  - {{name: alpha, max_queue: 4}}
  - {{name: beta, max_queue: 1}}
keys:
  - {{id: "3f9a1c2b7d4e", digest: "{DIGEST_A}", tenant: alpha}}
  - {{id: "9b2e4d6f8a0c", digest: "{DIGEST_B}", tenant: beta, scopes: [inference]}}
"""

CHANGED = f"""
proxy: {{timeouts: {{total_s: 60}}, metrics_listener: {{port: 9999}}}}
llama: {{extra_args: [--cache-reuse, "256"]}}
tenants:
  - {{name: beta, max_queue: 0}}
  - {{name: gamma}}
keys:
  - {{id: "9b2e4d6f8a0c", digest: "{DIGEST_A}", tenant: beta, scopes: [inference, admin]}}
"""


def test_reload_changes_are_listed_field_by_field() -> None:
    lines = diff(parse_config(BASE, env={}), parse_config(CHANGED, env={}))
    assert lines == [
        "proxy.timeouts.total_s: 900.0 -> 60.0",
        "proxy.metrics_listener: null -> {host: 127.0.0.1, port: 9999, allow: [127.0.0.0/8, ::1/128]}",
        "llama.extra_args: [] -> [--cache-reuse, 256]",
        "tenants: removed alpha",
        "tenants: added gamma",
        "tenants.beta.max_queue: 1 -> 0",
        "keys: removed 3f9a1c2b7d4e",
        "keys.9b2e4d6f8a0c.digest: changed",
        "keys.9b2e4d6f8a0c.scopes: [inference] -> [inference, admin]",
    ]
    text = "\n".join(lines)
    assert "a" * 64 not in text and "b" * 64 not in text  # never a digest
    assert "Config(" not in text  # never a Python object


def test_a_reordered_list_is_not_a_change_of_its_items() -> None:
    old = parse_config(BASE, env={})
    new = replace(old, tenants=tuple(reversed(old.tenants)))
    assert diff(old, new) == ["tenants: reordered"]
    assert diff(old, old) == []


async def test_sighup_logs_the_field_by_field_diff(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(BASE)
    cfg = parse_config(BASE, env={})
    d = Daemon(cfg, one_model(cfg), config_path=path, child_os=FakeOs(), probes=FakeProbes())
    try:
        path.write_text(
            BASE.replace("max_queue: 1", "max_queue: 0").replace(
                f'  - {{id: "3f9a1c2b7d4e", digest: "{DIGEST_A}", tenant: alpha}}\n', ""
            )
        )
        with caplog.at_level(logging.INFO, logger="llamagate.daemon"):
            await d.reload()
    finally:
        await d._close()
    [record] = [r for r in caplog.records if r.getMessage() == "SIGHUP: configuration reloaded"]
    changes = record.fields["changes"]  # type: ignore[attr-defined]
    assert changes == "tenants.beta.max_queue: 1 -> 0; keys: removed 3f9a1c2b7d4e"
    assert "a" * 64 not in caplog.text and "TenantConfig(" not in caplog.text


GPU_NOTICE = (
    "warning: no usable GPU found, --gpu-layers option will be ignored\n"
    "warning: one possible reason is that llama.cpp was compiled without GPU support\n"
    "warning: consult docs/build.md for compilation instructions\n"
)


async def test_a_child_that_exits_during_load_is_failed_in_its_own_words(tmp_path: Path) -> None:
    os_, probes = FakeOs(), FakeProbes()
    probes.health_status = 503  # loading: the gate waits
    sup = make(os_, probes, tmp_path)
    from supervisor.child.machine import Start

    await sup.dispatch(Start())
    child = os_.children[0]
    # What the pinned llama-server prints for an unknown flag with -ngl 0 (seen), then exit 1.
    child.say(GPU_NOTICE + "error: invalid argument: --bogus-flag\n")
    child.exit(1)
    await settle(sup)
    assert sup.state is State.BACKOFF
    expected = "exited during load: exited with code 1: error: invalid argument: --bogus-flag"
    assert sup.machine.last_failure == expected
    assert expected in (sup.snapshot().reason or "")  # what /readyz and `status` show
    assert list(sup.tail) == ["error: invalid argument: --bogus-flag"]  # no GPU notice in front


async def test_the_gpu_notice_stays_when_layers_are_offloaded(tmp_path: Path) -> None:
    os_, probes = FakeOs(), FakeProbes()
    sup = make(os_, probes, tmp_path)
    sup.template = SPEC.with_llama(gpu_layers=10)
    await start(sup)
    os_.children[0].say(GPU_NOTICE)
    os_.children[0].exit(2)
    await settle(sup)
    assert sup.tail[0].startswith("warning: no usable GPU found")
    assert sup.machine.last_failure == "exited with code 2"  # a warning is not an error line


def test_first_error_is_the_root_cause_without_time_and_level() -> None:
    tail = [
        "0.00.013.107 I srv    load_model: loading model '/m.gguf'",
        "0.00.013.224 E gguf_init_from_file: failed to open GGUF file '/m.gguf' (No such file or directory)",
        "0.00.013.766 E srv  llama_server: exiting due to model loading error",
    ]
    assert (
        first_error(tail)
        == "gguf_init_from_file: failed to open GGUF file '/m.gguf' (No such file or directory)"
    )
    assert first_error(["0.00.01.000 I srv  fine"]) is None
    assert first_error(["error: " + "x" * 1000])[-3:] == "..."  # type: ignore[index]
    assert is_noise("warning: consult docs/build.md for compilation instructions", gpu_layers=0)
    assert not is_noise("warning: consult docs/build.md for compilation instructions", gpu_layers=1)


def _record(msg: str, **fields: object) -> logging.LogRecord:
    try:
        raise ValueError("first line\nsecond line")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("llamagate.test", logging.WARNING, __file__, 1, msg, None, exc_info)
    record.fields = fields
    return record


def test_a_text_record_is_one_line() -> None:
    record = _record("llama-server BACKOFF\n(restarting)", child_log_tail="line one\nline two\r\n")
    text = TextFormatter().format(record)
    assert "\n" not in text and "\r" not in text
    assert "llama-server BACKOFF\\n(restarting)" in text
    assert "child_log_tail=line one\\nline two\\r\\n" in text
    assert "ValueError: first line\\nsecond line" in text and "Traceback" in text


def test_a_json_record_keeps_its_text() -> None:
    record = _record("a\nb", tail="x\ny")
    out = json.loads(JsonFormatter().format(record))
    assert (out["msg"], out["tail"]) == ("a\nb", "x\ny")
