"""No request can take the child down (issue 48): hostile values for every field of the pinned
llama-server's request schema, sent through the door to the real child.

The field list is read from the locked source (``tests.helpers.llama_schema``), not from the door's
own schema module: the fuzz drives the real door on a real port with the real pinned child and demo
model, and counts on nothing but what a client sees (status, body) and the child's pid.

Why each piece:
- the issue's exploit (``grammar_triggers[].type`` 99 with ``grammar_lazy``: SIGABRT in
  ``common_sampler_init`` at the pin, CVE-2026-134540) through every route that reaches the field, 50
  times in a row from one inference key: each a 400 naming the field, the child never restarted;
- about twenty type-confused and out-of-range values for each field on ``/completion``,
  ``/v1/completions`` and ``/v1/chat/completions``: no child death, no 5xx for a client's input, no
  request without an answer, READY at the end. A value the door lets through must then be harmless to
  the child: the base body asks for 2 tokens and the tenant caps every request at 4, so passing is cheap.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.schema import declared as declared_fields
from proxy.schema.llama import LLAMA, NESTED
from proxy.schema.programs import Grammar
from proxy.schema.values import Bool, Int, Num, Obj, Str
from tests.helpers.llama_schema import SchemaField, pinned_server_schema
from tests.integration.conftest import Daemon, DaemonFactory, process_gone

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "llama-build.lock"
MODEL = "smollm2-135m-instruct"

# The issue's request, as an attacker holding one inference key sent it.
GRAMMAR = 'root ::= "yes" | "no"'
EXPLOIT = {"grammar": GRAMMAR, "grammar_lazy": True, "grammar_triggers": [{"type": 99, "value": "x"}]}
EXPLOIT_PATH = "grammar_triggers[0].type"

_CHAT_BASE = {"model": MODEL, "messages": [{"role": "user", "content": "Say yes or no:"}], "max_tokens": 4}
_PROMPT_BASE = {"model": MODEL, "prompt": "Say yes or no:", "max_tokens": 4}
_NATIVE_BASE = {"prompt": "Say yes or no:", "n_predict": 4}
# Every route the door serves that hands a body's sampling fields to the child's completion schema.
EXPLOIT_ROUTES: dict[str, dict[str, Any]] = {
    "/completion": _NATIVE_BASE,
    "/completions": _NATIVE_BASE,
    "/v1/completions": _PROMPT_BASE,
    "/infill": {"input_prefix": "def answer():\n    return ", "input_suffix": "\n", "n_predict": 4},
    "/v1/chat/completions": _CHAT_BASE,
    "/chat/completions": _CHAT_BASE,
}

# The fuzz: a valid base body per route (2 tokens), one field replaced by one hostile value.
FUZZ_ROUTES: dict[str, dict[str, Any]] = {
    "/completion": {"prompt": "Hi", "n_predict": 2},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
    },
}
# Body fields each route reads itself, before the completion schema (prompt parsing, chat templating).
ROUTE_FIELDS: dict[str, tuple[str, ...]] = {
    "/completion": ("prompt", "id_slot"),
    "/v1/completions": ("prompt", "id_slot", "suffix", "best_of"),
    "/v1/chat/completions": (
        "messages",
        "id_slot",
        "tools",
        "tool_choice",
        "response_format",
        "chat_template_kwargs",
        "top_logprobs",
        "parallel_tool_calls",
        "add_generation_prompt",
    ),
}

# (label for messages, value): type confusion, the int32/int64/double edges, empty and huge values,
# nesting, and the grammar-trigger shapes of the advisory (bad type, token id far outside the vocabulary).
HOSTILE: tuple[tuple[str, Any], ...] = (
    ("-1", -1),
    ("0", 0),
    ("2^31", 2**31),
    ("-2^31", -(2**31)),
    ("2^31-1", 2**31 - 1),
    ("2^63-1", 2**63 - 1),
    ("2^64", 2**64),
    ("1e308", 1e308),
    ("-1e308", -1e308),
    ("0.5", 0.5),
    ("''", ""),
    ("'x'", "x"),
    ("70000 chars", "x" * 70_000),
    ("[]", []),
    ("{}", {}),
    ("null", None),
    ("[[[]]]", [[[]]]),
    ("true", True),
    ("[-1, 2^31]", [-1, 2**31]),
    ("trigger type 99", {"type": 99, "value": "x"}),
    ("trigger token 2^31-1", {"type": 0, "value": "x", "token": 2**31 - 1}),
    ("[trigger type 99]", [{"type": 99, "value": "x"}]),
    ("[trigger token 2^31-1]", [{"type": 0, "value": "x", "token": 2**31 - 1}]),
)

CLIENT_TIMEOUT_S = 60.0
# Cheap and bounded: whatever passes the door generates at most this many tokens (the tenant's cap
# rewrites -1, 2^31 and the like), and no request waits long for anything.
FUZZ_CONFIG: dict[str, Any] = {
    "proxy": {"timeouts": {"connect_s": 5, "first_token_s": 30, "total_s": 45}},
    "tenants": [
        {"name": "default", "max_concurrency": 2, "max_queue": 16, "queue_timeout_s": 45, "max_tokens": 4}
    ],
}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def schema_fields(llama_server_binary: Path) -> list[SchemaField]:
    """The pinned schema's fields; after the binary, whose build fetched (and cached) the source."""
    fields = pinned_server_schema(LOCK)
    # The issue counted 68 at the pin; a parse that lost most of them must not make the fuzz vacuous.
    assert len(fields) >= 60, [f.name for f in fields]
    return fields


def _field_paths(fields: list[SchemaField]) -> list[str]:
    return [p for f in fields for p in f.paths()]


def _with_value(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(json.dumps(base))
    if "." in path:  # a subfield of a nested field: stream_options.include_usage
        parent, name = path.split(".", 1)
        body[parent] = {name: value}
    else:
        body[path] = value
    return body


def _ready(d: Daemon) -> tuple[int, dict[str, Any]]:
    return d.readyz()


# --- the issue's exploit ----------------------------------------------------------------------------


def test_the_issues_exploit_is_refused_naming_the_field_on_every_route_50_times(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory()
    pid = d.child_pid
    assert pid is not None
    _, ready = _ready(d)
    generation = ready["generation"]
    with httpx.Client(timeout=CLIENT_TIMEOUT_S, trust_env=False) as c:
        for route, base in EXPLOIT_ROUTES.items():
            for attempt in range(50):
                r = c.post(d.base_url + route, json={**base, **EXPLOIT}, headers=_auth(d.inference_key))
                where = f"{route} attempt {attempt + 1}: {r.status_code} {r.text[:300]}"
                assert r.status_code == 400, where
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error", where
                assert error["code"] == "invalid_field", where
                assert error["param"] == EXPLOIT_PATH, where
                assert f"'{EXPLOIT_PATH}'" in error["message"], where
            assert not process_gone(pid), f"the child died during {route}"
            assert d.child_pid == pid, f"the child was replaced during {route}"
    code, ready = _ready(d)
    assert code == 200 and ready["generation"] == generation, ready


# --- every field, hostile values ----------------------------------------------------------------------


@dataclass
class _Outcome:
    where: str
    status: int | None = None
    detail: str = ""

    @property
    def bad(self) -> bool:
        return self.status is None or self.status >= 500


def _sse_server_errors(text: str) -> list[str]:
    """Error events carrying a 5xx inside a stream that began 200 (the child failed after the headers)."""
    out = []
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            continue
        error = event.get("error") if isinstance(event, dict) else None
        if isinstance(error, dict) and isinstance(error.get("code"), int) and error["code"] >= 500:
            out.append(line[:300])
    return out


class _Fuzz:
    """The requests of the fuzz, run by a few threads; a dead child stops it at once, naming the requests
    that were in flight when it died."""

    def __init__(self, d: Daemon, pid: int) -> None:
        self.d = d
        self.pid = pid
        self.lock = threading.Lock()
        self.in_flight: set[str] = set()
        self.outcomes: list[_Outcome] = []
        self.died_during: list[str] | None = None
        self.local = threading.local()
        self.clients: list[httpx.Client] = []

    def _client(self) -> httpx.Client:
        """One connection pool per thread (httpx's client is not shared across threads here)."""
        client: httpx.Client | None = getattr(self.local, "client", None)
        if client is None:
            client = httpx.Client(timeout=CLIENT_TIMEOUT_S, trust_env=False)
            self.local.client = client
            with self.lock:
                self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def send(self, route: str, path: str, label: str, body: dict[str, Any]) -> None:
        if self.died_during is not None:
            return
        where = f"{route} {path}={label}"
        with self.lock:
            self.in_flight.add(where)
        outcome = _Outcome(where)
        try:
            r = self._client().post(self.d.base_url + route, json=body, headers=_auth(self.d.inference_key))
            outcome.status = r.status_code
            outcome.detail = r.text[:300]
            if r.status_code == 200 and "text/event-stream" in r.headers.get("content-type", ""):
                errors = _sse_server_errors(r.text)
                if errors:
                    outcome.status = 599  # a 5xx for a client's input, sent as an event
                    outcome.detail = errors[0]
        except httpx.HTTPError as exc:
            outcome.detail = f"no answer: {type(exc).__name__}: {exc}"
        with self.lock:
            if process_gone(self.pid) and self.died_during is None:
                self.died_during = sorted(self.in_flight)
            self.in_flight.discard(where)
            self.outcomes.append(outcome)


def _requests(fields: list[SchemaField]) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    for route, base in FUZZ_ROUTES.items():
        for path in (*_field_paths(fields), *ROUTE_FIELDS[route]):
            for label, value in HOSTILE:
                yield route, path, label, _with_value(base, path, value)


@pytest.mark.timeout(900)
def test_hostile_values_for_every_schema_field_never_take_the_child_down(
    daemon_factory: DaemonFactory, schema_fields: list[SchemaField]
) -> None:
    d = daemon_factory(FUZZ_CONFIG)
    pid = d.child_pid
    assert pid is not None
    _, ready = _ready(d)
    generation = ready["generation"]
    fuzz = _Fuzz(d, pid)
    requests = list(_requests(schema_fields))
    try:
        with ThreadPoolExecutor(3) as pool:
            for future in [pool.submit(fuzz.send, *req) for req in requests]:
                future.result()
    finally:
        fuzz.close()
    assert fuzz.died_during is None, f"the child (pid {pid}) died; in flight then: {fuzz.died_during}"
    assert len(fuzz.outcomes) == len(requests)
    bad = [o for o in fuzz.outcomes if o.bad]
    assert not bad, f"{len(bad)} of {len(requests)} without an answer or with a 5xx:\n" + "\n".join(
        f"{o.where}: {o.status} {o.detail}" for o in bad[:30]
    )
    # The door refused what it must: nothing above can pass this on a door that forwards everything,
    # since the exploit's own shape is among the values.
    refused = [o for o in fuzz.outcomes if o.status == 400 and '"invalid_field"' in o.detail]
    assert refused, "the door refused no value as invalid_field"
    assert d.child_pid == pid
    code, ready = _ready(d)
    assert code == 200 and ready["generation"] == generation, ready


# --- the schema the door declares -------------------------------------------------------------------


@pytest.mark.parametrize("route_kind", ["completion", "chat"])
def test_the_door_declares_every_field_of_the_pinned_schema(
    schema_fields: list[SchemaField], route_kind: str
) -> None:
    """Names and aliases of ``make_llama_cmpl_schema``, read from the locked source; a nested field's
    subfields are declared under it (``stream_options.include_usage``) or by declaring the parent."""
    declared = set(declared_fields(route_kind))
    missing = []
    for f in schema_fields:
        for path in f.paths():
            if f.parent is not None and (path in declared or f.parent in declared):
                continue
            if path not in declared:
                missing.append(path)
    assert not missing, f"{route_kind}: fields of the pinned server-schema.cpp the door does not declare"


def test_the_pinned_schema_table_is_the_locked_source(schema_fields: list[SchemaField]) -> None:
    """``proxy.schema.llama`` claims to be server-schema.cpp field by field: the same names and aliases,
    nothing more, the nested ones under their parent."""
    top = {path for f in schema_fields if f.parent is None for path in f.paths()}
    nested: dict[str, set[str]] = {}
    for f in schema_fields:
        if f.parent is not None:
            nested.setdefault(f.parent, set()).update(p.split(".", 1)[1] for p in f.paths())
    assert set(LLAMA) == top
    assert {k: set(v) for k, v in NESTED.items()} == nested
    disagree = kind_disagreements(schema_fields)
    assert not disagree, "declared Value kinds that are not the source's field kinds:\n" + "\n".join(disagree)


# The source's field kind -> the Value classes that read it: field_num is a number (an integer or a
# float), field_bool a boolean, field_str a string, field_nested an object; field_json is read by a
# handler of its own, whose shape the declaration writes out (any kind).
_KINDS: dict[str, tuple[type, ...]] = {"num": (Int, Num), "bool": (Bool,), "str": (Str,), "nested": (Obj,)}


def kind_disagreements(schema_fields: list[SchemaField]) -> list[str]:
    """Each parsed field (aliases and nested ones too) whose declared ``Value`` is not of its kind. A
    field no key may send (``who: nobody``) is exempt: it is refused whatever its value."""
    out = []
    for f in schema_fields:
        wanted = _KINDS.get(f.kind)
        if wanted is None:
            continue
        for name in f.names:
            if f.parent is None:
                field = LLAMA[name]
                if field.who == "nobody":
                    continue
                value: object = field.value
            else:
                parent = LLAMA[f.parent].value
                assert isinstance(parent, Obj) and parent.fields is not None
                value = parent.fields[name]
            if isinstance(value, Grammar):
                value = value.text  # a grammar is the string it reads, measured (``proxy.schema.programs``)
            if not isinstance(value, wanted):
                where = f"{f.parent}.{name}" if f.parent else name
                out.append(f"{where}: field_{f.kind} in the source, {type(value).__name__} here")
    return out


def test_a_declared_kind_other_than_the_sources_is_named() -> None:
    """The comparison above finds a mismatch (so its silence means agreement)."""
    fields = [
        SchemaField("num", ("top_k",)),
        SchemaField("bool", ("stream",)),
        SchemaField("str", ("grammar",)),
    ]
    assert kind_disagreements(fields) == []
    fields.append(SchemaField("bool", ("top_p",)))
    assert kind_disagreements(fields) == ["top_p: field_bool in the source, Num here"]
