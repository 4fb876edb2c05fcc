"""``cluster:``: checked field by field, and handed to the proxy as ``ClusterSettings``."""

from __future__ import annotations

import pytest

from proxy.settings import ClusterSettings
from supervisor.config.load import parse_config
from supervisor.config.proxy_settings import proxy_settings
from supervisor.errors import ConfigError


def test_no_cluster_by_default() -> None:
    assert proxy_settings(parse_config("")).cluster is None


def test_a_cluster_reaches_the_proxy() -> None:
    cfg = parse_config(
        "cluster: {redis_url: 'redis://:pw@redis:6379/1', replicas: 3, on_redis_error: refuse,"
        " lease_ttl_s: 4, probe_interval_s: 0.5}"
    )
    assert proxy_settings(cfg).cluster == ClusterSettings(
        "redis://:pw@redis:6379/1",
        replicas=3,
        on_redis_error="refuse",
        lease_ttl_s=4.0,
        socket_timeout_s=1.0,
        probe_interval_s=0.5,
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("cluster: {}", "cluster.redis_url: required"),
        ("cluster: {redis_url: 'http://redis:6379'}", "cluster.redis_url: must be a redis://"),
        ("cluster: {redis_url: 'redis://r', replicas: 0}", "cluster.replicas: must be >= 1"),
        ("cluster: {redis_url: 'redis://r', on_redis_error: wait}", "cluster.on_redis_error: must be one of"),
        ("cluster: {redis_url: 'redis://r', lease_ttl_s: 0.5}", "cluster.lease_ttl_s: must be >= 1"),
        ("cluster: {redis_url: 'redis://r', socket_timeout_s: 0}", "cluster.socket_timeout_s: must be > 0"),
        ("cluster: {redis_url: 'redis://r', probe_interval_s: 0}", "cluster.probe_interval_s: must be > 0"),
        ("cluster: {redis_url: 'redis://r', replica: 2}", "cluster.replica"),
    ],
)
def test_a_bad_cluster_is_named(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(text)
    assert problem in str(exc.value)
