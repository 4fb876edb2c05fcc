"""Keys: format, digests, constant-time check, O(1) lookup by id, scopes, anonymous loopback tenant."""

from __future__ import annotations

import re

import pytest

from proxy import auth
from proxy.auth import KeyTable, key_digest, new_key, require
from proxy.errors import Forbidden, Unauthorized


def test_new_key_format_and_entry() -> None:
    key, entry = new_key("team", frozenset({"inference"}))
    assert re.fullmatch(r"lg_[0-9a-f]{12}_[A-Za-z0-9_-]{43}", key)
    assert entry.key_id == key[3:15]
    assert entry.digest == key_digest(key)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", entry.digest)
    assert key not in repr(entry)  # the entry never holds the key
    assert entry.tenant == "team" and entry.scopes == frozenset({"inference"})


def test_keys_are_unique() -> None:
    keys = {new_key("t", frozenset({"inference"}))[0] for _ in range(200)}
    assert len(keys) == 200


def table() -> tuple[KeyTable, str, str]:
    user, user_entry = new_key("team", frozenset({"inference"}))
    admin, admin_entry = new_key("ops", frozenset({"inference", "admin"}))
    return KeyTable([user_entry, admin_entry]), user, admin


def test_valid_key_resolves_to_its_tenant_and_scopes() -> None:
    keys, user, admin = table()
    principal = keys.authenticate(f"Bearer {user}".encode(), "10.0.0.1")
    assert principal.tenant == "team" and principal.key_id == user[3:15]
    assert keys.authenticate(f"bearer {admin}".encode(), None).scopes == frozenset({"inference", "admin"})


@pytest.mark.parametrize(
    "header",
    [
        None,
        b"",
        b"Basic dXNlcjpwYXNz",
        b"Bearer",
        b"Bearer ",
        b"Bearer sk-not-ours",
        b"Bearer lg_0123456789ab_short",
    ],
)
def test_missing_or_malformed_credentials_are_401(header: bytes | None) -> None:
    keys, _, _ = table()
    with pytest.raises(Unauthorized) as info:
        keys.authenticate(header, "127.0.0.1")
    assert info.value.status == 401
    assert info.value.headers["www-authenticate"].startswith("Bearer")


def test_unknown_and_revoked_keys_are_401() -> None:
    keys, user, _ = table()
    stranger, _ = new_key("team", frozenset({"inference"}))
    with pytest.raises(Unauthorized):
        keys.authenticate(f"Bearer {stranger}".encode(), None)
    # Right id, wrong secret (a guessed or tampered key).
    forged = user[:16] + ("A" if user[16] != "A" else "B") + user[17:]
    with pytest.raises(Unauthorized):
        keys.authenticate(f"Bearer {forged}".encode(), None)
    # Revoked: absent from the reloaded configuration.
    reloaded = KeyTable([])
    with pytest.raises(Unauthorized):
        reloaded.authenticate(f"Bearer {user}".encode(), None)


def test_digest_comparison_is_constant_time_and_runs_for_unknown_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []

    def spy(a: str, b: str) -> bool:
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys, user, _ = table()
    stranger, _ = new_key("x", frozenset({"inference"}))
    keys.authenticate(f"Bearer {user}".encode(), None)
    with pytest.raises(Unauthorized):
        keys.authenticate(f"Bearer {stranger}".encode(), None)
    assert len(calls) == 2


def test_error_messages_never_echo_the_key() -> None:
    keys, user, _ = table()
    stranger, _ = new_key("team", frozenset({"inference"}))
    for header in (f"Bearer {stranger}", f"Token {user}", f"Bearer {user}x"):
        with pytest.raises(Unauthorized) as info:
            keys.authenticate(header.encode(), None)
        assert stranger not in info.value.message and user not in info.value.message


def test_scope_check() -> None:
    keys, user, admin = table()
    with pytest.raises(Forbidden) as info:
        require(keys.authenticate(f"Bearer {user}".encode(), None), "admin")
    assert info.value.status == 403
    require(keys.authenticate(f"Bearer {admin}".encode(), None), "admin")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "127.0.0.5"])
def test_anonymous_tenant_only_for_loopback_and_only_without_credentials(host: str) -> None:
    user, entry = new_key("team", frozenset({"inference"}))
    keys = KeyTable([entry], anonymous_tenant="dev")
    principal = keys.authenticate(None, host)
    assert principal.tenant == "dev" and principal.scopes == frozenset({"inference"})
    with pytest.raises(Unauthorized):
        keys.authenticate(b"Bearer lg_nope", host)  # bad credentials are not "no credentials"
    assert keys.authenticate(f"Bearer {user}".encode(), host).tenant == "team"


@pytest.mark.parametrize("host", ["10.1.2.3", "192.168.0.2", None, "", "unix-socket"])
def test_anonymous_tenant_refused_off_loopback(host: str | None) -> None:
    keys = KeyTable([], anonymous_tenant="dev")
    with pytest.raises(Unauthorized):
        keys.authenticate(None, host)


def test_anonymous_tenant_is_off_by_default() -> None:
    with pytest.raises(Unauthorized):
        KeyTable([]).authenticate(None, "127.0.0.1")


@pytest.mark.parametrize("placeholder", ["sk-no-key-required", "EMPTY", "x", "sk-ant-placeholder"])
def test_sdk_placeholder_token_is_anonymous_from_loopback_only(placeholder: str) -> None:
    """The OpenAI and Anthropic SDKs always send a key; a token not shaped like ours is their placeholder."""
    keys = KeyTable([], anonymous_tenant="dev")
    header = f"Bearer {placeholder}".encode()
    assert keys.authenticate(header, "127.0.0.1").tenant == "dev"
    assert keys.authenticate(header, "::1").key_id == "anonymous"
    for host in ("10.1.2.3", None):
        with pytest.raises(Unauthorized, match="malformed API key"):
            keys.authenticate(header, host)
    with pytest.raises(Unauthorized):  # without the anonymous tenant: a placeholder is just a bad key
        KeyTable([]).authenticate(header, "127.0.0.1")


@pytest.mark.parametrize(
    "token", ["lg_nope", "lg_0123456789ab_short", "lg_" + "a" * 60, "lg_000000000000_" + "A" * 43]
)
def test_malformed_or_unknown_llamagate_key_stays_401_in_anonymous_mode(token: str) -> None:
    keys = KeyTable([], anonymous_tenant="dev")
    with pytest.raises(Unauthorized):
        keys.authenticate(f"Bearer {token}".encode(), "127.0.0.1")
