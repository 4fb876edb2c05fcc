"""What a body field's value may be: the kinds the request schema is written in.

Each kind checks one parsed JSON value and raises ``FieldError`` naming the value's path in the body
(``grammar_triggers[0].type``) and what it must be. A bound may depend on the request (``Context``):
the tenant's limits, the child's slots, the model's vocabulary; such a bound is a function of the
context returning the limit and whose limit it is, so the refusal says which one was met.

JSON numbers arrive as Python ``int`` (any integer literal) or ``float`` (a literal with a fraction or an
exponent); ``proxy.asgi.body`` has already refused NaN, infinities, doubles that overflow and integers
beyond 64 bits. ``bool`` is never a number here, as it is not in llama-server's JSON library.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.errors import BadRequest
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


# A bound fixed by the pinned server, or one that depends on the request: (limit, whose limit).
Bound = int | float | Callable[[Context], tuple[float, str]]


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


@dataclass(frozen=True, slots=True)
class Str:
    """A string; ``choices``: one of these exactly."""

    choices: tuple[str, ...] = ()

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if not isinstance(value, str):
            raise FieldError(path, f"must be a string, not {_kind(value)}")
        if self.choices and value not in self.choices:
            shown = value if len(value) <= 40 else value[:40] + "..."
            raise FieldError(path, f"must be one of {', '.join(self.choices)} (got {shown!r})")

    def describe(self) -> str:
        return "string" + (f" ({' | '.join(self.choices)})" if self.choices else "")


@dataclass(frozen=True, slots=True)
class Json:
    """Any JSON value: content the child treats as data (a message, a tool's JSON schema). Its depth is
    bounded for every body (``proxy.asgi.body``)."""

    def check(self, value: Any, path: str, ctx: Context) -> None:
        return None

    def describe(self) -> str:
        return "any JSON"


@dataclass(frozen=True, slots=True)
class Obj:
    """An object. ``fields``: the keys checked (others pass: nested content is the child's data, the
    closed set is the body's top level); ``required``: keys that must be there."""

    fields: Mapping[str, Value] | None = None
    required: tuple[str, ...] = ()
    # A checked key holding null: "absent" (True), or refused where the child reads it without a check.
    nulls: bool = True

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if not isinstance(value, dict):
            raise FieldError(path, f"must be an object, not {_kind(value)}")
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
        return "object"


@dataclass(frozen=True, slots=True)
class Arr:
    """An array of ``item``; ``max_items`` may be a bound of the request (the tenant's prompts)."""

    item: Value
    min_items: int = 0
    max_items: Bound | None = None

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if not isinstance(value, list):
            raise FieldError(path, f"must be an array, not {_kind(value)}")
        if len(value) < self.min_items:
            raise FieldError(path, f"must have at least {self.min_items} element(s)")
        if self.max_items is not None:
            most, whose = _limit(self.max_items, ctx)
            if len(value) > most:
                raise FieldError(path, f"has {len(value)} elements; {whose or 'the limit is'} {_fmt(most)}")
        item = self.item
        for i, element in enumerate(value):
            item.check(element, f"{path}[{i}]", ctx)

    def describe(self) -> str:
        return f"array of {self.item.describe()}"


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


@dataclass(frozen=True, slots=True)
class TokenList:
    """A prompt given as tokens: an array holding at least one token id (each within the model's
    vocabulary) and, mixed in, strings (llama-server tokenizes those)."""

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if not isinstance(value, list):
            raise FieldError(path, f"must be an array of token ids, not {_kind(value)}")
        # The common case (ids only, all in range) at C speed: 4,000 ids in about 0.1 ms instead of 2 ms
        # (tests/benchmarks/schema.py); the loop below finds and names the first bad element.
        top = INT32[1] if ctx.n_vocab is None else ctx.n_vocab - 1
        if value and all(type(e) is int for e in value) and min(value) >= 0 and max(value) <= top:
            return
        for i, element in enumerate(value):
            if isinstance(element, str):
                continue
            TOKEN.check(element, f"{path}[{i}]", ctx)

    def describe(self) -> str:
        return "array of token ids (strings mixed in are tokenized)"
