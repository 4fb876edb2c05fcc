"""Conversations through the app and the fake child: the gateway chooses ``id_slot`` (spliced into the
body as the child gets it), the answer names the key, tenants never share one, a tenant's own
``id_slot`` is refused and an admin's is the child's, and a route without slots is not placed."""

from __future__ import annotations

import asyncio
import json

from proxy.settings import TenantSettings
from tests.fakes.fake_upstream import eventually
from tests.unit.proxy.conftest import ProxyFactory

OPENING = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
CHAT = {"model": "gemma-3-270m", "messages": OPENING, "max_tokens": 4}


async def test_the_gateway_places_each_turn_and_names_its_conversation(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(snapshot={"slots": 2}) as p, p.client() as c, p.client("other") as other:
        first = await c.post("/v1/chat/completions", json=CHAT)
        assert first.status_code == 200
        key = first.headers["x-llamagate-conversation"]
        sent = json.loads(p.fake.last_body)
        assert sent["id_slot"] == 1  # the highest-numbered empty slot of two
        # The next turn of the same conversation: its slot again.
        later = {
            **CHAT,
            "messages": [
                *OPENING,
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "more"},
            ],
        }
        r = await c.post("/v1/chat/completions", json=later)
        assert r.headers["x-llamagate-conversation"] == key and json.loads(p.fake.last_body)["id_slot"] == 1
        # Another conversation: the other slot, its own key.
        r = await c.post(
            "/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "other"}]}
        )
        assert r.headers["x-llamagate-conversation"] != key and json.loads(p.fake.last_body)["id_slot"] == 0
        # The same opening from another tenant is another conversation.
        r = await other.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.headers["x-llamagate-conversation"] != key
        assert p.lane.gate.placed()[1] == [False, False]


async def test_a_tenant_cannot_choose_a_slot_and_an_admin_keeps_its_own(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(snapshot={"slots": 2}) as p, p.client() as c, p.client("admin") as admin:
        r = await c.post("/v1/chat/completions", json={**CHAT, "id_slot": 0})
        assert r.status_code == 400 and "id_slot" in r.json()["error"]["message"]
        r = await admin.post("/v1/chat/completions", json={**CHAT, "id_slot": 0})
        assert r.status_code == 200 and json.loads(p.fake.last_body)["id_slot"] == 0
        # The child placed it: the map no longer claims to know what the free slots hold.
        assert p.lane.gate.placed()[0] == ["<unknown>", "<unknown>"]


async def test_a_raw_prompt_is_placed_without_a_key(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(snapshot={"slots": 2}) as p, p.client() as c:
        r = await c.post("/v1/completions", json={"model": "gemma-3-270m", "prompt": "Once", "max_tokens": 2})
        assert r.status_code == 200 and "x-llamagate-conversation" not in r.headers
        assert json.loads(p.fake.last_body)["id_slot"] == 1


async def test_a_refusal_names_the_conversation_too(proxy_factory: ProxyFactory) -> None:
    tenants = (
        TenantSettings("team", max_concurrency=1, max_queue=0),
        TenantSettings("other"),
        TenantSettings("ops"),
    )
    async with proxy_factory(snapshot={"slots": 2}, tenants=tenants) as p, p.client() as c:
        slow = asyncio.ensure_future(c.post("/v1/chat/completions", json={**CHAT, "fake_delay_ms": 400}))
        await eventually(lambda: p.lane.gate.in_flight == 1)
        refused = await c.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 429
        done = await slow
        assert refused.headers["x-llamagate-conversation"] == done.headers["x-llamagate-conversation"]
