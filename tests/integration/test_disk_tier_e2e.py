"""The disk tier under the slots, through the real daemon and llama-server (SmolLM2): conversations
get their history back from disk when their slot went to another one (with llama-server's RAM cache
off, the disk is the only place it can come from) and across a stop and start; a state file with one
byte changed, a file of another identity, another tenant's conversation's file are never restored; a
restore the turn does not reuse is counted and the turn is still answered; the ``/slots`` actions are
refused to every key; the disk budget holds; the tier is off with ``state_disk_mib: 0``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.config.keys import ADMIN, INFERENCE, new_key_config
from tests.helpers.exposition import sample
from tests.integration.conftest import Daemon, DaemonFactory, wait_until

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
# A short shared system prompt: what any two conversations share is a small part of either's history.
SYSTEM = "You are a helpful assistant. " + " ".join(f"Rule {i}: answer kindly." for i in range(6))
# One slot and no RAM prompt cache: a conversation's history can only come from its slot or the disk.
ONE_SLOT = {
    "llama": {"slots": 1, "prompt_cache_mib": 0},
    "tenants": [{"name": "default", "max_concurrency": 1}],
}


class Chat:
    """One conversation, named by ``X-Session-Id``; ``turn`` sends its history and keeps the answer."""

    def __init__(self, d: Daemon, name: str, key: str | None = None) -> None:
        self.d, self.name, self.key = d, name, key or d.admin_key
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"Conversation {name}: tell me about {name}. " + "Please go on. " * 60,
            },
        ]
        self.last_total = 0  # the previous turn's prompt and answer: what its state held
        self.conversation = ""  # its key, as the answer's header says

    def turn(self) -> dict[str, Any]:
        r = httpx.post(
            self.d.base_url + "/v1/chat/completions",
            json={"model": MODEL, "messages": self.messages, "max_tokens": 8, "temperature": 0},
            headers={"Authorization": f"Bearer {self.key}", "X-Session-Id": self.name},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        self.conversation = r.headers["x-llamagate-conversation"]
        answer: dict[str, Any] = r.json()
        usage = answer["usage"]
        assert answer["choices"][0]["message"]["content"] and usage["completion_tokens"] == 8
        self.messages += [
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"And then, about {self.name}? " + "Tell me more. " * 20},
        ]
        answer["reusable"] = self.last_total
        self.last_total = usage["prompt_tokens"] + usage["completion_tokens"]
        return answer


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def metric(d: Daemon, name: str, **labels: str) -> float:
    text = httpx.get(
        d.base_url + "/metrics", headers={"Authorization": f"Bearer {d.admin_key}"}, timeout=30
    ).text
    return sample(text, name, model=MODEL, **labels) or 0.0


def folder(d: Daemon) -> Path:
    disk = d.admin_identity()["models"][MODEL]["state_disk"]
    assert disk["budget_bytes"] > 0, disk
    return Path(disk["folder"])


def states(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix == ".state")


def test_conversations_get_their_history_back_from_disk(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(ONE_SLOT)
    chats = [Chat(d, "alpha"), Chat(d, "beta")]
    for _ in range(3):
        for chat in chats:
            answer = chat.turn()
            if answer["reusable"]:
                # Its slot went to the other conversation; the whole previous state came back from disk.
                assert cached(answer) >= 0.97 * answer["reusable"], answer["usage"]
    assert metric(d, "llamagate_conversation_state_restores_total", tenant="default") == 4
    assert metric(d, "llamagate_conversation_state_saves_total", tenant="default") == 5
    assert metric(d, "llamagate_prompt_tokens_by_source_total", tenant="default", source="disk") > 1000
    assert metric(d, "llamagate_conversation_state_misses_total", tenant="default") == 0
    path = folder(d)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    files = states(path)
    assert len(files) == 2 and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert "--slot-save-path" in d.log_text()
    # `llamagate status` shows what the folder holds of its budget.
    shown = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--url", d.base_url, "--key", d.admin_key],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stdout
    assert f" of 4,096 MiB in {path}" in shown, shown


def test_a_stop_and_start_keeps_the_conversations(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"llama": {"prompt_cache_mib": 0}})
    chats = [Chat(d, "alpha"), Chat(d, "beta")]
    for chat in chats:
        chat.turn()
    assert d.stop() == 0  # both slots' states saved before the child stopped
    assert len(states(folder_of_config(d))) == 2
    again = daemon_factory({"llama": {"prompt_cache_mib": 0, "state_dir": d.config["llama"]["state_dir"]}})
    for chat in chats:
        chat.d, chat.key = again, again.admin_key
        answer = chat.turn()
        assert cached(answer) >= 0.95 * answer["reusable"], answer["usage"]
    assert metric(again, "llamagate_conversation_state_restores_total", tenant="default") == 2


def folder_of_config(d: Daemon) -> Path:
    (path,) = [p for p in Path(d.config["llama"]["state_dir"]).iterdir() if p.is_dir()]
    return path


def test_a_sighup_reload_keeps_the_conversations(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"llama": {"prompt_cache_mib": 0}})
    chats = [Chat(d, "alpha"), Chat(d, "beta")]
    for chat in chats:
        chat.turn()
    generation = d.readyz()[1]["generation"]
    d.write_config({"llama": {"threads": 2}})  # a new child, the same identity (threads shape no state)
    d.signal(signal.SIGHUP)
    wait_until(lambda: d.readyz()[1].get("last_reload") is not None, "the reload", timeout=180)
    assert d.readyz()[1]["generation"] > generation
    for chat in chats:
        answer = chat.turn()
        assert cached(answer) >= 0.95 * answer["reusable"], answer["usage"]


def test_a_changed_file_and_another_tenants_file_are_never_restored(daemon_factory: DaemonFactory) -> None:
    beta_key, beta = new_key_config("beta", INFERENCE)
    admin_key, admin = new_key_config("default", ADMIN)
    d = daemon_factory(
        {
            **ONE_SLOT,
            "tenants": [
                {"name": "default", "max_concurrency": 1},
                {"name": "beta", "max_concurrency": 1, "show_cache_details": True},
            ],
            "keys": [admin, beta],  # the list replaces the fixture's: its admin key is this one
        }
    )
    d.keys["admin"] = admin_key
    alpha, other = Chat(d, "alpha"), Chat(d, "other")
    alpha.turn()
    other.turn()  # alpha's state saved
    path = folder(d)
    alpha_file = states_of(path, alpha.conversation)
    # Another tenant's conversation of the same session and history: another key, nothing of alpha's.
    spy = Chat(d, "alpha", key=beta_key)
    spy.messages = [dict(m) for m in alpha.messages]
    answer = spy.turn()
    assert spy.conversation != alpha.conversation
    assert metric(d, "llamagate_conversation_state_restores_total", tenant="beta") == 0
    assert cached(answer) < 0.5 * alpha.last_total, answer["usage"]
    other.turn()  # the spy's own state saved
    # Alpha's file and record put in place of the spy's (what a forger with the folder would try): the
    # record names alpha's tenant, and the spy's next turn restores nothing.
    _copy_state(path, alpha_file, spy.conversation)
    spy.turn()
    assert metric(d, "llamagate_conversation_state_refused_total", tenant="beta", reason="tenant") == 1
    assert metric(d, "llamagate_conversation_state_restores_total", tenant="beta") == 0
    other.turn()
    # One byte changed in alpha's file: refused, removed, its turn computed.
    data = bytearray(alpha_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    alpha_file.write_bytes(bytes(data))
    restores = metric(d, "llamagate_conversation_state_restores_total", tenant="default")
    answer = alpha.turn()
    assert metric(d, "llamagate_conversation_state_refused_total", tenant="default", reason="changed") == 1
    assert metric(d, "llamagate_conversation_state_restores_total", tenant="default") == restores
    assert not alpha_file.exists()
    assert cached(answer) < 0.5 * answer["reusable"], answer["usage"]


def states_of(path: Path, key: str) -> Path:
    (found,) = path.glob(key + ".*.state")
    return found


def _copy_state(path: Path, state: Path, key: str) -> None:
    """``state`` with its record, the key changed, as the state of ``key``."""
    old_key = state.name.split(".")[0]
    record = json.loads((path / (old_key + ".meta")).read_text())
    for old in path.glob(key + ".*.state"):
        old.unlink()
    name = f"{key}.{record['sha256'][:16]}.state"
    shutil.copyfile(state, path / name)
    record.update(key=key, file=name)
    (path / (key + ".meta")).write_text(json.dumps(record))


def test_a_file_written_for_another_context_size_is_never_restored(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"llama": {"prompt_cache_mib": 0}})
    chat = Chat(d, "alpha")
    chat.turn()
    assert d.stop() == 0
    old = folder_of_config(d)
    saved = {p.name: p.read_bytes() for p in old.iterdir()}
    assert any(name.endswith(".state") for name in saved)
    state_dir = d.config["llama"]["state_dir"]
    again = daemon_factory({"llama": {"prompt_cache_mib": 0, "state_dir": state_dir, "ctx_per_slot": 2048}})
    new = folder(again)
    # The folder of the identity no longer served stays a day after its last use (the grace period of
    # ``proxy.conversations.root``): never the new child's.
    assert new != old and old.is_dir()
    for name, data in saved.items():  # the old files put where the new child's states go
        (new / name).write_bytes(data)
    chat.d, chat.key = again, again.admin_key
    answer = chat.turn()
    assert metric(again, "llamagate_conversation_state_restores_total", tenant="default") == 0
    assert cached(answer) < 0.5 * answer["reusable"], answer["usage"]


def test_a_restore_the_turn_does_not_reuse_is_a_counted_miss_and_still_answered(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory(ONE_SLOT)
    alpha, other = Chat(d, "alpha"), Chat(d, "beta")
    alpha.turn()
    other.turn()  # alpha's state on disk
    # The client rewrites alpha's history (same session): its saved state matches only the system prompt.
    alpha.messages[1]["content"] = "Something else entirely. " * 40
    answer = alpha.turn()
    assert metric(d, "llamagate_conversation_state_restores_total", tenant="default") == 1
    assert metric(d, "llamagate_conversation_state_misses_total", tenant="default") == 1
    usage, timings = answer["usage"], answer.get("timings") or {}
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] > cached(answer)
    if timings:  # what the child did not reuse it evaluated: the whole prompt is accounted for
        assert timings["cache_n"] + timings["prompt_n"] == usage["prompt_tokens"]


@pytest.mark.parametrize("who", ["admin", "inference", "nobody"])
def test_the_slots_actions_are_refused_to_every_key(daemon_factory: DaemonFactory, who: str) -> None:
    d = daemon_factory()
    Chat(d, "alpha").turn()
    path = folder(d)
    before = sorted(p.name for p in path.iterdir())
    headers = {} if who == "nobody" else {"Authorization": f"Bearer {getattr(d, who + '_key')}"}
    for url in (
        "/slots/0?action=save",
        "/slots/0?action=restore",
        "/slots/0?action=erase",
        "/slots?id_slot=0&action=save",
        "/slots/0/?action=save",
        "/v1/slots/0?action=save",
        "/slots/%30?action=save",
    ):
        r = httpx.post(d.base_url + url, json={"filename": "x.state"}, headers=headers, timeout=30)
        assert r.status_code in (401, 403, 404, 405), (url, r.status_code, r.text)
    assert sorted(p.name for p in path.iterdir()) == before


def test_the_disk_budget_holds(daemon_factory: DaemonFactory) -> None:
    # A state of these conversations is about 6 MiB (SmolLM2: 22.5 KiB a token): room for one.
    d = daemon_factory({**ONE_SLOT, "llama": {**ONE_SLOT["llama"], "state_disk_mib": 8}})
    chats = [Chat(d, name) for name in ("a", "b", "c", "d")]
    path = folder(d)
    for chat in chats:
        chat.turn()
        held = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        assert held <= 8 * 2**20, held
    assert metric(d, "llamagate_conversation_state_evictions_total", tenant="default") >= 1
    assert len(states(path)) == 1


def test_the_tier_can_be_turned_off(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({**ONE_SLOT, "llama": {**ONE_SLOT["llama"], "state_disk_mib": 0}})
    assert d.admin_identity()["models"][MODEL]["state_disk"]["budget_bytes"] == 0
    for chat in (Chat(d, "a"), Chat(d, "b")):
        chat.turn()
    assert "--slot-save-path" not in d.log_text()
    assert not os.path.exists(d.config["llama"]["state_dir"])


def test_two_daemons_sharing_the_folder_hand_a_conversation_over(daemon_factory: DaemonFactory) -> None:
    # Replicas behind a hash share one folder (a volume): a conversation that moves keeps its state.
    first = daemon_factory(ONE_SLOT)
    shared = {**ONE_SLOT, "llama": {**ONE_SLOT["llama"], "state_dir": first.config["llama"]["state_dir"]}}
    second = daemon_factory(shared)
    alpha, other = Chat(first, "alpha"), Chat(first, "other")
    alpha.turn()
    other.turn()  # alpha's state saved by the first daemon
    alpha.d, alpha.key = second, second.admin_key  # the conversation moves to the second one
    answer = alpha.turn()
    assert cached(answer) >= 0.97 * answer["reusable"], answer["usage"]
    assert metric(second, "llamagate_conversation_state_restores_total", tenant="default") == 1
    assert folder(first) == folder(second)


def test_an_idle_unload_keeps_the_conversations(daemon_factory: DaemonFactory) -> None:
    on_demand = {"name": MODEL, "residency": "on_demand", "idle_unload_s": 1, "preload": True}
    d = daemon_factory({"llama": {"prompt_cache_mib": 0}, "models": [on_demand]})
    chats = [Chat(d, "alpha"), Chat(d, "beta")]
    for chat in chats:
        chat.turn()  # both in a slot, neither saved yet
    wait_until(lambda: not d.admin_identity()["models"][MODEL]["loaded"], "the idle unload", timeout=60)
    for chat in chats:  # loaded again by the first request: both restored from disk
        answer = chat.turn()
        assert cached(answer) >= 0.95 * answer["reusable"], answer["usage"]
    assert metric(d, "llamagate_conversation_state_restores_total", tenant="default") == 2
