"""What a body field's value may be: the kinds the request schema is written in.

Each kind checks one parsed JSON value and raises ``FieldError`` naming the value's path in the body
(``grammar_triggers[0].type``) and what it must be. A bound may depend on the request (``Context``):
the tenant's limits, the child's slots, the model's vocabulary; such a bound is a function of the
context returning the limit and whose limit it is, so the refusal says which one was met.

Every variable-size value (string, array, object, any-JSON) carries its most (``Size``): characters,
elements, members, or characters of its JSON text. The bound's name is the value's path with indices
left out (``dry_sequence_breakers``, ``stop[]``, ``tools[].function.parameters``): a tenant's
``field_bounds`` sets it by that name. A costly value's default comes from the cost table
(``proxy.schema.costs``: measured seconds of the child's server loop per unit, scaled by the model's
vocabulary), so one request holds the loop for at most the declared budget.

JSON numbers arrive as Python ``int`` (any integer literal) or ``float`` (a literal with a fraction or an
exponent); ``proxy.asgi.body`` has already refused NaN, infinities, doubles that overflow and integers
beyond 64 bits. ``bool`` is never a number here, as it is not in llama-server's JSON library.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from proxy.errors import BadRequest
from proxy.schema.costs import COSTS, REFERENCE_VOCAB, cost_limit
from proxy.settings import TenantSettings

INT32 = (-(2**31), 2**31 - 1)
UINT32_MAX = 2**32 - 1
INT64 = (-(2**63), 2**63 - 1)
# The largest finite float32: llama-server reads every fractional field into a C float, where a larger
# double becomes infinity.
FLOAT32_MAX = 3.4028234663852886e38


class FieldError(BadRequest):
    """A body field the schema refuses: its path is the OpenAI error's ``param``."""

    code = "invalid_field"

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"'{path}' {message}")
        self.param = path

    def payload(self) -> dict[str, object]:
        out = super().payload()
        out["param"] = self.param
        return out


class UnknownField(FieldError):
    code = "unknown_field"


@dataclass(frozen=True, slots=True)
class Context:
    """What the bounds of one request depend on."""

    tenant: TenantSettings
    admin: bool
    capacity: int  # the child's slots now (0: unknown)
    n_vocab: int | None  # tokens in the model's vocabulary (None: unknown, any int32 id passes)
    # What the request's costly values hold the child for, by where ("loop", "http") and path, in
    # seconds, from the cost table (``Size.check``); ``check_body`` sums it against the budget.
    spent: dict[str, dict[str, float]] = field(default_factory=dict, compare=False)


# A bound fixed by the pinned server, or one that depends on the request: (limit, whose limit).
Bound = int | float | Callable[[Context], tuple[float, str]]

Unit = Literal["characters", "elements", "members", "entries", "characters of JSON"]
_INDEX = re.compile(r"\[\d+\]")


def bound_name(path: str) -> str:
    """The name of the bound of the value at ``path``: its path without indices (``stop[3]`` ->
    ``stop[]``); a ``field_bounds`` key."""
    return _INDEX.sub("[]", path)


@dataclass(frozen=True, slots=True)
class Size:
    """The most a value may hold, in ``unit``: ``most`` (what no real client reaches), tightened by the
    cost table's ``cost`` entry where the value costs the child's server loop per unit
    (``proxy.schema.costs``); a tenant's ``field_bounds`` entry replaces both."""

    most: int
    unit: Unit
    cost: str | None = None
    # True: bounds each element of the value (its name is the value's path + ``[]``), not the value.
    each: bool = False

    def limit(self, path: str, ctx: Context) -> tuple[int, str]:
        """The limit at ``path`` for this request, and whose it is (for the refusal)."""
        name = bound_name(path)
        own = ctx.tenant.field_bounds.get(name) if ctx.tenant.field_bounds else None
        if own is not None:
            return own, f"this tenant's bound '{name}' (tenants[].field_bounds)"
        if self.cost is not None:
            most, why = cost_limit(self.cost, self.most, ctx.n_vocab)
            return most, f"the bound '{name}' ({why}; tenants[].field_bounds raises it)"
        return self.most, f"the bound '{name}' (tenants[].field_bounds raises it)"

    def check(self, count: int, path: str, ctx: Context) -> None:
        # The name (a regular expression over the path) only where a tenant has bounds of its own or
        # for a refusal: the common case is one comparison (tests/benchmarks/schema.py).
        if count <= self.most and self.cost is None and not ctx.tenant.field_bounds:
            return
        if ctx.tenant.field_bounds and bound_name(path) in ctx.tenant.field_bounds:
            most, whose = self.limit(path, ctx)
            if count > most:
                raise FieldError(path, f"has {count} {self.unit}; {whose} is {most}")
            return  # a tenant's own bound is its operator's choice to spend more: not counted
        if self.cost is None:
            if count > self.most:
                raise FieldError(path, f"has {count} {self.unit}; {self.limit(path, ctx)[1]} is {self.most}")
            return
        most, _ = cost_limit(self.cost, self.most, ctx.n_vocab)
        if count > most:
            raise FieldError(path, f"has {count} {self.unit}; {self.limit(path, ctx)[1]} is {most}")
        # Within its own bound: counted toward the request's budget (``check_body``).
        entry = COSTS[self.cost]
        where = ctx.spent.setdefault(entry.where, {})
        where[path] = where.get(path, 0.0) + count * entry.at(ctx.n_vocab)

    def counts(self, ctx: Context) -> bool:
        """Whether a value's size must be counted at all: not where its most is as large as any body
        (``TEXT_CHARS``) and neither a cost nor a tenant's bound applies (a JSON text is not made for
        nothing)."""
        return self.most < TEXT_CHARS or self.cost is not None or bool(ctx.tenant.field_bounds)

    def describe(self) -> str:
        if self.cost is None:
            return f"at most {self.most:,} {self.unit}"
        most, _ = cost_limit(self.cost, self.most, REFERENCE_VOCAB)
        return f"at most {most:,} {self.unit}, by cost on the demo model"


class Value(Protocol):
    """One kind of value. ``describe`` is what docs/api.md says of it."""

    def check(self, value: Any, path: str, ctx: Context) -> None: ...

    def describe(self) -> str: ...


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _limit(bound: Bound, ctx: Context) -> tuple[float, str]:
    if callable(bound):
        return bound(ctx)
    return bound, ""


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


@dataclass(frozen=True, slots=True)
class Int:
    """An integer (an integral JSON number: ``2.0`` is 2, ``2.5`` is refused) within ``lo..hi``."""

    lo: Bound = INT32[0]
    hi: Bound = INT32[1]

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise FieldError(path, f"must be an integer, not {_kind(value)}")
        _in_range(value, self.lo, self.hi, path, ctx)

    def describe(self) -> str:
        return f"integer {_show(self.lo)}..{_show(self.hi)}"


@dataclass(frozen=True, slots=True)
class Num:
    """A number within ``lo..hi`` (by default any finite float32)."""

    lo: Bound = -FLOAT32_MAX
    hi: Bound = FLOAT32_MAX

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise FieldError(path, f"must be a number, not {_kind(value)}")
        _in_range(value, self.lo, self.hi, path, ctx)

    def describe(self) -> str:
        if self.lo == -FLOAT32_MAX and self.hi == FLOAT32_MAX:
            return "number (finite float32)"
        return f"number {_show(self.lo)}..{_show(self.hi)}"


def _in_range(value: float, lo: Bound, hi: Bound, path: str, ctx: Context) -> None:
    low, low_whose = _limit(lo, ctx)
    if value < low:
        raise FieldError(path, f"of {_fmt(value)} is below {low_whose or 'the minimum of'} {_fmt(low)}")
    high, high_whose = _limit(hi, ctx)
    if value > high:
        raise FieldError(path, f"of {_fmt(value)} exceeds {high_whose or 'the maximum of'} {_fmt(high)}")


def _show(bound: Bound) -> str:
    if callable(bound):
        return getattr(bound, "__doc__", None) or "(per request)"
    return _fmt(bound)


@dataclass(frozen=True, slots=True)
class Bool:
    def check(self, value: Any, path: str, ctx: Context) -> None:
        if not isinstance(value, bool):
            raise FieldError(path, f"must be a boolean, not {_kind(value)}")

    def describe(self) -> str:
        return "boolean"


# A name, an identifier, a tag: no real one is longer (OpenAI's model and function names: 64 to 256).
NAME_CHARS = 1024
# Text the child reads as a prompt or part of one: as long as the largest body the door takes (8 MiB,
# ``proxy.max_body_bytes``); the prompt's cost is a decode, bounded by the context and the token cap.
TEXT_CHARS = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Str:
    """A string of at most ``size`` characters; ``choices``: one of these exactly (bounded by them)."""

    choices: tuple[str, ...] = ()
    size: Size = Size(NAME_CHARS, "characters")

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if not isinstance(value, str):
            raise FieldError(path, f"must be a string, not {_kind(value)}")
        if self.choices:
            if value not in self.choices:
                shown = value if len(value) <= 40 else value[:40] + "..."
                raise FieldError(path, f"must be one of {', '.join(self.choices)} (got {shown!r})")
            return
        self.size.check(len(value), path, ctx)

    def describe(self) -> str:
        if self.choices:
            return f"string ({' | '.join(self.choices)})"
        return f"string, {self.size.describe()}"


def Text(most: int = TEXT_CHARS, cost: str | None = None) -> Str:
    """A string the child reads as text (a prompt, a stop string, a grammar)."""
    return Str(size=Size(most, "characters", cost))


@dataclass(frozen=True, slots=True)
class Json:
    """Any JSON value: content the child treats as data (a message, a tool's JSON schema). Its depth is
    bounded for every body (``proxy.asgi.body``), its size by ``size`` (characters of its JSON text)."""

    size: Size = Size(TEXT_CHARS, "characters of JSON")

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if isinstance(value, str | list | dict) and self.size.counts(ctx):
            self.size.check(json_chars(value), path, ctx)

    def describe(self) -> str:
        return f"any JSON, {self.size.describe()}"


def json_chars(value: Any) -> int:
    """Characters of ``value``'s compact JSON text (at C speed: about 3 ms a MiB)."""
    if isinstance(value, str):
        return len(value) + 2
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


# Members of an object the child reads key by key (a message, a tool): a few dozen at most in any API.
OBJ_MEMBERS = 256


@dataclass(frozen=True, slots=True)
class Obj:
    """An object. ``fields``: the keys checked (others pass: nested content is the child's data, the
    closed set is the body's top level); ``required``: keys that must be there. ``size``: its members;
    ``text``: its JSON text, where it holds unchecked content (the members not in ``fields``)."""

    fields: Mapping[str, Value] | None = None
    required: tuple[str, ...] = ()
    # A checked key holding null: "absent" (True), or refused where the child reads it without a check.
    nulls: bool = True
    size: Size = Size(OBJ_MEMBERS, "members")
    text: Size = Size(TEXT_CHARS, "characters of JSON")

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if not isinstance(value, dict):
            raise FieldError(path, f"must be an object, not {_kind(value)}")
        self.size.check(len(value), path, ctx)
        if self.text.counts(ctx) and (self.fields is None or any(k not in self.fields for k in value)):
            self.text.check(json_chars(value), path, ctx)
        for name in self.required:
            if name not in value:
                raise FieldError(f"{path}.{name}", "is required")
        for name, kind in (self.fields or {}).items():
            if name not in value:
                continue
            if value[name] is None:
                if not self.nulls:
                    raise FieldError(f"{path}.{name}", "must not be null")
                continue
            kind.check(value[name], f"{path}.{name}", ctx)

    def describe(self) -> str:
        return (
            f"object ({self.size.describe()}; its JSON text {self.text.describe().removeprefix('at most ')})"
        )


# Elements of a list a client writes (messages, tools, names): far beyond any API's (Anthropic: 100,000
# messages a request; OpenAI: 128 tools).
ARR_ITEMS = 100_000


@dataclass(frozen=True, slots=True)
class Arr:
    """An array of ``item``, at most ``size`` elements; ``max_items`` may be a bound of the request that
    is not a size (the tenant's prompts, each a task of its own)."""

    item: Value
    min_items: int = 0
    max_items: Bound | None = None
    size: Size = Size(ARR_ITEMS, "elements")

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if not isinstance(value, list):
            raise FieldError(path, f"must be an array, not {_kind(value)}")
        if len(value) < self.min_items:
            raise FieldError(path, f"must have at least {self.min_items} element(s)")
        self.size.check(len(value), path, ctx)
        if self.max_items is not None:
            most, whose = _limit(self.max_items, ctx)
            if len(value) > most:
                raise FieldError(path, f"has {len(value)} elements; {whose or 'the limit is'} {_fmt(most)}")
        item = self.item
        for i, element in enumerate(value):
            item.check(element, f"{path}[{i}]", ctx)

    def describe(self) -> str:
        return f"array ({self.size.describe()}) of {self.item.describe()}"


@dataclass(frozen=True, slots=True)
class Either:
    """The first of ``kinds`` whose JSON type matches decides (so its own, precise, error is shown)."""

    kinds: tuple[Value, ...]

    def check(self, value: Any, path: str, ctx: Context) -> None:
        for kind in self.kinds:
            if _matches_type(kind, value):
                kind.check(value, path, ctx)
                return
        raise FieldError(path, f"must be {self.describe()}, not {_kind(value)}")

    def describe(self) -> str:
        return " or ".join(k.describe() for k in self.kinds)


def _matches_type(kind: Value, value: Any) -> bool:
    if isinstance(kind, Int | Num):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(kind, Bool):
        return isinstance(value, bool)
    if isinstance(kind, Str):
        return isinstance(value, str)
    if isinstance(kind, Arr | TokenList):
        return isinstance(value, list)
    if isinstance(kind, Obj):
        return isinstance(value, dict)
    if isinstance(kind, Either):
        return any(_matches_type(k, value) for k in kind.kinds)
    return True  # Json and the composite kinds (Prompt, LogitBias) take any JSON type and judge it themselves


def vocab(ctx: Context) -> tuple[float, str]:
    """the vocabulary's size - 1"""
    if ctx.n_vocab is None:
        return INT32[1], "the largest token id,"
    return ctx.n_vocab - 1, "the model's largest token id,"


TOKEN = Int(0, vocab)


# A prompt of tokens: 8 MiB of body holds about 1.4 million short ids; no context is that long.
TOKENS = 1_048_576


@dataclass(frozen=True, slots=True)
class TokenList:
    """A prompt given as tokens: an array holding at least one token id (each within the model's
    vocabulary) and, mixed in, strings (llama-server tokenizes those), at most ``size`` elements and
    each string at most ``text`` characters."""

    size: Size = Size(TOKENS, "elements")
    text: Size = Size(TEXT_CHARS, "characters", each=True)

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if not isinstance(value, list):
            raise FieldError(path, f"must be an array of token ids, not {_kind(value)}")
        self.size.check(len(value), path, ctx)
        # The common case (ids only, all in range) at C speed: 4,000 ids in about 0.1 ms instead of 2 ms
        # (tests/benchmarks/schema.py); the loop below finds and names the first bad element.
        top = INT32[1] if ctx.n_vocab is None else ctx.n_vocab - 1
        if value and all(type(e) is int for e in value) and min(value) >= 0 and max(value) <= top:
            return
        for i, element in enumerate(value):
            if isinstance(element, str):
                self.text.check(len(element), f"{path}[{i}]", ctx)
                continue
            TOKEN.check(element, f"{path}[{i}]", ctx)

    def describe(self) -> str:
        return f"array of token ids ({self.size.describe()}; strings mixed in are tokenized)"
