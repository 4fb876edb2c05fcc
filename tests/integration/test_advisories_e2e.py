"""Each published llama-server advisory that a request can reach (``proxy.schema.advisories``): its
exploit's shape, sent through the door from an ordinary inference key to the real pinned child, is
refused and the child's pid never changes; a flag-only advisory is refused by the config check."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.schema.advisories import ADVISORIES
from supervisor.launch.flags import refused_extra_args
from tests.integration.conftest import DaemonFactory, process_gone

pytestmark = pytest.mark.integration


def test_every_advisorys_exploit_is_stopped_at_the_door(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    pid = d.child_pid
    assert pid is not None
    generation = d.readyz()[1]["generation"]
    sent = 0
    with httpx.Client(timeout=60.0, trust_env=False) as c:
        for advisory in ADVISORIES:
            for route, body in advisory.exploits:
                r = c.post(
                    d.base_url + route, json=body, headers={"Authorization": f"Bearer {d.inference_key}"}
                )
                where = f"{advisory.id} {route}: {r.status_code} {r.text[:300]}"
                # Refused (400 naming the field, 404 for a refused route), or answered by a child that
                # was never at risk (the n_keep/n_discard shape, within the pinned limits): never a 5xx.
                assert r.status_code < 500, where
                if r.status_code == 400:
                    error: dict[str, Any] = r.json()["error"]
                    assert error["code"] in ("invalid_field", "unknown_field"), where
                sent += 1
                assert not process_gone(pid), f"the child died: {where}"
                assert d.child_pid == pid, where
    assert sent >= 8
    code, ready = d.readyz()
    assert code == 200 and ready["generation"] == generation, ready


@pytest.mark.parametrize("flag", ["--rpc", "--rpc=127.0.0.1:50052", "--context-shift"])
def test_the_advisories_flags_are_refused_in_extra_args(flag: str) -> None:
    ((index, name, reason),) = refused_extra_args((flag, "x"))[:1]
    assert index == 0 and name == flag.split("=")[0] and reason
