"""Where each benchmark lives, as docs/benchmarks.md says: the operator's in the product CLI
(``llamagate bench NAME``), the ones behind the docs' numbers in tests/benchmarks (``python -m
tests.benchmarks.NAME``), and every command line the docs and the README quote names one that exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from supervisor.cli import build_parser, main

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "docs" / "benchmarks.md"
PRODUCT = re.compile(r"llamagate bench ([a-z-]+)")
MOVED = re.compile(r"python -m tests\.benchmarks\.([a-z_]+)")


def _product_commands() -> set[str]:
    parser = build_parser("bench")
    bench = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return {name for name, p in sub.choices.items() if p.prog.endswith(f" {name}")} - {"experiments"}


def _moved_benchmarks() -> set[str]:
    return {
        p.stem for p in (REPO / "tests" / "benchmarks").glob("*.py") if "def add_arguments(" in p.read_text()
    }


def _where_table() -> str:
    text = DOCS.read_text()
    start = text.index("## Where each benchmark lives")
    return text[start : text.index("\n## ", start + 1)]


def test_the_docs_say_where_every_benchmark_lives() -> None:
    table = [line for line in _where_table().splitlines() if line.startswith("| `")]
    product = {m.group(1) for line in table if (m := PRODUCT.match(line.split("`")[1]))}
    moved = {m.group(1) for line in table if (m := MOVED.match(line.split("`")[1]))}
    assert (
        product
        == _product_commands()
        == {"run", "sweep", "overload", "experiment", "soak", "scaleout", "conversations"}
    )
    benchmarks = {
        "proxy",
        "proxy_opcodes",
        "startup",
        "scrape",
        "cache",
        "models",
        "lease",
        "poison",
        "store_write",
        "schema",
        "loop_gap",
        "program_cost",
        "oneshot",
        "loop_cost",
        "heap_trim",
    }
    assert moved == _moved_benchmarks() == benchmarks


def test_every_quoted_command_line_names_a_benchmark_that_exists() -> None:
    # "llamagate bench NAME" in a sentence about the old name is allowed only as "(then ...)" or
    # "recorded as ...": the command that reproduces a table is always the one that runs today.
    for path in (DOCS, REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))):
        text = re.sub(r"(?:then|recorded as)\s+`llamagate bench [a-z]+`", "", path.read_text())
        text = text.replace("`llamagate bench NAME`", "")
        assert {m.group(1) for m in PRODUCT.finditer(text)} <= _product_commands(), path
        assert {m.group(1) for m in MOVED.finditer(text)} <= _moved_benchmarks() | {"NAME"}, path


def test_a_moved_benchmark_is_no_product_command() -> None:
    assert main(["bench", "proxy", "--phases", "fake"]) == 2
