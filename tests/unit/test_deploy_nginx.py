"""deploy/nginx/llamagate.conf: the rules the scale-out story depends on, and the renderer the tests use."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from supervisor.bench.commands.scaleout import verdict
from supervisor.bench.nginx import SHIPPED_CONF, main_conf, nginx_binary, render_site
from supervisor.config.schema import TimeoutsConfig
from supervisor.errors import UsageError

SHIPPED = SHIPPED_CONF.read_text(encoding="utf-8")


def directives(text: str) -> list[str]:
    """Directive lines without comments, whitespace folded."""
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(" ".join(line.split()))
    return out


def test_shipped_config_hashes_conversations_and_retries_only_refusals() -> None:
    d = directives(SHIPPED)
    # A conversation's turns to one replica, by the id the shipped script computes from the request.
    assert "hash $llamagate_conversation consistent;" in d
    assert "js_set $llamagate_conversation llamagate_conversation.id;" in d
    assert "js_import llamagate_conversation from conf.d/llamagate-conversation.js;" in d
    # The id is read from the body: it must be in one memory buffer, as large as the largest body.
    assert "client_body_in_single_buffer on;" in d
    assert "client_body_buffer_size 16m;" in d and "client_max_body_size 16m;" in d
    assert "proxy_next_upstream error timeout http_429 http_503 non_idempotent;" in d
    # Bounded: one try per replica (3 in the shipped example), and a time bound.
    assert "proxy_next_upstream_tries 3;" in d
    assert any(x.startswith("proxy_next_upstream_timeout ") for x in d)
    # Streaming passes through; the request body is buffered so that it can be re-sent.
    assert "proxy_buffering off;" in d and "proxy_request_buffering on;" in d
    # Keep-alive to the replicas needs HTTP/1.1 and an empty Connection header.
    assert "proxy_http_version 1.1;" in d and 'proxy_set_header Connection "";' in d
    assert any(re.fullmatch(r"keepalive \d+;", x) for x in d)


def test_every_replica_line_disables_failure_accounting() -> None:
    # Otherwise one 429 from a busy replica marks it down for fail_timeout (10 s by default).
    servers = [x for x in directives(SHIPPED) if x.startswith("server ") and not x.startswith("server {")]
    assert len(servers) == 3
    assert all("max_fails=0" in s for s in servers)


def test_read_timeout_outlasts_llamagates_own_deadline() -> None:
    # nginx retries on `timeout` too; llamagate must always answer first so a request that began work is
    # never sent again.
    match = re.search(r"^\s*proxy_read_timeout (\d+)s;", SHIPPED, re.MULTILINE)
    assert match is not None
    assert int(match.group(1)) > TimeoutsConfig().total_s


def test_render_puts_in_the_replicas_and_the_port() -> None:
    site = render_site(SHIPPED, ["127.0.0.1:9001", "127.0.0.1:9002"], 8999)
    d = directives(site)
    servers = [x for x in d if x.startswith("server 127.")]
    assert servers == ["server 127.0.0.1:9001 max_fails=0;", "server 127.0.0.1:9002 max_fails=0;"]
    assert "listen 127.0.0.1:8999;" in d
    assert "proxy_next_upstream_tries 2;" in d  # one try per replica
    assert "hash $llamagate_conversation consistent;" in d
    # The conversation script is the shipped one, by its absolute path.
    assert f"js_import llamagate_conversation from {SHIPPED_CONF.with_name('conversation.js')};" in d


def test_least_conn_differs_only_by_balancing() -> None:
    hashed = directives(render_site(SHIPPED, ["127.0.0.1:9001"], 8999))
    by_load = directives(render_site(SHIPPED, ["127.0.0.1:9001"], 8999, "least-conn"))
    assert set(hashed) - set(by_load) == {"hash $llamagate_conversation consistent;"}
    assert set(by_load) - set(hashed) == {"least_conn;"}


def test_round_robin_differs_only_by_balancing_and_retries() -> None:
    balanced = directives(render_site(SHIPPED, ["127.0.0.1:9001"], 8999))
    plain = directives(render_site(SHIPPED, ["127.0.0.1:9001"], 8999, "round-robin"))
    assert set(balanced) - set(plain) == {
        "hash $llamagate_conversation consistent;",
        "proxy_next_upstream error timeout http_429 http_503 non_idempotent;",
        "proxy_next_upstream_tries 1;",
        "proxy_next_upstream_timeout 10s;",
    }
    assert set(plain) - set(balanced) == {"proxy_next_upstream off;"}


def test_render_refuses_a_file_without_replica_lines() -> None:
    with pytest.raises(UsageError, match="replica"):
        render_site("upstream x { server a:1; }\nserver { listen 1; }\n", ["127.0.0.1:1"], 2)
    with pytest.raises(UsageError, match="no replicas"):
        render_site(SHIPPED, [], 2)


@pytest.mark.needs_tool("nginx", "nginx-js")
@pytest.mark.parametrize("mode", ["balanced", "least-conn", "round-robin"])
def test_nginx_accepts_the_rendered_configuration(tmp_path: Path, mode: str) -> None:
    site = tmp_path / "site.conf"
    site.write_text(render_site(SHIPPED, ["127.0.0.1:9001", "127.0.0.1:9002"], 8999, mode))  # type: ignore[arg-type]
    (tmp_path / "tmp").mkdir()
    conf = tmp_path / "nginx.conf"
    conf.write_text(main_conf(tmp_path, site))
    check = subprocess.run(
        [str(nginx_binary()), "-p", str(tmp_path), "-c", str(conf), "-t"], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr


def test_verdict_needs_balanced_at_least_round_robin_in_every_round() -> None:
    def row(mode: str, rnd: int, g: float | None) -> dict[str, object]:
        return {"mode": mode, "round": rnd, "goodput_per_s": g}

    assert verdict([row("balanced", 1, 2.0), row("round-robin", 1, 1.5)])
    assert not verdict(
        [
            row("balanced", 1, 2.0),
            row("round-robin", 1, 1.5),
            row("balanced", 2, 1.0),
            row("round-robin", 2, 1.2),
        ]
    )
    assert not verdict([row("balanced", 1, None), row("round-robin", 1, 0.5)])


def test_kubernetes_ingress_carries_the_same_retry_rule() -> None:
    import yaml

    ingress = yaml.safe_load(
        (SHIPPED_CONF.parents[1] / "kubernetes" / "optional" / "ingress.yaml").read_text()
    )
    notes = ingress["metadata"]["annotations"]
    rule = re.search(r"^\s*proxy_next_upstream (.+);", SHIPPED, re.MULTILINE)
    assert rule is not None
    assert notes["nginx.ingress.kubernetes.io/proxy-next-upstream"] == rule.group(1)
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert notes["nginx.ingress.kubernetes.io/proxy-request-buffering"] == "on"
    assert int(notes["nginx.ingress.kubernetes.io/proxy-read-timeout"]) > TimeoutsConfig().total_s


def test_limits_verdict_needs_no_failure_and_the_shared_set_in_cluster_mode() -> None:
    def row(mode: str, failed: int, modes: list[str]) -> dict[str, object]:
        return {"mode": mode, "round": 1, "goodput_per_s": 1.0, "failed": failed, "cluster_mode": modes}

    assert verdict([row("per-replica", 0, ["off", "off"]), row("shared", 0, ["cluster", "cluster"])])
    assert not verdict([row("per-replica", 1, ["off", "off"]), row("shared", 0, ["cluster", "cluster"])])
    # A shared set whose Redis failed (refuse) or that never had one (off) did not share its limits.
    assert not verdict([row("per-replica", 0, ["off", "off"]), row("shared", 0, ["cluster", "refuse"])])
    assert not verdict([row("per-replica", 0, ["off", "off"]), row("shared", 0, ["off", "off"])])
