"""Every configuration mistake is a ``path: message`` line and exit 2, never a traceback.

A table, not random fuzzing: every field the schema has (sections, nested sections, list items) is
set in turn to each of the shapes a hurried edit produces (null, an empty list or string, 0, a list
of nulls, ...). Each must load or be refused by its path; a config that loads must also map to the
proxy's settings, which reads every section.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor.cli import main
from supervisor.config.load import load_config, parse_config
from supervisor.config.proxy_settings import proxy_settings
from supervisor.config.schema import Config
from supervisor.errors import ConfigError

SHAPES: tuple[Any, ...] = (
    None,
    [],
    "",
    0,
    -1,
    [None],
    {},
    "x",
    True,
    1.5,
    [[]],
    {"a": None},
    float("inf"),
    float("nan"),
    2**70,
    "${LLAMAGATE_TEST_UNSET_VARIABLE}",
)


def _field_paths(cls: type, prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every settable place in the schema, as a path of keys (and 0 for the first list item)."""
    out: list[tuple[str | int, ...]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        here = (*prefix, f.name)
        out.append(here)
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType) and inner:
            tp = inner[0]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            out.extend(_field_paths(tp, here))
        elif typing.get_origin(tp) is tuple:
            item = typing.get_args(tp)[0]
            if dataclasses.is_dataclass(item) and isinstance(item, type):
                out.append((*here, 0))
                out.extend(_field_paths(item, (*here, 0)))
    return out


def _nest(path: tuple[str | int, ...], value: Any) -> Any:
    for key in reversed(path):
        value = [value] if isinstance(key, int) else {key: value}
    return value


def _dotted(path: tuple[str | int, ...]) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


PATHS = _field_paths(Config)


def test_the_table_covers_every_section_and_list_item() -> None:
    dotted = {_dotted(p) for p in PATHS}
    assert {
        "proxy",
        "llama",
        "llama.model",
        "supervision",
        "tenants",
        "tenants[0]",
        "keys",
        "keys[0]",
    } <= dotted
    assert {"proxy.timeouts.total_s", "proxy.metrics_listener.port", "keys[0].scopes"} <= dotted


@pytest.mark.parametrize("path", PATHS, ids=_dotted)
def test_every_field_set_to_every_bad_shape_loads_or_names_its_path(path: tuple[str | int, ...]) -> None:
    where = _dotted(path)
    for shape in SHAPES:
        text = yaml.safe_dump(_nest(path, shape))
        try:
            cfg = parse_config(text, env={})
        except ConfigError as exc:
            assert exc.problems, text
            # The problem is named by the field's path (or by a rule about the section around it).
            section = where.split(".")[0].split("[")[0]
            assert any(p.startswith(section) for p in exc.problems), (text, exc.problems)
            assert all(": " in p for p in exc.problems), exc.problems
            continue
        proxy_settings(cfg, ())  # reads every section the proxy uses: no None where a value must be


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("proxy:\n", "proxy: is empty (null)"),
        ("llama: null\n", "llama: is empty (null)"),
        ("llama:\n  model:\n", "llama.model: is empty (null)"),
        ("supervision:\n", "supervision: is empty (null)"),
        ("tenants:\n", "tenants: is empty (null)"),
        ("keys:\n", "keys: is empty (null)"),
        ("tenants: [null]\n", "tenants[0]: is empty (null)"),
        ("keys: [null]\n", "keys[0]: is empty (null)"),
        ("llama:\n  extra_args: [null]\n", "llama.extra_args[0]: must not be null"),
        ("proxy:\n  timeouts:\n", "proxy.timeouts: is empty (null)"),
        ("supervision:\n  load_timeout_s: .inf\n", "supervision.load_timeout_s: must be a finite number"),
        ("llama:\n  slots: 100000000000000000000\n", "llama.slots: is too large"),
    ],
)
def test_config_check_reports_the_issue_examples_by_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["config", "check", "--offline", "--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert expected in captured.out
    assert "Traceback" not in captured.out + captured.err


def test_a_byte_that_is_not_utf8_is_located(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"proxy:\n  host: caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == ("line 2, column 12: byte 0xe9 is not UTF-8 (save the file as UTF-8)",)
    assert main(["config", "check", "--offline", "--config", str(path)]) == 2
    assert "byte 0xe9 is not UTF-8" in capsys.readouterr().out
    # serve and plan load the same way: exit 2 with the message, before anything starts.
    assert main(["serve", "--config", str(path)]) == 2
    assert main(["plan", "--config", str(path)]) == 2
    assert "byte 0xe9 is not UTF-8" in capsys.readouterr().err
