"""``llamagate keys new`` prints a key once and config lines whose digest authenticates exactly that key."""

from __future__ import annotations

import io

import pytest
import yaml

from proxy.auth import KeyTable
from proxy.settings import KeyEntry
from supervisor.cli import main


def entries(text: str) -> list[KeyEntry]:
    block = text[text.index("  - id:") :]
    out = []
    for item in yaml.safe_load(block):
        out.append(KeyEntry(item["id"], item["digest"], item["tenant"], frozenset(item["scopes"])))
    return out


def test_new_key_round_trip(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "new", "--tenant", "team", "--admin"]) == 0
    out = capsys.readouterr().out
    key = out.splitlines()[0].split()[-1]
    (entry,) = entries(out)
    assert entry.tenant == "team" and entry.scopes == frozenset({"inference", "admin"})
    assert key not in out[out.index("  - id:") :]  # the config lines hold the digest only
    principal = KeyTable([entry]).authenticate(f"Bearer {key}".encode(), None)
    assert principal.tenant == "team"


def test_inference_only_by_default_and_admin_only(capsys: pytest.CaptureFixture[str]) -> None:
    main(["keys", "new", "--tenant", "team"])
    assert entries(capsys.readouterr().out)[0].scopes == frozenset({"inference"})
    main(["keys", "new", "--tenant", "mon", "--admin-only"])
    assert entries(capsys.readouterr().out)[0].scopes == frozenset({"admin"})


def test_hash_reads_the_key_from_stdin(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    main(["keys", "new", "--tenant", "team"])
    key = capsys.readouterr().out.splitlines()[0].split()[-1]
    monkeypatch.setattr("sys.stdin", io.StringIO(key + "\n"))
    assert main(["keys", "hash", "--tenant", "team"]) == 0
    (entry,) = entries(capsys.readouterr().out)
    assert KeyTable([entry]).authenticate(f"Bearer {key}".encode(), None).key_id == key[3:15]
    monkeypatch.setattr("sys.stdin", io.StringIO("not-a-key\n"))
    assert main(["keys", "hash", "--tenant", "team"]) == 2


def test_bad_tenant_name_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "new", "--tenant", "has space"]) == 2
    assert "--tenant" in capsys.readouterr().err
