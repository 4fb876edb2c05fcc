"""Prompt sets, command-line parsing, provenance redaction, envelope finding and the optional chart."""

from __future__ import annotations

import argparse
import builtins
import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.bench import chart, options
from supervisor.bench.commands import sweep as sweep_cmd
from supervisor.bench.envelope import Point, find_envelope
from supervisor.bench.prompts import BUILTIN, load_prompts
from supervisor.bench.provenance import command_line, redact_argv
from supervisor.bench.records import RequestRecord
from supervisor.bench.stats import Gates
from supervisor.bench.summary import summarize
from supervisor.bench.sweep import host_load_note
from supervisor.cli import build_parser, main
from supervisor.errors import UsageError

# -- prompts ---------------------------------------------------------------------------------------


def test_builtin_prompts_cycle_in_seeded_order() -> None:
    a = [load_prompts("builtin", 1).get(i).id for i in range(len(BUILTIN) * 2)]
    b = [load_prompts("builtin", 1).get(i).id for i in range(len(BUILTIN) * 2)]
    c = [load_prompts("builtin", 2).get(i).id for i in range(len(BUILTIN))]
    assert a == b
    assert a[: len(BUILTIN)] != c
    assert sorted(a[: len(BUILTIN)]) == sorted({f"builtin:{i}" for i in range(len(BUILTIN))})
    assert a[: len(BUILTIN)] == a[len(BUILTIN) :]


def test_generated_prompts_are_unique_deterministic_and_sized() -> None:
    ps = load_prompts("gen:300", 0)
    first, second = ps.get(0), ps.get(1)
    assert first.id == "gen:300:0"
    assert first.messages != second.messages
    assert first == load_prompts("gen:300", 0).get(0)
    words = len(first.messages[0]["content"].split())
    assert 250 <= words <= 320
    # Different from the first word on: no shared prefix for the prompt cache to reuse.
    assert first.messages[0]["content"].split()[:3] != second.messages[0]["content"].split()[:3]


def test_shared_prompts_share_one_document_and_vary_the_question() -> None:
    ps = load_prompts("shared:200", 0)
    a, b = ps.get(0).messages[0]["content"], ps.get(1).messages[0]["content"]
    doc_a, question_a = a.split("\n\n", 1)
    doc_b, question_b = b.split("\n\n", 1)
    assert doc_a == doc_b
    assert question_a != question_b
    assert ps.get(0).id.startswith("shared:200:builtin:")
    assert load_prompts("shared:200", 1).get(0).messages[0]["content"].split("\n\n")[0] != doc_a


@pytest.mark.parametrize("spec", ["gen:", "gen:abc", "gen:0", "gen:-5", "shared:", "shared:x"])
def test_bad_gen_spec(spec: str) -> None:
    with pytest.raises(UsageError, match="TOKENS"):
        load_prompts(spec, 0)


def test_text_file_one_prompt_per_line(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("first question\n\nsecond question\n", encoding="utf-8")
    ps = load_prompts(str(path), 0)
    texts = {ps.get(i).messages[0]["content"] for i in range(2)}
    assert texts == {"first question", "second question"}


def test_jsonl_file_prompt_and_messages(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path.write_text(
        json.dumps({"prompt": "one"}) + "\n" + json.dumps({"messages": msgs}) + "\n", encoding="utf-8"
    )
    ps = load_prompts(str(path), 0)
    got = [ps.get(i).messages for i in range(2)]
    assert ({"role": "user", "content": "one"},) in got
    assert tuple(msgs) in got


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{oops\n", r"p\.jsonl:1: invalid JSON"),
        ('{"text": "x"}\n', r"p\.jsonl:1: expected"),
        ('{"prompt": "ok"}\n{"messages": []}\n', r"p\.jsonl:2: 'messages' must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}\n', r"messages\[0\]"),
        ("\n\n", "no prompts"),
    ],
)
def test_bad_jsonl_names_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UsageError, match=message):
        load_prompts(str(path), 0)


def test_missing_prompt_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="No such file"):
        load_prompts(str(tmp_path / "absent.txt"), 0)


def test_binary_prompt_file(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(UsageError, match="not UTF-8"):
        load_prompts(str(path), 0)


# -- provenance --------------------------------------------------------------------------------------


def test_api_keys_are_redacted_from_the_command_line() -> None:
    argv = [
        "/usr/bin/llamagate",
        "bench",
        "run",
        "--api-key",
        "lg_secret",
        "--url",
        "http://h",
        "--api-key=lg_x",
    ]
    assert redact_argv(argv) == [
        "/usr/bin/llamagate",
        "bench",
        "run",
        "--api-key",
        "***",
        "--url",
        "http://h",
        "--api-key=***",
    ]
    cl = command_line(argv)
    assert cl["argv"][0] == "llamagate"
    assert "lg_secret" not in cl["command"] and "lg_x" not in cl["command"]


def test_passwords_in_urls_are_redacted_from_the_command_line() -> None:
    argv = ["llamagate", "bench", "scaleout", "--redis-url", "redis://:r3d@h:6379/0"]
    argv += ["--store-url=postgresql://gate:p9s@db:5432/postgres", "--url", "http://h:8080"]
    assert redact_argv(argv)[3:] == [
        "--redis-url",
        "redis://:***@h:6379/0",
        "--store-url=postgresql://gate:***@db:5432/postgres",
        "--url",
        "http://h:8080",
    ]
    assert redact_argv(["postgresql://gate@db/x", "unix:///run/redis.sock"]) == [
        "postgresql://gate@db/x",
        "unix:///run/redis.sock",
    ]


# -- options -----------------------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY", "k1")
    args = parse("run", "--url", "http://h:1", "--concurrency", "1", "--api-key-env", "MY_KEY")
    assert options.target(args).api_key == "k1"


def test_api_key_env_missing_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MY_KEY", raising=False)
    args = parse("run", "--url", "http://h:1", "--concurrency", "1", "--api-key-env", "MY_KEY")
    with pytest.raises(UsageError, match="MY_KEY"):
        options.target(args)


def test_default_key_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(options.DEFAULT_KEY_ENV, "k2")
    args = parse("run", "--url", "http://h:1", "--concurrency", "1")
    assert options.target(args).api_key == "k2"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--url", "h:1", "--concurrency", "1"], "http://"),
        (["--url", "http://h", "--concurrency", "1", "--max-tokens", "0"], "--max-tokens"),
        (["--url", "http://h", "--concurrency", "1", "--extra-body", "[1]"], "JSON object"),
        (["--url", "http://h", "--concurrency", "1", "--extra-body", "{x"], "invalid JSON"),
        (["--url", "http://h", "--concurrency", "1", "--ttft-gate-ms", "0"], "gates"),
        (["--url", "http://h", "--concurrency", "0"], "concurrency"),
    ],
)
def test_run_usage_errors(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(options.DEFAULT_KEY_ENV, raising=False)
    args = parse("run", *argv)
    with pytest.raises(UsageError, match=message):
        args.func(args)


def test_run_needs_a_load(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "run", "--url", "http://h"]) == 2
    assert "--concurrency" in capsys.readouterr().err


def test_sweep_values() -> None:
    assert sweep_cmd.parse_values("8, 1,2,4", "--concurrency", integer=True) == [1.0, 2.0, 4.0, 8.0]
    assert sweep_cmd.parse_values("0.5,1", "--rates", integer=False) == [0.5, 1.0]
    for bad, msg in (("1,x", "not a whole number"), ("1,1", "duplicate"), ("0", "> 0"), ("1.5", "whole")):
        with pytest.raises(UsageError, match=msg):
            sweep_cmd.parse_values(bad, "--concurrency", integer=True)


def test_sweep_default_request_counts() -> None:
    args = parse("sweep", "--url", "http://h", "--concurrency", "1,8")
    loads = sweep_cmd.loads_from_args(args)
    assert [(load.label, load.requests) for load in loads] == [("c=1", 20), ("c=8", 32)]


def test_sweep_compare_names_must_differ() -> None:
    args = parse(
        "sweep",
        "--url",
        "http://a",
        "--compare-url",
        "http://b",
        "--name",
        "x",
        "--compare-name",
        "x",
        "--concurrency",
        "1",
    )
    with pytest.raises(UsageError, match="--compare-name"):
        sweep_cmd.targets_from_args(args)


# -- envelope ----------------------------------------------------------------------------------------


def summary_passing(passed: bool) -> Any:
    record = RequestRecord(
        seq=0,
        warmup=False,
        prompt_id="p",
        outcome="ok",
        t_submit=0.0,
        t_end=1.0,
        ttft_ms=100.0 if passed else 9000.0,
        tpot_ms=10.0,
        met_gates=passed,
    )
    return summarize([record], Gates(), "x")


def test_envelope_stops_at_first_failure() -> None:
    pts = [Point(f"c={c}", c, summary_passing(ok)) for c, ok in ((1, True), (2, True), (4, False), (8, True))]
    env = find_envelope(list(reversed(pts)))  # order of points does not matter, values do
    assert (env.highest_passing, env.first_failing) == ("c=2", "c=4")
    assert env.failing_checks == ("ttft_p95",)
    assert env.passed_after_failure == ("c=8",)
    assert "passed again" in env.describe()


def test_envelope_all_pass_or_all_fail() -> None:
    ok = find_envelope([Point("c=1", 1, summary_passing(True))])
    assert (ok.highest_passing, ok.first_failing) == ("c=1", None)
    assert "beyond the sweep" in ok.describe()
    bad = find_envelope([Point("c=1", 1, summary_passing(False))])
    assert (bad.highest_passing, bad.first_failing) == (None, "c=1")
    assert "no load passed" in bad.describe()


# -- chart -------------------------------------------------------------------------------------------

SERIES = [
    chart.Series("gate", (chart.SeriesPoint("c=1", 200, 40, 1.0), chart.SeriesPoint("c=2", 900, 80, 0.5))),
    chart.Series(
        "direct", (chart.SeriesPoint("c=1", 210, 41, 1.0), chart.SeriesPoint("c=2", None, None, 0.0))
    ),
]


def test_chart_renders_png(tmp_path: Path) -> None:
    path = chart.render(SERIES, ["c=1", "c=2"], 1500, 120, 95, tmp_path / "c.png", "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chart_without_matplotlib_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    for mod in [m for m in list(__import__("sys").modules) if m.startswith("matplotlib")]:
        monkeypatch.delitem(__import__("sys").modules, mod)
    with pytest.raises(chart.ChartUnavailable, match=r"pip install 'llamagate\[charts\]'"):
        chart.render(SERIES, ["c=1", "c=2"], 1500, 120, 95, tmp_path / "c.png", "t")
    assert not (tmp_path / "c.png").exists()


def test_host_load_note_blames_other_work_only_when_the_host_was_busy_before() -> None:
    quiet = host_load_note(0.7, 2.19, 2)
    assert "0.7 before, 2.19 after, on 2 cores" in quiet and "other work" not in quiet
    assert "other work shared it" in host_load_note(3.0, 5.0, 2)
