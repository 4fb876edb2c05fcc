"""Config loading: one pass reports every bad field by path; env substitution; YAML errors located."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.cli import main
from supervisor.config.load import load_config, parse_config, resolve_config_path
from supervisor.config.models import served_models
from supervisor.config.proxy_settings import proxy_settings
from supervisor.config.schema import Config
from supervisor.errors import ConfigError

SHA = "a" * 64
DIGEST = "sha256:" + "b" * 64


def problems(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, env=env or {})
    return list(info.value.problems)


def test_no_config_is_the_embedded_default() -> None:
    cfg = load_config(None)
    assert cfg == Config()
    assert (cfg.proxy.host, cfg.proxy.port) == ("127.0.0.1", 8080)
    assert (cfg.llama.slots, cfg.llama.ctx_per_slot) == (2, 4096)
    assert cfg.llama.model.path is None  # the demo model
    assert [t.name for t in cfg.tenants] == ["default"]
    assert cfg.keys == ()  # a fresh key is generated at start


def test_empty_file_is_the_default() -> None:
    assert parse_config("", env={}) == Config()


def test_every_bad_field_is_reported_in_one_pass() -> None:
    found = problems(
        """
proxy:
  port: 99999
  prot: 1
llama:
  slots: 0
  ctx_per_slot: 1000
  cache_type_k: q9
tenants:
  - name: a
  - name: b
    max_concurrency: 0
keys:
  - {id: abc, digest: nope, tenant: zzz}
supervision:
  health_failures: "three"
"""
    )
    assert found == [
        "proxy.prot: unknown key (did you mean port?)",
        "proxy.port: must be a port number (1-65535)",
        "llama.slots: must be >= 1",
        "llama.ctx_per_slot: must be a multiple of 256 (>= 256)",
        "llama.cache_type_k: must be one of f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1 (got 'q9')",
        "supervision.health_failures: must be an integer (got 'three')",
        "tenants[1].max_concurrency: must be >= 1",
        "keys[0].id: must be 12 lowercase hex digits",
        "keys[0].digest: must be 'sha256:' + 64 hex",
        "keys[0].tenant: no tenant named 'zzz'",
    ]


def test_cross_field_rules() -> None:
    found = problems(
        f"""
llama:
  model: {{path: /m.gguf}}
  binary_sha256: "{SHA}"
tenants: [{{name: a}}, {{name: a}}]
proxy: {{anonymous_tenant: nobody}}
supervision: {{backoff_initial_s: 5, backoff_max_s: 1, stall_timeout_s: 400}}
"""
    )
    assert "llama.model.sha256: required when llama.model.path is set (the file is verified)" in found
    assert "llama.binary_sha256: only with llama.binary" in found
    assert "tenants[1].name: duplicate tenant 'a' (also tenants[0])" in found
    assert "proxy.anonymous_tenant: no tenant named 'nobody'" in found
    assert "supervision.backoff_max_s: must be >= supervision.backoff_initial_s" in found
    assert "supervision.stall_timeout_s: must be <= supervision.load_timeout_s" in found


def test_wrong_shapes_are_reported_not_crashed() -> None:
    found = problems("llama: [1, 2]\ntenants: {name: x}\nproxy:\n  model_aliases: alias\n")
    assert found == [
        "proxy.model_aliases: must be a list",
        "llama: must be a mapping of keys to values",
        "tenants: must be a list",
    ]
    assert problems("- 1\n- 2\n") == ["config: must be a mapping of keys to values"]
    assert problems("llama: {slots: null}\n") == ["llama.slots: must not be null"]
    assert problems("llama: {slots: true}\n") == ["llama.slots: must be an integer (got True)"]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        ("[--port, '9']", "--port"),
        ("['--api-key=x']", "--api-key"),
        ("[-c, '99']", "-c"),
        ("[--verbose]", "--verbose"),
        ("[-lv, '5']", "-lv"),
        ("[--log-prompts-dir, /tmp/x]", "--log-prompts-dir"),
        ("[-hf, some/repo]", "-hf"),
    ],
)
def test_extra_args_that_collide_with_supervisor_flags_are_refused(args: str, flag: str) -> None:
    found = problems(f"llama:\n  extra_args: {args}\n")
    assert len(found) == 1
    assert found[0].startswith(f"llama.extra_args[0]: {flag} is not allowed: ")


def test_harmless_extra_args_pass() -> None:
    cfg = parse_config("llama:\n  extra_args: [--temp, '0.7', --cache-reuse, '256']\n", env={})
    assert cfg.llama.extra_args == ("--temp", "0.7", "--cache-reuse", "256")


def test_yaml_syntax_error_has_line_and_column() -> None:
    found = problems("proxy:\n  port: 8080\n  host: [127.0.0.1\n")
    assert len(found) == 1
    assert found[0].startswith("line 4, column 1: ")


def test_duplicate_keys_are_errors() -> None:
    found = problems("llama:\n  slots: 2\n  slots: 3\n")
    assert found == ["line 3, column 3: duplicate key 'slots'"]


def test_env_substitution() -> None:
    env = {"PORT": "9000", "HEADROOM": "512", "ALIAS": "my-model", "EXIT": "true"}
    cfg = parse_config(
        """
proxy:
  port: ${PORT}
llama:
  model: {alias: "${ALIAS}"}
supervision:
  memory_headroom_mib: ${HEADROOM}
  exit_on_failed: ${EXIT}
tenants:
  - name: "t$${literal}"
""".replace("t$${literal}", "t1"),
        env=env,
    )
    assert cfg.proxy.port == 9000
    assert cfg.llama.model.alias == "my-model"
    assert cfg.supervision.memory_headroom_mib == 512
    assert cfg.supervision.exit_on_failed is True


def test_env_escape_and_missing_variable() -> None:
    cfg = parse_config('llama:\n  extra_args: ["--x", "$${NOT_A_VAR}"]\n', env={})
    assert cfg.llama.extra_args == ("--x", "${NOT_A_VAR}")
    assert problems("proxy:\n  port: ${NOPE}\n") == ["proxy.port: environment variable NOPE is not set"]


def test_relative_paths_are_relative_to_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "llamagate.yaml"
    path.parent.mkdir()
    path.write_text(f"llama:\n  model: {{path: models/m.gguf, sha256: '{SHA}'}}\n")
    cfg = load_config(path)
    assert cfg.llama.model.path == path.parent.resolve() / "models" / "m.gguf"


def test_config_path_resolution() -> None:
    assert resolve_config_path("a.yaml", env={"LLAMAGATE_CONFIG": "b.yaml"}) == Path("a.yaml")
    assert resolve_config_path(None, env={"LLAMAGATE_CONFIG": "b.yaml"}) == Path("b.yaml")
    assert resolve_config_path(None, env={}) is None


def test_unreadable_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_proxy_settings_mapping() -> None:
    cfg = parse_config(
        f"""
proxy: {{port: 9001, model_aliases: [gpt-4o], drain_timeout_s: 5}}
tenants:
  - {{name: a, max_concurrency: 3, max_queue: 4, queue_timeout_s: 2, weight: 2, max_tokens: 100}}
  - {{name: b}}
keys:
  - {{id: 0123456789ab, digest: "{DIGEST}", tenant: a, scopes: [inference, admin]}}
logging: {{access_log: false}}
""",
        env={},
    )
    s = proxy_settings(cfg)
    assert s.listen.port == 9001
    assert served_models(cfg)[0].aliases == ("gpt-4o",)  # the proxy's ModelEntry for the one model
    assert s.drain_timeout_s == 5
    assert [t.name for t in s.tenants] == ["a", "b"]
    assert s.tenants[0].max_concurrency == 3 and s.tenants[0].weight == 2 and s.tenants[0].max_tokens == 100
    assert s.keys[0].key_id == "0123456789ab" and s.keys[0].scopes == frozenset({"inference", "admin"})
    assert s.access_log is False


def test_config_check_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("llama:\n  slots: 4\n")
    assert main(["config", "check", "--config", str(good)]) == 0
    assert "ok" in capsys.readouterr().out

    bad = tmp_path / "bad.yaml"
    bad.write_text("llama:\n  slots: 0\ntenants:\n  - name: x\n    max_queue: -1\n")
    assert main(["config", "check", "--config", str(bad)]) == 2
    out = capsys.readouterr().out
    assert "llama.slots: must be >= 1" in out
    assert "tenants[0].max_queue: must be >= 0" in out


def test_example_config_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    example = Path(__file__).resolve().parents[2] / "deploy" / "config.example.yaml"
    monkeypatch.setenv("LLAMAGATE_MODEL_SHA256", SHA)
    cfg = load_config(example)
    assert cfg.tenants and cfg.keys


def _key_paths(cls: type, prefix: str = "") -> list[str]:
    import dataclasses
    import types
    import typing

    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = args[0]
        elif typing.get_origin(tp) is tuple and dataclasses.is_dataclass(args[0]):
            out.extend(_key_paths(args[0], f"{prefix}{f.name}[]."))
            continue
        if dataclasses.is_dataclass(tp):
            if f.default is None:  # an optional section is documented as a key too
                out.append(prefix + f.name)
            out.extend(_key_paths(tp, f"{prefix}{f.name}."))  # type: ignore[arg-type]
        else:
            out.append(prefix + f.name)
    return out


def test_every_key_is_in_the_reference() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    paths = _key_paths(Config)
    assert "tenants[].max_concurrency" in paths and "proxy.metrics_listener.port" in paths
    missing = [p for p in paths if f"`{p}`" not in doc]
    assert missing == []


def test_config_round_trips_through_yaml() -> None:
    import yaml

    from supervisor.config.load import config_to_dict

    cfg = parse_config(
        f"llama:\n  model: {{path: /m.gguf, sha256: '{SHA}'}}\n  extra_args: [--temp, '1']\n"
        f"keys: [{{id: 0123456789ab, digest: '{DIGEST}', scopes: [admin]}}]\n",
        env={},
    )
    assert parse_config(yaml.safe_dump(config_to_dict(cfg)), env={}) == cfg


def test_a_key_that_is_a_list_or_a_mapping_is_a_problem_not_a_crash() -> None:
    assert problems("? [a, b]\n: 1\n") == ["line 1, column 3: found unhashable key"]
    assert problems("llama:\n  ? {a: 1}\n  : x\n") == ["line 2, column 5: found unhashable key"]


def test_yaml_merge_keys_work_and_explicit_keys_win() -> None:
    cfg = parse_config(
        "tenants:\n"
        "  - &base {name: a, max_concurrency: 1, max_queue: 4}\n"
        "  - {<<: *base, name: b, max_queue: 9}\n"
    )
    assert [(t.name, t.max_concurrency, t.max_queue) for t in cfg.tenants] == [("a", 1, 4), ("b", 1, 9)]
    # A key repeated explicitly is still an error, merge or not.
    assert problems("tenants:\n  - {name: a, <<: {weight: 2}, name: b}\n") == [
        "line 2, column 32: duplicate key 'name'"
    ]


def test_a_substitution_form_we_do_not_support_is_a_problem_not_a_literal() -> None:
    # Shell habits (${VAR:-default}, ${VAR?}) would otherwise pass through as literal text.
    assert problems('proxy:\n  model_aliases: ["${ALIAS:-gemma}"]\n', env={"ALIAS": "x"}) == [
        "proxy.model_aliases[0]: unsupported substitution ${ALIAS:-gemma} (only ${NAME}; $$ for a literal $)"
    ]
