"""The labs' parts without a real server: the growth fit, the KV-reuse experiment against a fake
llama-server (httpx.MockTransport), the resident-memory sampler, the budget check, the host load and the
charts (rendered for real with matplotlib)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.bench import (
    budget_check,
    experiment_charts,
    experiment_report,
    experiments,
    hostload,
    kv_reuse,
)
from supervisor.bench.client import Target
from supervisor.bench.growth import growth, polyfit
from supervisor.bench.rss import PeakSampler, Resident, resident
from tests.unit.bench.test_bench_experiments import point

MIB = 1024 * 1024
NS = [16.0, 32.0, 64.0, 128.0, 256.0]

# -- growth ----------------------------------------------------------------------------------------------


def test_a_line_is_linear_with_exponent_one() -> None:
    g = growth(NS, [0.02 * n for n in NS])
    assert g.verdict == "linear"
    assert g.linear is not None and g.linear.coefficients == pytest.approx((0.02, 0.0), abs=1e-9)
    assert g.linear.r_squared == pytest.approx(1.0)
    assert g.exponent == pytest.approx(1.0)


def test_a_parabola_is_quadratic_and_its_exponent_lies_between() -> None:
    ys = [0.002 * n * n + 0.05 * n + 0.1 for n in NS]
    g = growth(NS, ys)
    assert g.verdict == "quadratic"
    assert g.quadratic is not None and g.quadratic.coefficients == pytest.approx((0.002, 0.05, 0.1), rel=1e-6)
    assert g.quadratic_share is not None and g.quadratic_share > 0.8
    assert g.exponent is not None and 1.3 < g.exponent < 2.0
    assert growth(NS, [n * n for n in NS]).exponent == pytest.approx(2.0)


def test_a_line_with_a_little_noise_stays_linear() -> None:
    noise = [1.01, 0.99, 1.0, 1.01, 0.995]
    g = growth(NS, [(0.02 * n + 0.3) * e for n, e in zip(NS, noise, strict=True)])
    assert g.verdict == "linear"


def test_too_few_points_are_undetermined() -> None:
    g = growth([4.0, 8.0], [1.0, 2.0])
    assert g.quadratic is None and g.verdict.startswith("undetermined")
    assert polyfit([1.0, 1.0], [1.0, 2.0], 1) is None


# -- kv-reuse against a fake llama-server ------------------------------------------------------------------

PROMPT_IDS = [2, 10, 11, 12, 13]


def _next(context: list[int]) -> int:
    return (sum(context) * 31 + len(context)) % 1000


class FakeLlama:
    """/tokenize and /completion as llama-server answers them; greedy = a function of the context."""

    def __init__(self, diverge_at: int | None = None) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.diverge_at = diverge_at  # one-token requests with this many generated tokens answer otherwise

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer k"
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            assert body["add_special"] is True
            return httpx.Response(200, json={"tokens": PROMPT_IDS})
        assert request.url.path == "/completion"
        self.bodies.append(body)
        assert body["cache_prompt"] is False and body["temperature"] == 0.0 and body["ignore_eos"] is True
        context, out = list(body["prompt"]), []
        for _ in range(body["n_predict"]):
            token = _next(context)
            if body["n_predict"] == 1 and len(context) - len(PROMPT_IDS) == self.diverge_at:
                token += 1
            out.append(token)
            context.append(token)
        timings = {
            "prompt_n": len(body["prompt"]),
            "prompt_ms": 1.0 * len(body["prompt"]),
            "predicted_n": body["n_predict"],
            "predicted_ms": 2.0 * body["n_predict"],
            "cache_n": 0,
        }
        return httpx.Response(200, json={"tokens": out, "content": "x", "timings": timings})


def _run(fake: FakeLlama, ns: list[int], repeats: int = 1) -> kv_reuse.KvReuseResult:
    return kv_reuse.run(
        Target("http://127.0.0.1:9", "k"), ns, repeats=repeats, transport=httpx.MockTransport(fake)
    )


def test_recomputed_sends_the_whole_text_so_far_one_token_at_a_time() -> None:
    fake = FakeLlama()
    result = _run(fake, [8, 4])
    assert result.ns == [4, 8] and result.prompt_tokens == len(PROMPT_IDS)
    # Warm-up, then per N: the ways take turns going first.
    one_token = [b for b in fake.bodies[2:] if b["n_predict"] == 1]
    assert [len(b["prompt"]) for b in one_token] == [*range(5, 9), *range(5, 13)]
    assert all(b["prompt"][:5] == PROMPT_IDS for b in one_token)
    reused, recomputed = result.first("reused", 8), result.first("recomputed", 8)
    assert (reused.requests, recomputed.requests) == (1, 8)
    assert reused.tokens_evaluated == 5 + 8
    assert recomputed.tokens_evaluated == sum(5 + k + 1 for k in range(8))
    assert recomputed.tokens_from_cache == 0
    assert recomputed.prompt_ms == pytest.approx(sum(5 + k for k in range(8)))
    assert reused.answer_sha256 == recomputed.answer_sha256
    assert result.same_answer == {4: None, 8: None}
    assert len(recomputed.step_ms) == 8 and result.first("recomputed", 4).step_ms == ()


def test_the_generated_ids_feed_the_next_step() -> None:
    fake = FakeLlama()
    _run(fake, [3])
    steps = [b["prompt"] for b in fake.bodies[2:] if b["n_predict"] == 1]
    t1 = _next(PROMPT_IDS)
    t2 = _next([*PROMPT_IDS, t1])
    assert steps == [PROMPT_IDS, [*PROMPT_IDS, t1], [*PROMPT_IDS, t1, t2]]


def test_where_the_two_ways_part_is_recorded() -> None:
    result = _run(FakeLlama(diverge_at=2), [2, 4])
    assert result.same_answer == {2: None, 4: 3}
    assert result.first("reused", 4).answer_sha256 != result.first("recomputed", 4).answer_sha256


def test_record_and_table() -> None:
    result = _run(FakeLlama(), [2, 4, 8], repeats=2)
    data = result.to_dict()
    assert len(data["answers"]) == 3 * 2 * 2
    # Without a CPU clock there is no CPU fit; the work and the wall time are always fitted.
    assert set(data["growth"]) == {"seconds", "tokens_evaluated"}
    assert set(data["growth"]["seconds"]) == {"of", "reused", "recomputed"}
    assert data["medians"]["cpu_seconds"]["reused"]["2"] is None
    assert "content" not in json.dumps(data)  # ids and text never kept, only digests
    text = kv_reuse.markdown(result)
    assert "| 8 |" in text and "| recomputed |" in text and "Rule: quadratic when" in text


def test_the_work_grows_as_n_and_as_n_squared_and_cpu_time_is_measured_per_answer() -> None:
    spent = iter(range(10_000))
    result = kv_reuse.run(
        Target("http://127.0.0.1:9", "k"),
        [2, 4, 8, 16, 32],
        transport=httpx.MockTransport(FakeLlama()),
        cpu=lambda: 0.5 * next(spent),  # half a second per reading: each answer reads it twice
    )
    work = result.growth["tokens_evaluated"]
    assert (work["reused"].verdict, work["recomputed"].verdict) == ("linear", "quadratic")
    assert all(a.cpu_seconds == 0.5 for a in result.answers)
    assert result.growth["cpu_seconds"]["reused"].verdict == "linear"
    text = kv_reuse.markdown(result)
    assert "| tokens llama-server evaluated per answer | recomputed |" in text


def test_a_short_answer_fails_the_experiment() -> None:
    def short(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": PROMPT_IDS})
        return httpx.Response(200, json={"tokens": [1], "timings": {}})

    with pytest.raises(kv_reuse.ExperimentFailed, match="asked for 4 tokens, got 1"):
        kv_reuse.run(Target("http://127.0.0.1:9", "k"), [2], transport=httpx.MockTransport(short))


# -- resident memory, budget, host load ------------------------------------------------------------------


def test_resident_memory_of_a_live_process() -> None:
    now = resident(os.getpid())
    assert now is not None and now.rss > 0 and now.anon > 0 and now.rss >= now.anon
    assert resident(2**22 + 12345) is None


def test_the_sampler_sees_the_peak_inside_the_block() -> None:
    before = resident(os.getpid())
    assert before is not None
    with PeakSampler(os.getpid(), interval_s=0.01) as sampler:
        block = bytearray(64 * MIB)
        block[::4096] = b"x" * len(block[::4096])  # touch every page
    assert sampler.peak is not None and sampler.samples >= 2
    assert sampler.peak.anon >= before.anon + 60 * MIB
    del block


def _budget(**kw: int) -> dict[str, int]:
    parts = {
        "weights_bytes": 241 * MIB,
        "kv_bytes": 54 * MIB,
        "runtime_bytes": 140 * MIB,
        "prompt_cache_bytes": 0,
        "checkpoint_bytes": 0,
    }
    parts.update(kw)
    return {**parts, "required_bytes": sum(parts.values())}


def test_a_budget_within_tolerance_needs_no_explanation() -> None:
    got = budget_check.check(_budget(), Resident(400 * MIB, 160 * MIB, 240 * MIB, 0))
    assert got is not None and got["within_tolerance"] and got["why"] is None
    assert got["off_by_fraction"] == pytest.approx(35 / 400, abs=1e-3)


def test_an_over_budget_names_the_caps_and_the_figure_without_them() -> None:
    budget = _budget(prompt_cache_bytes=256 * MIB, checkpoint_bytes=240 * MIB)
    got = budget_check.check(budget, Resident(374 * MIB, 127 * MIB, 246 * MIB, 0))
    assert got is not None and not got["within_tolerance"]
    assert got["off_by_fraction"] == pytest.approx((931 - 374) / 374, abs=1e-3)
    assert got["predicted_without_caps_bytes"] == 435 * MIB
    why = got["why"]
    assert (
        "+149 %" in why and "prompt cache (256 MiB)" in why and "without those two it predicts 435 MiB" in why
    )
    assert "runtime allowance (140 MiB" in why  # 127 anonymous - 54 KV = 73 MiB used beyond the KV


def test_a_child_over_its_budget_is_said_so() -> None:
    got = budget_check.check(_budget(), Resident(700 * MIB, 400 * MIB, 300 * MIB, 0))
    assert got is not None and "used more than the budget" in got["why"]
    assert budget_check.check(None, None) is None


def test_the_load_average_is_kept_at_both_ends(tmp_path: Path) -> None:
    (tmp_path / "provenance.json").write_text(json.dumps({"load_average": {"start": {"1m": 0.5}}}))
    window = hostload.record_end(tmp_path)
    assert window["start"] == {"1m": 0.5} and set(window["end"]) == {"1m", "5m", "15m"}
    assert json.loads((tmp_path / "provenance.json").read_text())["load_average"] == window
    assert hostload.describe(window).startswith("load average 0.5 at the start, ")


# -- charts ----------------------------------------------------------------------------------------------


def _png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_charts_of_models_slots_and_kv_reuse(tmp_path: Path) -> None:
    pts = []
    for label, size in (("Q4_K_M", 241), ("Q8_0", 278)):
        p = point(label, {"model": label}, budget=_budget(), rss_loaded=300 * MIB, decode_tps=50.0)
        p.extra.update({"file_bytes": size * MIB, "type": label, "rss_peak_bytes": 350 * MIB})
        pts.append(p)
    models = experiments.ExperimentResult("models", pts)
    assert (
        experiment_charts.write(models, tmp_path / "m", "models") == f"chart: {tmp_path / 'm' / 'chart.png'}"
    )
    assert _png(tmp_path / "m" / "chart.png")
    slots = experiments.ExperimentResult("slots", [point("2x4096", {"concurrency": 2}, budget=_budget())])
    experiment_charts.write(slots, tmp_path / "s", "slots")
    assert _png(tmp_path / "s" / "chart.png")
    experiment_charts.write(_run(FakeLlama(), [2, 4, 8]), tmp_path / "k", "kv")
    assert _png(tmp_path / "k" / "chart.png")
    threads = experiments.ExperimentResult("threads", [point("t=1", {"threads": 1})])
    assert experiment_charts.write(threads, tmp_path / "t", "t") == "no chart for the threads experiment"


def test_the_models_table_shows_each_points_memory_budget_and_load() -> None:
    p = point("q8.gguf", {"model": "q8.gguf"}, budget=_budget(), rss_loaded=300 * MIB)
    p.extra.update(
        {
            "type": "Q8_0",
            "file_bytes": 278 * MIB,
            "rss_peak_bytes": 400 * MIB,
            "budget_check": budget_check.check(_budget(), Resident(700 * MIB, 400 * MIB, 300 * MIB, 0)),
            "load_average": {"start": {"1m": 1.5}, "end": {"1m": 2.0}},
        }
    )
    text = experiment_report.markdown(experiments.ExperimentResult("models", [p]))
    assert "| q8.gguf | Q8_0 | 278 | 300 | 400 | 435 | -38 % (!) |" in text
    assert text.rstrip().splitlines()[4].endswith("| 1.5-2 |")
    assert "- q8.gguf: the budget (435 MiB) is -38 % off the peak RSS under load (700 MiB)" in text
