"""Experiments' pieces without a real server: rates from server timings, the cache-prompt pair, quality
sets, llama-bench output, command-line parsing and the report tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakeserver import FakeServer

from supervisor.bench import experiment_report, experiments, llamabench, quality
from supervisor.bench.client import Target
from supervisor.bench.commands import experiments as cmd
from supervisor.bench.launcher import deep_merge, read_base_config
from supervisor.bench.loadgen import LoadSpec
from supervisor.bench.prompts import load_prompts
from supervisor.bench.records import RequestRecord, ServerTimings
from supervisor.bench.runner import RequestOptions
from supervisor.bench.stats import Gates
from supervisor.bench.summary import summarize
from supervisor.errors import CheckFailed, UsageError


def rec(seq: int, server: ServerTimings | None, warmup: bool = False, outcome: str = "ok") -> RequestRecord:
    return RequestRecord(
        seq=seq,
        warmup=warmup,
        prompt_id="p",
        outcome=outcome,
        t_submit=0.0,
        t_end=1.0,
        server=server,  # type: ignore[arg-type]
    )


def test_server_rates_are_medians_of_measured_completed_requests() -> None:
    records = [
        rec(0, ServerTimings(prompt_n=100, prompt_ms=1000, predicted_n=10, predicted_ms=500), warmup=True),
        rec(1, ServerTimings(prompt_n=100, prompt_ms=500, predicted_n=10, predicted_ms=200)),  # 200, 50
        rec(2, ServerTimings(prompt_n=100, prompt_ms=250, predicted_n=10, predicted_ms=100)),  # 400, 100
        rec(
            3, ServerTimings(prompt_n=100, prompt_ms=100, predicted_n=10, predicted_ms=100), outcome="failed"
        ),
        rec(4, None),
        rec(5, ServerTimings(prompt_n=0, prompt_ms=0, predicted_n=10, predicted_ms=125)),  # -, 80
    ]
    prompt, decode = experiments.server_rates(records)
    assert prompt == pytest.approx(300.0)
    assert decode == pytest.approx(80.0)
    assert experiments.server_rates([]) == (None, None)


def test_cache_prompt_experiment_sends_both_settings(tmp_path: Path) -> None:
    server = FakeServer(tokens=3)
    workload = experiments.Workload(
        LoadSpec("concurrency", 1, requests=2), load_prompts("shared:100", 0), RequestOptions(), Gates()
    )
    result = experiments.cache_prompt(
        Target("http://fake.test"), workload, tmp_path, None, server.transport()
    )
    assert [p.label for p in result.points] == ["cache_prompt=on", "cache_prompt=off"]
    assert [r["cache_prompt"] for r in server.requests] == [True, True, False, False]
    assert (tmp_path / "cache_prompt-on" / "records.jsonl").is_file()
    experiment_report.write(result, tmp_path)
    md = (tmp_path / "experiment.md").read_text()
    assert "| on |" in md and "| off |" in md
    assert json.loads((tmp_path / "experiment.json").read_text())["experiment"] == "cache-prompt"


# -- quality -------------------------------------------------------------------------------------------


def write_set(tmp_path: Path, lines: list[Any]) -> Path:
    path = tmp_path / "q.jsonl"
    path.write_text(
        "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8"
    )
    return path


def test_quality_set_scores_answers(tmp_path: Path) -> None:
    items = quality.load(
        write_set(
            tmp_path,
            [
                {"id": "capital", "prompt": "Capital of France?", "expect": "paris"},
                {"messages": [{"role": "user", "content": "2+2?"}], "expect_regex": r"\b4\b"},
                {"prompt": "Say nothing useful", "expect": "banana"},
                {"prompt": "boom", "expect": "x"},
            ],
        )
    )
    answers = {"Capital of France?": "It is PARIS.", "2+2?": "That is 4", "Say nothing useful": "ok"}

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["temperature"] == 0 and "stream" not in body
        question = body["messages"][-1]["content"]
        if question not in answers:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        return httpx.Response(200, json={"choices": [{"message": {"content": answers[question]}}]})

    result = quality.evaluate(Target("http://q.test"), "m", items, transport=httpx.MockTransport(handler))
    assert (result.passed, result.total, result.errors) == (2, 4, 1)
    assert result.failed_ids == ("q3", "q4")
    assert result.rate == 0.5


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "x"}', "expect"),
        ('{"expect": "x"}', "'prompt'"),
        ('{"prompt": "x", "expect_regex": "("}', "does not compile"),
        ("[1]", "JSON object"),
        ("{nope", "invalid JSON"),
    ],
)
def test_bad_quality_set_names_the_line(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        quality.load(write_set(tmp_path, [line]))


# -- llama-bench ---------------------------------------------------------------------------------------

LLAMA_BENCH_JSON = json.dumps(
    [
        {"n_threads": 1, "n_prompt": 512, "n_gen": 0, "avg_ts": 120.5, "stddev_ts": 1.5},
        {"n_threads": 1, "n_prompt": 0, "n_gen": 128, "avg_ts": 30.25, "stddev_ts": 0.5},
        {"n_threads": 2, "n_prompt": 512, "n_gen": 0, "avg_ts": 230.0, "stddev_ts": 2.0},
    ]
)


def test_llama_bench_output_is_parsed() -> None:
    rates = llamabench.parse(LLAMA_BENCH_JSON)
    assert [(r.threads, r.test, r.tokens_per_s) for r in rates] == [
        (1, "pp512", 120.5),
        (1, "tg128", 30.25),
        (2, "pp512", 230.0),
    ]
    with pytest.raises(CheckFailed, match="no JSON"):
        llamabench.parse("| model | size |")


def test_llama_bench_found_next_to_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    server = tmp_path / "llama-server"
    server.write_text("")
    assert llamabench.find(server) is None
    (tmp_path / "llama-bench").write_text("")
    assert llamabench.find(server) == tmp_path / "llama-bench"
    assert llamabench.find(server, tmp_path / "absent") is None


def test_llama_bench_runs_a_real_process(tmp_path: Path) -> None:
    # A stand-in executable proves argv and output handling without building llama.cpp.
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\necho '{LLAMA_BENCH_JSON}'\n", encoding="utf-8")
    fake.chmod(0o755)
    assert len(llamabench.run(fake, tmp_path / "m.gguf", [1, 2])) == 3
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho oops >&2\nexit 3\n", encoding="utf-8")
    broken.chmod(0o755)
    with pytest.raises(CheckFailed, match="exited 3: oops"):
        llamabench.run(broken, tmp_path / "m.gguf", [1])


# -- command line and config -----------------------------------------------------------------------------


def test_grid_parsing() -> None:
    assert cmd._grid("1x8192, 4x2048") == [(1, 8192), (4, 2048)]
    for bad in ("4", "0x4096", "4x100", "ax4096"):
        with pytest.raises(UsageError, match="SLOTSxCTX"):
            cmd._grid(bad)


def test_model_spec(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    path, sha = cmd._model_spec(str(model))
    assert path == model and len(sha) == 64
    assert cmd._model_spec(f"{model}={'a' * 64}")[1] == "a" * 64
    with pytest.raises(UsageError, match="64 lowercase hex"):
        cmd._model_spec(f"{model}=abc")
    with pytest.raises(UsageError, match="no such file"):
        cmd._model_spec(str(tmp_path / "absent.gguf"))


def test_base_config_paths_become_absolute(tmp_path: Path) -> None:
    (tmp_path / "cfg.yaml").write_text("llama:\n  binary: bin/llama-server\n  model:\n    path: m.gguf\n")
    raw = read_base_config(tmp_path / "cfg.yaml")
    assert raw["llama"]["binary"] == str(tmp_path / "bin" / "llama-server")
    assert raw["llama"]["model"]["path"] == str(tmp_path / "m.gguf")
    assert read_base_config(None) == {}
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(UsageError, match="mapping"):
        read_base_config(tmp_path / "bad.yaml")


def test_deep_merge_overrides_leaves_and_keeps_siblings() -> None:
    base = {"llama": {"slots": 2, "model": {"path": "a"}}, "proxy": {"port": 1}}
    merged = deep_merge(base, {"llama": {"slots": 4}})
    assert merged == {"llama": {"slots": 4, "model": {"path": "a"}}, "proxy": {"port": 1}}
    assert base["llama"]["slots"] == 2  # type: ignore[index]


# -- report tables -----------------------------------------------------------------------------------------


def point(label: str, settings: dict[str, Any], **kw: Any) -> experiments.PointResult:
    r = RequestRecord(
        seq=0,
        warmup=False,
        prompt_id="p",
        outcome="ok",
        t_submit=0,
        t_end=1,
        ttft_ms=100.0,
        tpot_ms=10.0,
        completion_tokens=5,
        met_gates=True,
    )
    return experiments.PointResult(label, settings, summarize([r], Gates(), label), Path("x"), **kw)


def test_report_tables_for_every_experiment(tmp_path: Path) -> None:
    threads = experiments.ExperimentResult(
        "threads",
        [point("t=1", {"threads": 1}, decode_tps=30.0, prompt_tps=100.0)],
        extra={"llama_bench": [r.__dict__ for r in llamabench.parse(LLAMA_BENCH_JSON)]},
    )
    assert "| 1 | pp512 | 120.5 |" in experiment_report.markdown(threads)
    slots = experiments.ExperimentResult(
        "slots",
        [
            point(
                "4x2048",
                {"slots": 4, "ctx_per_slot": 2048, "concurrency": 4},
                budget={"kv_bytes": 64 * 2**20, "required_bytes": 400 * 2**20},
                rss_after=300 * 2**20,
            )
        ],
    )
    assert "| 4x2048 | 4 | 64 | 400 |" in experiment_report.markdown(slots)
    m = point("small.gguf", {"model": "small.gguf"}, quality=quality.QualityResult(3, 4, 0, ("q2",)))
    m.extra["file_bytes"] = 100 * 2**20
    models = experiments.ExperimentResult(
        "models", [m], extra={"smallest_passing": None, "min_pass_rate": 1.0}
    )
    text = experiment_report.markdown(models)
    assert "| small.gguf | - | 100 |" in text and "3/4" in text and "none." in text
    experiment_report.write(models, tmp_path)
    data = json.loads((tmp_path / "experiment.json").read_text())
    assert data["points"][0]["quality"]["rate"] == 0.75


# -- overload claim --------------------------------------------------------------------------------------


def summary_of(ttfts: list[float], rejected: int = 0) -> Any:
    records = [
        RequestRecord(
            seq=i,
            warmup=False,
            prompt_id="p",
            outcome="ok",
            t_submit=0,
            t_end=1,
            ttft_ms=t,
            tpot_ms=50.0,
            completion_tokens=9,
            met_gates=t <= 1500,
        )
        for i, t in enumerate(ttfts)
    ]
    records += [
        RequestRecord(
            seq=100 + i,
            warmup=False,
            prompt_id="p",
            outcome="rejected",
            t_submit=0,
            t_end=0.01,
            status=429,
            met_gates=False,
        )
        for i in range(rejected)
    ]
    return summarize(records, Gates(), "x")


def sweep_result(gate_c8: Any, direct_c8: Any) -> Any:
    from supervisor.bench.sweep import SeriesResult, SweepResult

    c4, c8 = LoadSpec("concurrency", 4, requests=1), LoadSpec("concurrency", 8, requests=1)
    ok = summary_of([100.0] * 20)
    gate = SeriesResult("llamagate", Target("http://g"), [(c4, ok, Path("g4")), (c8, gate_c8, Path("g8"))])
    direct = SeriesResult(
        "llama-server", Target("http://d"), [(c4, ok, Path("d4")), (c8, direct_c8, Path("d8"))]
    )
    return SweepResult(Path("out"), (gate, direct), Gates(), None, None)


def test_overload_claim_holds_when_admitted_pass_and_direct_fails() -> None:
    from supervisor.bench.overload import check_claim, comparison_markdown

    result = sweep_result(summary_of([200.0] * 20, rejected=20), summary_of([200.0] * 10 + [9000.0] * 10))
    claim = check_claim(result)
    assert claim is not None and claim.holds and claim.load == "c=8"
    assert "20 turned away" in claim.text and "The claim holds." in claim.text
    assert "| c=8 | 20/40 |" in comparison_markdown(result, claim)


def test_overload_claim_fails_when_admitted_miss_the_gate() -> None:
    from supervisor.bench.overload import check_claim

    result = sweep_result(summary_of([200.0] * 10 + [3000.0] * 10, rejected=5), summary_of([9000.0] * 20))
    claim = check_claim(result)
    assert claim is not None and not claim.holds
    assert "does NOT hold" in claim.text
