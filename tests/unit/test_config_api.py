"""The configuration of issue 13's settings: proxy.cors, proxy.counting, llama.reranking."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.settings import CorsSettings
from supervisor.config.load import parse_config
from supervisor.config.proxy_settings import proxy_settings
from supervisor.errors import ConfigError
from supervisor.launch.flags import LaunchSpec, build_argv, owned_flags
from supervisor.launch.knobs import LlamaKnobs


def test_cors_and_counting_reach_the_proxy_settings() -> None:
    cfg = parse_config(
        "proxy:\n  cors: {allowed_origins: ['https://app.example:8443', 'http://localhost:3000']}\n"
        "  counting: {rate_per_s: 2.5, burst: 3}\n",
        env={},
    )
    s = proxy_settings(cfg)
    assert s.cors.allowed_origins == ("https://app.example:8443", "http://localhost:3000")
    assert s.cors.allowed_headers == CorsSettings().allowed_headers
    assert (s.count_rate_per_s, s.count_burst) == (2.5, 3)
    assert proxy_settings(parse_config("", env={})).cors.allowed_origins == ()  # off by default


@pytest.mark.parametrize("origin", ["https://app.example/path", "app.example", "ftp://x", ""])
def test_an_origin_that_a_browser_never_sends_is_refused_by_name(origin: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(f"proxy:\n  cors: {{allowed_origins: ['{origin}']}}\n", env={})
    assert any(p.startswith("proxy.cors.allowed_origins:") and repr(origin) in p for p in info.value.problems)


def test_counting_bounds_are_checked() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("proxy:\n  counting: {rate_per_s: 0, burst: 0}\n", env={})
    assert sorted(p.split(":")[0] for p in info.value.problems) == [
        "proxy.counting.burst",
        "proxy.counting.rate_per_s",
    ]


def test_reranking_passes_rerank_to_the_child() -> None:
    def argv(**kw: object) -> list[str]:
        return build_argv(
            LaunchSpec(
                Path("b"),
                Path("m"),
                "a",
                1,
                LlamaKnobs(threads=1, threads_batch=1, slots=1, ctx_per_slot=256, **kw),
            )
        )

    assert "--rerank" in argv(reranking=True) and "--rerank" not in argv()
    assert parse_config("llama: {reranking: true}\n", env={}).llama.reranking is True
    assert "--rerank" in owned_flags() and "--reranking" in owned_flags()  # refused in extra_args
