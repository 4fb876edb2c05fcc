"""A several-model daemon's /metrics carry each model as ``model``, against the real llama-server and the
demo model loaded twice ("chat" always, "embed" on_demand with embeddings): the supervisor's series (an
unloaded on_demand model reads UNLOADED, then READY once a request has loaded it), the proxy's request
series and each model's own admission gauges, through one key, with the openai SDK as the client."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Daemon, DaemonFactory
from tests.integration.test_multi_model_e2e import client, open_stream, two_models

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(d: Daemon) -> Samples:
    r = httpx.get(f"{d.base_url}/metrics", headers={"Authorization": f"Bearer {d.admin_key}"}, timeout=60)
    r.raise_for_status()
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def models_of(samples: Samples, name: str) -> set[str]:
    return {dict(labels)["model"] for n, labels in samples if n == name}


def test_every_series_carries_its_model(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(two_models(daemon_factory, residency="on_demand", idle_unload_s=3600))
    s = scrape(d)
    assert value(s, "llamagate_child_state", model="chat", state="READY") == 1
    assert value(s, "llamagate_child_state", model="embed", state="UNLOADED") == 1
    assert value(s, "llamagate_child_state", model="embed", state="STOPPED") == 0
    assert value(s, "llamagate_slots", model="chat") == 1
    assert value(s, "llamagate_slots", model="embed") == 1
    assert models_of(s, "llamagate_child_resident_memory_bytes") == {"chat"}  # embed has no child yet

    tenant = "default"
    with client(d) as c:
        # While a chat stream holds the chat model's one slot, the gauge shows it on that model only;
        # an embeddings request to the other model loads it and is answered meanwhile.
        # Long enough to be running at the scrape, on a loaded machine too (48 tokens once ended first).
        chunks = open_stream(c, "chat", "Tell a long story about a lighthouse.", 400)
        assert next(chunks).model == "chat"
        s = scrape(d)
        assert value(s, "llamagate_in_flight_requests", model="chat", tenant=tenant) == 1
        vector = c.embeddings.create(model="embed", input="a document about llamas").data[0].embedding
        assert len(vector) > 0
        assert list(chunks)

    s = scrape(d)
    for name, route in (("chat", "/v1/chat/completions"), ("embed", "/v1/embeddings")):
        answered = {"tenant": tenant, "model": name, "route": route, "status": "200"}
        assert value(s, "llamagate_requests_total", **answered) == 1, name
        assert value(s, "llamagate_child_state", model=name, state="READY") == 1, name
        assert value(s, "llamagate_in_flight_requests", model=name, tenant=tenant) == 0, name
        assert value(s, "llamagate_slots", model=name) == 1, name
        assert (value(s, "llamagate_child_ready_seconds", model=name) or 0) > 0, name
    assert value(s, "llamagate_child_state", model="embed", state="UNLOADED") == 0
    assert (value(s, "llamagate_time_to_first_token_seconds_count", tenant=tenant, model="chat") or 0) >= 1
    # The loaded on_demand model now has a child of its own; each model its own served info.
    assert models_of(s, "llamagate_child_resident_memory_bytes") == {"chat", "embed"}
    assert models_of(s, "llamagate_served_info") == {"chat", "embed"}
    assert models_of(s, "llamacpp_tokens_predicted_total") >= {"chat"}
    # The host's figures once, without a model.
    assert [labels for n, labels in s if n == "llamagate_host_memory_available_bytes"] == [frozenset()]
