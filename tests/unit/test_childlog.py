"""llama-server's log lines that quote a request never reach our log, nor the tail logged on failure.

The lines are the pinned build's own output, captured from a real child (see supervisor/child/log.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from supervisor.child.log import WITHHELD, LineFilter, is_error
from tests.unit.test_process_driver import FakeOs, FakeProbes, make, settle, start

GOT_EXCEPTION = (
    '0.47.499.866 W srv    operator(): got exception: {"error":{"code":500,"message":"[json.exception.'
    "parse_error.101] parse error at line 1, column 41: syntax error while parsing value - invalid string: "
    "surrogate U+D800..U+DBFF must be followed by U+DC00..U+DFFF; last read: '\\\"CANARY-UUU secret text "
    '\\\\ud800 \'","type":"server_error"}}'
)
GRAMMAR = [
    "parse: error parsing grammar: Undefined rule identifier 'CANARY-GGG'",
    "",
    "root ::= CANARY-GGG",
    "  | CANARY-HHH",
    "0.13.830.238 E failed to parse grammar",
    "0.13.830.278 E srv    send_error: task id = 13, error: Failed to initialize samplers: failed to parse"
    " grammar",
]
ORDINARY = [
    "0.06.413.920 I srv  llama_server: listening on http://127.0.0.1:47289",
    "0.13.551.574 I slot print_timing: id  1 | task 0 |        eval time =     497.56 ms /     4 tokens",
    "0.27.228.558 E srv    send_error: task id = 44, error: request (9006 tokens) exceeds the available "
    "context size (4096 tokens), try increasing it",
    "print_info: n_ctx_train      = 32768",
    "/src/ggml/ggml.c:1234: GGML_ASSERT(x) failed",
]


def run(lines: list[str]) -> list[str]:
    f = LineFilter()
    return [out for line in lines if (out := f(line)) is not None]


def test_an_exception_keeps_its_code_and_type_not_its_message() -> None:
    (out,) = run([GOT_EXCEPTION])
    assert "CANARY" not in out and "last read" not in out
    assert out == f"0.47.499.866 W srv    operator(): got exception: code 500, type server_error {WITHHELD}"


def test_a_grammar_dump_is_dropped_until_the_next_llama_line() -> None:
    out = run(GRAMMAR)
    assert not any("CANARY" in line for line in out)
    assert out[0] == f"parse: error parsing grammar {WITHHELD}"
    assert out[1:] == GRAMMAR[4:]


def test_any_other_echo_of_the_input_is_cut() -> None:
    (out,) = run(["0.1.2.3 E srv  x: parse error; last read: '\"CANARY'"])
    assert out == f"0.1.2.3 E srv  x: parse error; last read: {WITHHELD}"


def test_ordinary_lines_pass_unchanged() -> None:
    assert run(ORDINARY) == ORDINARY
    assert [is_error(line) for line in ORDINARY] == [False, False, True, False, False]


async def test_the_driver_logs_and_keeps_only_filtered_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    os_, probes = FakeOs(), FakeProbes()
    sup = make(os_, probes, tmp_path)
    await start(sup)
    child = os_.children[0]
    child.say("\n".join([GOT_EXCEPTION, *GRAMMAR, *ORDINARY]) + "\n")
    child.exit(1)  # the tail is logged with the failure
    with caplog.at_level(logging.DEBUG):
        await settle(sup)
    assert "CANARY" not in caplog.text
    assert not any("CANARY" in line for line in sup.tail)
    assert "listening on http://127.0.0.1:47289" in caplog.text
