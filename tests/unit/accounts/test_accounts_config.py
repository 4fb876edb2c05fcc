"""The ``store:`` section and ``tenants[].budgets`` in the configuration, and what reaches the proxy."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.settings import BudgetSettings, StoreSettings
from supervisor.config.load import load_sections, parse_config
from supervisor.config.proxy_settings import proxy_settings
from supervisor.errors import ConfigError
from supervisor.paths import default_store_path, state_root


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, env={})
    return list(info.value.problems)


def test_no_store_unless_the_config_asks_for_one() -> None:
    assert proxy_settings(parse_config("", env={})).store is None
    assert proxy_settings(parse_config("store: null\n", env={})).store is None
    assert proxy_settings(parse_config("store:\n", env={})).store is None  # an empty section is null


def test_store_settings_and_the_default_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    settings = proxy_settings(parse_config("store: {}\n", env={}))
    assert settings.store == StoreSettings(str(tmp_path / "xdg" / "llamagate" / "llamagate.db"), 31, 400)
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/llamagate")  # systemd's StateDirectory=
    assert proxy_settings(parse_config("store: {}\n", env={})).store.path == "/var/lib/llamagate/llamagate.db"  # type: ignore[union-attr]
    cfg = parse_config(
        "store: {path: db/x.db, usage_retention_days: 7, rollup_retention_days: 90}\n",
        base_dir=tmp_path,
        env={},
    )
    assert proxy_settings(cfg).store == StoreSettings(str(tmp_path / "db" / "x.db"), 7, 90)  # beside the file


def test_the_default_state_folder() -> None:
    home = Path.home()
    assert state_root({}) == home / ".local" / "state" / "llamagate"
    assert state_root({"XDG_STATE_HOME": "relative/dir"}) == home / ".local" / "state" / "llamagate"
    assert state_root({"XDG_STATE_HOME": "/s"}) == Path("/s/llamagate")
    assert state_root({"STATE_DIRECTORY": "/var/lib/llamagate:/var/lib/other"}) == Path("/var/lib/llamagate")
    assert default_store_path({"STATE_DIRECTORY": "/var/lib/llamagate"}) == Path(
        "/var/lib/llamagate/llamagate.db"
    )


def test_tenant_budgets_reach_the_proxy() -> None:
    cfg = parse_config(
        "tenants:\n"
        "  - {name: a, budgets: {tokens_per_minute: 200, tokens_per_day: 100000, requests_per_minute: 30}}\n"
        "  - {name: b}\n",
        env={},
    )
    a, b = proxy_settings(cfg).tenants
    assert a.budgets == BudgetSettings(tokens_per_minute=200, tokens_per_day=100000, requests_per_minute=30)
    assert b.budgets == BudgetSettings()


BUDGETS = "tenants: [{name: a, budgets: {%s}}]\n"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (BUDGETS % "tokens_per_minute: 0", "tenants[0].budgets.tokens_per_minute: must be >= 1"),
        (
            BUDGETS % "tokens_per_hour: 5",
            "tenants[0].budgets.tokens_per_hour: unknown key (did you mean tokens_per_day?)",
        ),
        (
            BUDGETS % "requests_per_minute: many",
            "tenants[0].budgets.requests_per_minute: must be an integer (got 'many')",
        ),
        ("store: {usage_retention_days: 0}\n", "store.usage_retention_days: must be >= 1"),
        ("store: {paht: /x.db}\n", "store.paht: unknown key (did you mean path?)"),
        ("store: {path: 5}\n", "store.path: must be a path (got 5)"),
        ("store: /x.db\n", "store: must be a mapping of keys to values"),
    ],
)
def test_bad_values_are_named_by_path(text: str, problem: str) -> None:
    assert problem in problems(text)


def test_commands_read_only_the_sections_they_need(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "llama: {model: {path: m.gguf, sha256: '${NOT_SET_HERE}'}, slots: 0}\n"
        "store: {path: s.db}\ntenants: [{name: a}]\n"
    )
    cfg = load_sections(path, ("store", "tenants"), env={})
    assert cfg.store is not None and cfg.store.path == tmp_path / "s.db"
    assert [t.name for t in cfg.tenants] == ["a"]
    path.write_text("store: {path: 1}\nllama: {slots: 0}\n")
    with pytest.raises(ConfigError) as info:
        load_sections(path, ("store", "tenants"), env={})
    assert info.value.problems == ("store.path: must be a path (got 1)",)
