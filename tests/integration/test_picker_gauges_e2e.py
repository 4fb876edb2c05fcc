"""The picker gauges against the real child's ``/slots``, on a metrics listener bound to this host's own
non-loopback address with an allow list (issue 25, item 3).

The host's address comes from ``hostname -I`` (the first IPv4 one that is not loopback). The same
listener is reached from two peers: from that address itself (the kernel's default source for a local
destination), which the allow list names, and from 127.0.0.1 (a client bound to loopback, routed through
``lo`` to the same socket), which it does not.
"""

from __future__ import annotations

import ipaddress
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from supervisor.child.spawn import free_port
from tests.integration.conftest import Daemon, DaemonFactory, wait_until

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
PICKER = (
    "llamagate_model_queued_requests",
    "llamagate_model_running_requests",
    "llamagate_model_slots",
    "llamagate_model_busy_slots",
    "llamagate_model_context_used_tokens",
    "llamagate_model_context_capacity_tokens",
    "llamagate_model_kv_cache_usage_ratio",
)
TTL_S = 0.2  # proxy.metrics.picker.DEFAULT_TTL_S: a reading older than this is fetched again


def host_address() -> str:
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False).stdout.split()
    for item in out:
        address = ipaddress.ip_address(item)
        if address.version == 4 and not address.is_loopback:
            return item
    pytest.skip("this host has no non-loopback IPv4 address (hostname -I)")


@pytest.fixture
def served(daemon_factory: DaemonFactory) -> Iterator[tuple[Daemon, str]]:
    host, port = host_address(), free_port()
    daemon = daemon_factory(
        {"proxy": {"metrics_listener": {"host": host, "port": port, "allow": [f"{host}/32"]}}}
    )
    yield daemon, f"http://{host}:{port}"


def picker_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in PICKER
    ]


def slots(daemon: Daemon) -> list[dict[str, Any]]:
    response = httpx.get(
        f"{daemon.base_url}/slots", headers={"authorization": f"Bearer {daemon.admin_key}"}, timeout=10
    )
    assert response.status_code == 200
    body = response.json()
    assert isinstance(body, list)
    return body


def test_one_series_per_model_per_metric_matching_the_childs_slots(served: tuple[Daemon, str]) -> None:
    daemon, listener = served
    client = OpenAI(base_url=daemon.base_url + "/v1", api_key=daemon.inference_key, max_retries=0)
    started = threading.Event()
    done = threading.Event()

    def long_stream() -> None:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count from one to one thousand in words."}],
            max_tokens=3000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for _ in stream:
            started.set()
            if done.is_set():
                break
        stream.close()

    worker = threading.Thread(target=long_stream, daemon=True)
    worker.start()
    try:
        assert started.wait(60), "the stream sent no chunk"
        wait_until(lambda: any(s["is_processing"] for s in slots(daemon)), "a busy slot in /slots")
        # Sandwiched between two direct reads of /slots: the gauges' fetch happens after the first (its
        # reading is older than the TTL by then) and before the second, and a decoding slot's token count
        # only grows.
        before = slots(daemon)
        time.sleep(TTL_S * 1.5)  # the cached reading is now stale: the scrape below fetches /slots again
        response = httpx.get(listener + "/metrics", timeout=10)
        after = slots(daemon)
    finally:
        done.set()
        worker.join(60)
    assert response.status_code == 200
    samples = picker_samples(response.text)
    assert sorted(name for name, _, _ in samples) == sorted(PICKER)  # exactly one series per metric
    assert all(labels == {"model": MODEL} for _, labels, _ in samples)  # one model, no tenant label
    value = {name: v for name, _, v in samples}
    assert value["llamagate_model_slots"] == len(before) == 2
    assert value["llamagate_model_context_capacity_tokens"] == sum(s["n_ctx"] for s in before)
    assert value["llamagate_model_busy_slots"] == 1 == sum(1 for s in after if s["is_processing"])
    used_before = sum(s.get("n_prompt_tokens", 0) for s in before if s["is_processing"])
    used_after = sum(s.get("n_prompt_tokens", 0) for s in after if s["is_processing"])
    assert 0 < used_before <= value["llamagate_model_context_used_tokens"] <= used_after
    assert value["llamagate_model_kv_cache_usage_ratio"] == pytest.approx(
        value["llamagate_model_context_used_tokens"] / value["llamagate_model_context_capacity_tokens"]
    )
    assert value["llamagate_model_running_requests"] == 1
    assert value["llamagate_model_queued_requests"] == 0

    # Once the stream is over: nothing busy, nothing running (again fetched after the TTL).
    wait_until(lambda: not any(s["is_processing"] for s in slots(daemon)), "the slot to be idle again")

    def idle() -> bool:
        v = {name: x for name, _, x in picker_samples(httpx.get(listener + "/metrics", timeout=10).text)}
        return v["llamagate_model_busy_slots"] == 0 and v["llamagate_model_context_used_tokens"] == 0

    wait_until(idle, "the gauges to show the idle child")


def test_the_listener_refuses_a_peer_outside_its_allow_list(served: tuple[Daemon, str]) -> None:
    _, listener = served
    # The host's own address as the peer: in the allow list.
    assert httpx.get(listener + "/metrics", timeout=10).status_code == 200
    # 127.0.0.1 as the peer, to the same socket: not in the list, answered 403 with the setting named.
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.1"), timeout=10) as loopback:
        refused = loopback.get(listener + "/metrics")
    assert refused.status_code == 403
    assert "proxy.metrics_listener.allow" in refused.text
    assert "llamagate_" not in refused.text
