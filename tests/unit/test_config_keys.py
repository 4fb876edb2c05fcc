"""A key made with ``config.keys`` is an entry the config loader accepts, and reads back as the same key."""

from __future__ import annotations

import yaml

from proxy.auth import key_digest
from supervisor.config.keys import ADMIN, new_key_config
from supervisor.config.load import parse_config
from supervisor.config.proxy_settings import proxy_settings


def test_a_new_key_entry_loads_back_as_the_same_key_and_holds_no_plaintext() -> None:
    admin_key, admin = new_key_config("default", ADMIN)
    plain_key, plain = new_key_config("default")
    text = yaml.safe_dump({"tenants": [{"name": "default"}], "keys": [admin, plain]})
    assert admin_key not in text and plain_key not in text
    keys = {k.key_id: k for k in proxy_settings(parse_config(text)).keys}
    assert keys[admin["id"]].digest == key_digest(admin_key)
    assert keys[admin["id"]].scopes == ADMIN
    assert keys[plain["id"]].digest == key_digest(plain_key)
    assert keys[plain["id"]].scopes == frozenset({"inference"})
    assert {k.tenant for k in keys.values()} == {"default"}
