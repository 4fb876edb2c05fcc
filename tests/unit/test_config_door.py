"""The front door's settings: validated by path, mapped onto the proxy's ``DoorSettings``."""

from __future__ import annotations

import pytest

from proxy.settings import DoorSettings
from supervisor.config.load import parse_config
from supervisor.config.proxy_settings import proxy_settings
from supervisor.errors import ConfigError


def test_defaults_trust_no_forwarder_and_map_onto_the_proxy() -> None:
    door = proxy_settings(parse_config("", env={})).door
    assert door == DoorSettings()
    assert door.forwarded_allow_ips == ()


def test_every_door_setting_reaches_the_proxy() -> None:
    cfg = parse_config(
        "proxy:\n"
        "  forwarded_allow_ips: ['10.0.0.0/8', '::1']\n"
        "  max_request_line_bytes: 4096\n"
        "  max_head_bytes: 16384\n"
        "  max_headers: 50\n"
        "  head_timeout_s: 3\n"
        "  keep_alive_timeout_s: 2.5\n"
        "  max_connections: 64\n",
        env={},
    )
    assert proxy_settings(cfg).door == DoorSettings(
        max_request_line_bytes=4096,
        max_head_bytes=16384,
        max_headers=50,
        head_timeout_s=3,
        keep_alive_timeout_s=2.5,
        max_connections=64,
        forwarded_allow_ips=("10.0.0.0/8", "::1"),
    )


@pytest.mark.parametrize(
    ("yaml_text", "path"),
    [
        ("proxy:\n  forwarded_allow_ips: ['not-an-ip']\n", "proxy.forwarded_allow_ips"),
        ("proxy:\n  max_head_bytes: 10\n", "proxy.max_head_bytes"),
        ("proxy:\n  max_connections: 0\n", "proxy.max_connections"),
        ("proxy:\n  head_timeout_s: 0\n", "proxy.head_timeout_s"),
    ],
)
def test_bad_values_are_named_by_path(yaml_text: str, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(yaml_text, env={})
    assert any(p.startswith(path) for p in info.value.problems), info.value.problems
