"""The door's readers (``proxy.schema.programs``) against llama.cpp's own tests, read from the locked
source: every grammar ``tests/test-grammar-parser.cpp`` expects to fail is refused, and every one it
expects to parse passes with exactly the symbols and elements the pinned parser builds (so what the door
counts is what the child builds); every grammar shipped in ``grammars/`` passes; every schema of
``tests/test-json-schema-to-grammar.cpp`` gets the verdict the converter gives it (refused where the
converter fails, passed where it succeeds).

No child runs here; the source tarball is the one the binary's build fetched (and cached).
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pytest

from proxy.schema.programs import GRAMMAR, ProgramError, _Grammar, measure_grammar, measure_schema
from supervisor.artifacts.fetch import fetch_source
from supervisor.artifacts.lock import load_lock
from supervisor.paths import cache_root
from supervisor.progress import ConsoleProgress

pytestmark = pytest.mark.integration

LOCK = Path(__file__).resolve().parents[2] / "llama-build.lock"
PARSER_TESTS = "tests/test-grammar-parser.cpp"
SCHEMA_TESTS = "tests/test-json-schema-to-grammar.cpp"
_SCHEMA_CASE = re.compile(r'(SUCCESS|FAILURE),\s*"([^"]*)",\s*R"""\((.*?)\)"""', re.S)
_CASE = re.compile(r'verify_(parsing|failure)\(R"""\((.*?)\)"""(.*?)\);\n', re.S)
_SYMBOL = re.compile(r'\{"[^"]+",\s*\d+\}')


@pytest.fixture(scope="module")
def pinned(llama_server_binary: Path) -> dict[str, str]:
    """The parser tests and the shipped grammars, in one pass over the tarball."""
    fetched = fetch_source(load_lock(LOCK), root=cache_root(), progress=ConsoleProgress())
    top = fetched.source.subdir.strip("/")
    out: dict[str, str] = {}
    with tarfile.open(fetched.tarball) as tar:
        for member in tar:
            name = member.name.lstrip("./")
            relative = name.split(f"{top}/", 1)[1] if f"{top}/" in name else ""
            if relative in (PARSER_TESTS, SCHEMA_TESTS) or (
                relative.startswith("grammars/") and relative.endswith(".gbnf")
            ):
                fh = tar.extractfile(member)
                if fh is not None:
                    out[relative] = fh.read().decode("utf-8")
    assert PARSER_TESTS in out and "grammars/json.gbnf" in out, sorted(out)
    return out


def test_the_reader_agrees_with_the_pinned_parsers_own_tests(pinned: dict[str, str]) -> None:
    text = pinned[PARSER_TESTS]
    cases = list(_CASE.finditer(text[text.index("int main()") :]))
    assert len(cases) >= 20, len(cases)
    for case in cases:
        kind, grammar, expected = case.groups()
        if kind == "failure":
            with pytest.raises(ProgramError):
                measure_grammar(grammar)
            continue
        read = _Grammar(grammar, GRAMMAR)
        read.parse()
        symbols = len(_SYMBOL.findall(expected.split("}, {")[0]))
        elements = expected.count("{LLAMA_GRETYPE_")
        assert (len(read.symbols), read.elements) == (symbols, elements), grammar


def test_every_grammar_llama_cpp_ships_passes(pinned: dict[str, str]) -> None:
    shipped = {k: v for k, v in pinned.items() if k.startswith("grammars/")}
    assert len(shipped) >= 5, sorted(shipped)
    for name, grammar in shipped.items():
        try:
            measure_grammar(grammar)
        except ProgramError as err:
            pytest.fail(f"{name}: {err.what} {err.where}")


def test_every_schema_of_the_converters_tests_gets_the_converters_verdict(pinned: dict[str, str]) -> None:
    cases = list(_SCHEMA_CASE.finditer(pinned[SCHEMA_TESTS]))
    assert len(cases) >= 50, len(cases)
    for case in cases:
        status, name, text = case.groups()
        schema = json.loads(text)
        if status == "FAILURE":
            with pytest.raises(ProgramError):
                measure_schema(schema)
        else:
            try:
                measure_schema(schema)
            except ProgramError as err:
                pytest.fail(f"{name}: {err.what} {err.where}")
