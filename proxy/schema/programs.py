"""Programs inside strings, measured at the door: a GBNF ``grammar``, a JSON schema the child converts to
one (``json_schema``, ``response_format``, tool parameters), a grammar trigger's regular expression.

Each is a small program the pinned child compiles on its server loop, or on an HTTP thread, before the
first token: what it costs there depends on its structure, not on its size in bytes. A grammar nested
60,000 parentheses deep (120 KB) kills the child (ggml-org/llama.cpp #26600); a schema ``enum`` of
100,000 strings holds the loop about 70 s; a 30-line grammar whose rules each have two nullable
alternatives makes the child's left-recursion check take 2^30 steps. So each is read here, as the child
reads it, far enough to count what costs: nesting, rules, alternatives, repetitions, reference chains.
Every reader is iterative (an explicit stack, never Python recursion a hostile body could overflow) and
linear in its input; a count that passes its bound stops the read at once.

What each bound is and why (the measured costs are docs/security.md's "Programs inside strings"):
``tests/benchmarks/program_cost.py`` measures them on the pinned child. Where the child already refuses
a shape (the GBNF parser's repetition limit of 2000, a malformed schema), the door refuses it too, with
the same reason: a request the child would refuse never reaches it, and none gets a 5xx.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from proxy.schema.values import Context, FieldError, Value


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """Bounds of one GBNF grammar, as llama.cpp's parser (``src/llama-grammar.cpp``) builds it."""

    # Parenthesised groups inside one another: the parser recurses twice per level; about 60,000 levels
    # overflow its stack (#26600); PR #26602 proposes 1000, which no hand-written grammar comes near.
    nesting: int = 1000
    # Rules, named and synthesised (each group and each repetition adds some).
    rules: int = 4000
    # Grammar elements once repetitions are expanded (``x{m,n}`` copies x up to n times): the memory and
    # the time of every later step are in proportion.
    elements: int = 100_000
    # Alternatives over all rules (an enum of N strings is N): each is a stack the sampler tests every
    # candidate token against (measured: 500 held the loop 0.52 s, 2,000 2.2 s).
    alternatives: int = 500
    # Stacks the grammar starts with (alternatives reachable before the first character, through rule
    # references; nested alternatives multiply): the sampler tests every candidate token against each,
    # every token (measured: 1,023 stacks held the loop 0.83 s, 500 alternatives 0.52 s).
    stacks: int = 500
    # Rules reached from one another through their leftmost reference (``r0 ::= r1 ...``): the depth of
    # the child's recursion in ``llama_grammar_detect_left_recursion``.
    chain: int = 1000
    # Steps of that check: it does not remember a rule it has already checked, so nullable references
    # make it exponential in the chain.
    steps: int = 200_000


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """Bounds of one JSON schema, as ``common/json-schema.cpp`` builds it and
    ``common/json-schema-to-grammar.cpp`` converts it."""

    # Schema nodes built (a ``type`` array builds the node once per type; a ``$ref`` builds its target).
    nodes: int = 2000
    # Nodes inside one another, ``$ref`` hops included: the builder and the converter recurse per level.
    depth: int = 64
    # ``$ref`` hops along one path.
    ref_chain: int = 32
    # Members of every ``enum`` together: each becomes an alternative of the grammar (measured: 500 held
    # the loop 0.41 s, 2,000 2.6 s, 100,000 about 70 s).
    enum_members: int = 500
    # Properties of one object: the converter's optional-property rules cost the cube of their number
    # (measured: 100 held the loop 0.46 s, 300 0.72 s).
    properties: int = 100
    # Characters of a property name (the converter builds a trie of them, recursively, one level a char).
    property_name: int = 256
    # Grammar copies that repetitions ask for, over the whole schema (``minItems``/``maxItems``,
    # ``minLength``/``maxLength``, ``{m,n}`` in a pattern): each up to 2000 rules in the child's parser.
    repetitions: int = 10_000
    # A ``pattern``: its length, and its groups inside one another.
    pattern_length: int = 1000
    pattern_nesting: int = 32


@dataclass(frozen=True, slots=True)
class RegexLimits:
    """Bounds of a grammar trigger's pattern (compiled by ``std::regex``, a recursive compiler and a
    backtracking matcher, then run against the generated text after every token)."""

    length: int = 1000
    nesting: int = 32
    # ``{m,n}`` counts: std::regex copies the repeated state m..n times.
    repetition: int = 1000


GRAMMAR = GrammarLimits()
SCHEMA = SchemaLimits()
REGEX = RegexLimits()

# The pinned parser's own repetition limit (``MAX_REPETITION_THRESHOLD``): ``{m,n}`` with m above it is
# refused, n above it becomes unbounded, and a repetition whose copies multiply past it is refused.
_CHILD_REPETITION = 2000


class ProgramError(Exception):
    """A program the door refuses: ``what`` says which bound or rule, ``where`` the offset or path."""

    def __init__(self, what: str, where: str = "") -> None:
        super().__init__(what)
        self.what = what
        self.where = where


def _over(count: int, limit: int, what: str, where: str = "") -> None:
    if count > limit:
        raise ProgramError(f"{what} exceeds the limit of {limit}", where)


# --- GBNF -------------------------------------------------------------------------------------------------


def _word(c: str) -> bool:
    return ("a" <= c <= "z") or ("A" <= c <= "Z") or ("0" <= c <= "9") or c == "-"


_HEX = frozenset("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset('trn\\"[]-')
_TERMINAL = -1  # an element that is no rule reference (a character, a range, a token)


@dataclass
class _Seq:
    """One rule's alternates being parsed: the rule's id, its alternatives so far (rule references and
    ``_TERMINAL`` marks, one per literal or class), and the repetition state of its last symbol."""

    rule: int
    nested: bool
    alts: list[list[int]]
    length: int = 0  # elements of the rule so far, as the child counts them
    last_start: int = 0  # where the last symbol began (elements)
    last_alt_start: int = 0  # ... and in the current alternative's item list
    prev_rules: int = 1  # the child's ``n_prev_rules``
    symbols_before: int = 0  # symbols when this group began


class _Grammar:
    """A GBNF reader that builds what llama.cpp's parser builds, counting as it goes."""

    def __init__(self, text: str, limits: GrammarLimits) -> None:
        # The child reads a C string: a NUL ends the grammar.
        self.s = text.split("\x00", 1)[0]
        self.n = len(self.s)
        self.limits = limits
        self.symbols: dict[str, int] = {}
        self.rules: dict[int, list[list[int]]] = {}
        self.elements = 0
        self.alternatives = 0
        self.pos = 0

    # -- lexing, as parse_space / parse_name / parse_char -------------------------------------------------
    def space(self, newline_ok: bool) -> None:
        s, n, p = self.s, self.n, self.pos
        while p < n:
            c = s[p]
            if c == "#":
                while p < n and s[p] not in "\r\n":
                    p += 1
            elif c in " \t" or (newline_ok and c in "\r\n"):
                p += 1
            else:
                break
        self.pos = p

    def at(self, offset: int = 0) -> str:
        p = self.pos + offset
        return self.s[p] if p < self.n else ""

    def fail(self, what: str) -> ProgramError:
        return ProgramError(what, f"offset {self.pos}")

    def name(self) -> str:
        start = self.pos
        while self.pos < self.n and _word(self.s[self.pos]):
            self.pos += 1
        if self.pos == start:
            raise self.fail("expecting a rule name")
        return self.s[start : self.pos]

    def char(self) -> None:
        """One character of a literal or a class (an escape counts as one)."""
        if self.pos >= self.n:
            raise self.fail("unexpected end of input")
        if self.s[self.pos] != "\\":
            self.pos += 1
            return
        kind = self.at(1)
        digits = {"x": 2, "u": 4, "U": 8}.get(kind)
        if digits is not None:
            self.pos += 2
            for _ in range(digits):
                if self.at() not in _HEX or not self.at():
                    raise self.fail(f"expecting {digits} hex chars")
                self.pos += 1
            return
        if kind and kind in _SIMPLE_ESCAPES:
            self.pos += 2
            return
        raise self.fail("unknown escape")

    def symbol(self, name: str) -> int:
        found = self.symbols.get(name)
        if found is None:
            found = self.symbols[name] = len(self.symbols)
            _over(len(self.symbols), self.limits.rules, "the grammar's rule count")
        return found

    def generated(self, base: str) -> int:
        next_id = len(self.symbols)
        self.symbols[f"{base}_{next_id}"] = next_id
        _over(len(self.symbols), self.limits.rules, "the grammar's rule count")
        return next_id

    def add_elements(self, count: int) -> None:
        self.elements += count
        _over(self.elements, self.limits.elements, "the grammar's elements (repetitions expanded)")

    # -- parsing, as parse_rule / parse_alternates / parse_sequence, with an explicit stack ---------------
    def parse(self) -> None:
        self.space(True)
        while self.pos < self.n:
            name = self.name()
            self.space(False)
            if self.s[self.pos : self.pos + 3] != "::=":
                raise self.fail("expecting ::=")
            self.pos += 3
            self.space(True)
            self.alternates(self.symbol(name), name)
            c = self.at()
            if c == "\r":
                self.pos += 2 if self.at(1) == "\n" else 1
            elif c == "\n":
                self.pos += 1
            elif c:
                raise self.fail("expecting newline or end")
            self.space(True)
        rule_count = max(self.symbols.values(), default=-1) + 1
        for rule_id in range(rule_count):
            if rule_id not in self.rules:
                missing = next(k for k, v in self.symbols.items() if v == rule_id)
                raise ProgramError(f"undefined rule '{missing}'")
        if "root" not in self.symbols:
            raise ProgramError("the grammar has no 'root' rule")

    def alternates(self, rule_id: int, name: str) -> None:
        stack = [_Seq(rule_id, False, [[]], symbols_before=len(self.symbols))]
        while stack:
            seq = stack[-1]
            opened = self.sequence(seq, name)
            if opened is not None:
                _over(len(stack), self.limits.nesting, "the grammar's nesting depth", f"offset {self.pos}")
                stack.append(opened)
                continue
            # The sequence ended: another alternative, or the end of these alternates.
            if self.at() == "|":
                self.alternatives += 1
                _over(self.alternatives, self.limits.alternatives, "the grammar's alternatives")
                self.add_elements(1)  # ALT
                seq.alts.append([])
                self.pos += 1
                self.space(True)
                seq.last_start = seq.length = seq.length + 1
                seq.last_alt_start = 0
                seq.prev_rules = 1
                continue
            self.add_elements(1)  # END
            self.rules[seq.rule] = seq.alts
            stack.pop()
            if not stack:
                return
            if self.at() != ")":
                raise self.fail("expecting ')'")
            parent = stack[-1]
            self.push(parent, [seq.rule], 1)
            # A group's copies count as many as the rules it made (``n_prev_rules``).
            parent.prev_rules = max(1, len(self.symbols) - seq.symbols_before)
            self.pos += 1
            self.space(parent.nested)

    def push(self, seq: _Seq, items: list[int], elements: int) -> None:
        """A new symbol ends the sequence: it is the one a repetition applies to."""
        alt = seq.alts[-1]
        seq.last_start = seq.length
        seq.last_alt_start = len(alt)
        seq.prev_rules = 1
        seq.length += elements
        self.add_elements(elements)
        alt.extend(items)

    def sequence(self, seq: _Seq, name: str) -> _Seq | None:
        """Read symbols until the sequence ends (None) or a group opens (its new sequence)."""
        while self.pos < self.n:
            c = self.s[self.pos]
            if c == '"':
                self.pos += 1
                count = 0
                while self.at() != '"':
                    self.char()
                    count += 1
                self.pos += 1
                self.push(seq, [_TERMINAL] if count else [], count)
                self.space(seq.nested)
            elif c == "[":
                self.pos += 1
                if self.at() == "^":
                    self.pos += 1
                count = 0
                while self.at() != "]":
                    self.char()
                    count += 1
                    if self.at() == "-" and self.at(1) != "]":
                        if not self.at(1):
                            raise self.fail("unexpected end of input")
                        self.pos += 1
                        self.char()
                        count += 1
                self.pos += 1
                self.push(seq, [_TERMINAL] if count else [], count)
                self.space(seq.nested)
            elif c in "<!":
                if c == "!":
                    self.pos += 1
                self.token()
                self.push(seq, [_TERMINAL], 1)
                self.space(seq.nested)
            elif _word(c):
                ref = self.symbol(self.name())
                self.space(seq.nested)
                self.push(seq, [ref], 1)
            elif c == "(":
                self.pos += 1
                self.space(True)
                before = len(self.symbols)
                return _Seq(self.generated(name), True, [[]], symbols_before=before)
            elif c == ".":
                self.push(seq, [_TERMINAL], 1)
                self.pos += 1
                self.space(seq.nested)
            elif c in "*+?":
                self.pos += 1
                self.space(seq.nested)
                self.repeat(seq, name, {"*": 0, "+": 1, "?": 0}[c], None if c != "?" else 1)
            elif c == "{":
                self.pos += 1
                self.space(seq.nested)
                low = self.integer()
                self.space(seq.nested)
                high: int | None = None
                if self.at() == "}":
                    high = low
                    self.pos += 1
                    self.space(seq.nested)
                elif self.at() == ",":
                    self.pos += 1
                    self.space(seq.nested)
                    if self.at().isdigit():
                        high = self.integer()
                        self.space(seq.nested)
                    if self.at() != "}":
                        raise self.fail("expecting '}'")
                    self.pos += 1
                    self.space(seq.nested)
                else:
                    raise self.fail("expecting ','")
                if low > _CHILD_REPETITION:
                    raise self.fail(f"a repetition of more than {_CHILD_REPETITION} (the parser's own limit)")
                if high is not None and high > _CHILD_REPETITION:
                    high = None  # the child makes it unbounded
                self.repeat(seq, name, low, high)
            else:
                break
        return None

    def integer(self) -> int:
        start = self.pos
        while self.at().isdigit() and self.at() in "0123456789":
            self.pos += 1
        if self.pos == start:
            raise self.fail("expecting an integer")
        # Only its size matters past the child's limit; a number this long is over it anyway.
        digits = self.s[start : self.pos].lstrip("0") or "0"
        return int(digits) if len(digits) <= 18 else 10**18

    def token(self) -> None:
        if self.at() != "<":
            raise self.fail("expecting '<'")
        self.pos += 1
        if self.at() == "[":
            self.pos += 1
            if self.integer() > 2**32 - 1:
                raise self.fail("token id too big")
            if self.at() != "]" or self.at(1) != ">":
                raise self.fail("expecting ']>'")
            self.pos += 2
            return
        end = self.s.find(">", self.pos)
        if end < 0:
            raise self.fail("expecting '>'")
        self.pos = end + 1

    def repeat(self, seq: _Seq, name: str, low: int, high: int | None) -> None:
        """``handle_repetitions``: S{m,n} is S m times, then n-m nested optional rules (one if unbounded)."""
        alt = seq.alts[-1]
        size = seq.length - seq.last_start
        if size == 0:
            raise self.fail("expecting an item before the repetition")
        total = high if high is not None and high > 0 else (low if low > 0 else 1)
        if seq.prev_rules * total > _CHILD_REPETITION:
            raise self.fail(
                f"repetitions multiply to more than {_CHILD_REPETITION} copies (the parser's own limit)"
            )
        items = alt[seq.last_alt_start :]
        if low == 0:
            del alt[seq.last_alt_start :]
            self.elements -= size
            seq.length -= size
        else:
            self.add_elements(size * (low - 1))
            seq.length += size * (low - 1)
            alt.extend(items * (low - 1))  # bounded: the elements were counted first
        optional = 1 if high is None else high - low
        last = -1
        for i in range(optional):
            rec = self.generated(name)
            body = list(items)
            if i > 0 or high is None:
                body.append(rec if high is None else last)
            self.rules[rec] = [body, []]  # S S' | (empty)
            self.add_elements(size + (1 if (i > 0 or high is None) else 0) + 2)
            last = rec
        if optional > 0:
            alt.append(last)
            seq.length += 1
            self.add_elements(1)
        seq.prev_rules *= total


def _leftmost(grammar: _Grammar, limits: GrammarLimits) -> None:
    """What ``llama_grammar_init_impl`` does before the first token, counted: the left-recursion check
    (its depth and its steps; it revisits what it already checked) and the stacks the grammar starts with
    (alternatives through leftmost references, multiplied)."""
    rules = grammar.rules
    empty = {r: any(not alt for alt in alts) for r, alts in rules.items()}

    def leftmost_refs(r: int) -> Iterator[int]:
        # The references the check recurses into: the first of each alternative, and the next while the
        # ones before may be empty.
        for alt in rules[r]:
            for item in alt:
                if item == _TERMINAL:
                    break
                yield item
                if not empty[item]:
                    break

    # Post-order over the leftmost-reference graph, with an explicit stack: depth, steps, stacks.
    steps: dict[int, int] = {}
    depth: dict[int, int] = {}
    stacks: dict[int, tuple[int, int]] = {}  # (stacks ending at a terminal, ways through empty)
    cap = max(limits.steps, limits.stacks) + 1
    total_steps = 0
    for start in sorted(rules):
        if start in steps:
            continue
        todo: list[tuple[int, bool]] = [(start, False)]
        on_path: set[int] = set()
        while todo:
            r, done = todo.pop()
            if done:
                on_path.discard(r)
                kids = list(leftmost_refs(r))
                steps[r] = min(cap, 1 + sum(steps[k] for k in kids))
                depth[r] = 1 + max((depth[k] for k in kids), default=0)
                stacks[r] = _stacks_of(rules[r], stacks, cap)
                continue
            if r in steps:
                continue
            if r in on_path:
                raise ProgramError("the grammar is left-recursive (the child refuses it)")
            on_path.add(r)
            todo.append((r, True))
            _over(len(on_path), limits.chain, "the grammar's chain of leftmost rule references")
            todo.extend((k, False) for k in leftmost_refs(r) if k not in steps)
            # A kid met again while on the path is a cycle: checked when it is popped.
            for k in leftmost_refs(r):
                if k in on_path:
                    raise ProgramError("the grammar is left-recursive (the child refuses it)")
        total_steps += steps[start]
        _over(total_steps, limits.steps, "the steps of the child's left-recursion check")
    _over(depth[grammar.symbols["root"]], limits.chain, "the grammar's chain of leftmost rule references")
    _over(stacks[grammar.symbols["root"]][0], limits.stacks, "the stacks the grammar starts with")


def _stacks_of(alts: list[list[int]], known: dict[int, tuple[int, int]], cap: int) -> tuple[int, int]:
    """(terminal stacks, ways to end empty) of a rule, from its alternatives' leftmost items."""
    terminal = through = 0
    for alt in alts:
        t, e = 0, 1  # ways that reach the current item
        for item in alt:
            it, ie = (1, 0) if item == _TERMINAL else known.get(item, (1, 0))
            t += e * it
            e *= ie
            if e == 0:
                break
        terminal = min(cap, terminal + t)
        through = min(cap, through + e)
    return terminal, through


def measure_grammar(text: str, limits: GrammarLimits = GRAMMAR) -> None:
    """Refuse (``ProgramError``) a grammar the child's parser would refuse, or one over a bound."""
    grammar = _Grammar(text, limits)
    grammar.parse()
    _leftmost(grammar, limits)


# --- JSON schema ------------------------------------------------------------------------------------------


# Schema nodes still to build: (schema, path, depth, $ref hops).
_Todo = list[tuple[Any, str, int, int]]


@dataclass(frozen=True, slots=True)
class Totals:
    """What schemas measured so far in one request cost together: nodes, enum members, repetitions."""

    nodes: int = 0
    members: int = 0
    repetitions: int = 0


class _SchemaWalk:
    """``common_chat_schema_from_json``, walked with an explicit stack: the nodes it builds (a ``type``
    array once per type, each ``$ref`` target once per distinct reference), their depth, the ``$ref``
    hops, and what the converter will expand (enum members, repetitions, patterns)."""

    def __init__(self, root: Any, limits: SchemaLimits, totals: Totals | None = None) -> None:
        self.root = root
        self.limits = limits
        # Counts carried over from the schemas measured before in the same request (a request's tools).
        start = totals or Totals()
        self.nodes = start.nodes
        self.members = start.members
        self.repetitions = start.repetitions
        self.refs: set[str] = set()

    def totals(self) -> Totals:
        return Totals(self.nodes, self.members, self.repetitions)

    def fail(self, path: str, what: str) -> ProgramError:
        return ProgramError(what, path)

    def run(self) -> None:
        # (schema, path, depth, ref hops)
        todo: _Todo = [(self.root, "#", 0, 0)]
        while todo:
            schema, path, depth, hops = todo.pop()
            self.nodes += 1
            _over(self.nodes, self.limits.nodes, "the schema's nodes (type arrays and $ref targets built)")
            _over(depth, self.limits.depth, "the schema's nesting depth", path)
            todo.extend(self.node(schema, path, depth, hops))

    def node(self, schema: Any, path: str, depth: int, hops: int) -> _Todo:
        if not isinstance(schema, dict):
            raise self.fail(path, "a schema must be an object")
        down = depth + 1
        if "$ref" in schema:
            return self.ref(schema["$ref"], path, down, hops)
        for key in ("oneOf", "anyOf"):
            if key in schema:
                return self.alternatives(schema[key], f"{path}/{key}", down, hops)
        kind = schema.get("type")
        if isinstance(kind, list):
            if not kind:
                raise self.fail(path, "type must not be empty")
            # The child copies the schema once per type.
            return [({**schema, "type": t}, f"{path}/type/{i}", down, hops) for i, t in enumerate(kind)]
        if "const" in schema:
            return []
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise self.fail(path, "enum must be a non-empty array")
            self.members += len(values)
            _over(self.members, self.limits.enum_members, "the schema's enum members", path)
            return []
        if kind is not None and not isinstance(kind, str):
            raise self.fail(path, "type must be a string or an array of strings")
        name = kind or ""
        has_properties = "properties" in schema or (
            "additionalProperties" in schema and schema["additionalProperties"] is not True
        )
        if name == "":
            if has_properties:
                return self.object(schema, path, down, hops)
            if "allOf" in schema:
                return self.alternatives(schema["allOf"], f"{path}/allOf", down, hops)
            if "items" in schema or "prefixItems" in schema:
                return self.array(schema, path, down, hops)
            if any(k in schema for k in ("pattern", "minLength", "maxLength")) or _format(schema, path):
                return self.string(schema, path)
            return []
        if name == "object":
            if not has_properties and "allOf" in schema:
                return self.alternatives(schema["allOf"], f"{path}/allOf", down, hops)
            return self.object(schema, path, down, hops)
        if name == "string":
            if "allOf" in schema:
                return self.alternatives(schema["allOf"], f"{path}/allOf", down, hops)
            return self.string(schema, path)
        if name == "array":
            return self.array(schema, path, down, hops)
        if name == "integer":
            for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
                value = schema.get(key)
                if key in schema and (not isinstance(value, int | float) or isinstance(value, bool)):
                    raise self.fail(path, f"{key} must be a number")
            return []
        if name in ("number", "boolean", "null"):
            return []
        raise self.fail(path, f"unrecognized type {name}")

    def ref(self, ref: Any, path: str, depth: int, hops: int) -> _Todo:
        if not isinstance(ref, str):
            raise self.fail(path, "$ref must be a string")
        if not ref.startswith("#/"):
            raise self.fail(path, f"unsupported $ref {ref[:80]}: only references into the same document")
        _over(hops + 1, self.limits.ref_chain, "the schema's chain of $ref", path)
        if ref in self.refs:
            return []
        self.refs.add(ref)
        target = self.resolve(ref, path)
        # A reference whose target is a reference... back to itself describes no value, and the
        # converter's allOf follows such a cycle without end.
        seen = {ref}
        follow = target
        while isinstance(follow, dict) and isinstance(follow.get("$ref"), str):
            nxt = follow["$ref"]
            if nxt in seen:
                raise self.fail(path, f"$ref {ref[:80]} is a cycle of references with no schema")
            seen.add(nxt)
            _over(hops + len(seen), self.limits.ref_chain, "the schema's chain of $ref", path)
            if not nxt.startswith("#/"):
                break
            follow = self.resolve(nxt, path)
        return [(target, ref, depth, hops + 1)]

    def resolve(self, ref: str, path: str) -> Any:
        target: Any = self.root
        for sel in ref[1:].split("/")[1:]:
            if isinstance(target, dict) and sel in target:
                target = target[sel]
            elif isinstance(target, list):
                index = int(sel) if sel.isdigit() and sel.isascii() else len(target)
                if index >= len(target):
                    raise self.fail(path, f"cannot resolve $ref {ref[:80]}: {sel[:40]} is out of range")
                target = target[index]
            else:
                raise self.fail(path, f"cannot resolve $ref {ref[:80]}: {sel[:40]} not found")
        return target

    def alternatives(self, alts: Any, path: str, depth: int, hops: int) -> _Todo:
        if not isinstance(alts, list):
            raise self.fail(path, "must be an array of schemas")
        if not alts:
            raise self.fail(path, "must not be empty")
        return [(alt, f"{path}/{i}", depth, hops) for i, alt in enumerate(alts)]

    def object(self, schema: dict[str, Any], path: str, depth: int, hops: int) -> _Todo:
        out: _Todo = []
        if "properties" in schema:
            properties = schema["properties"]
            if not isinstance(properties, dict):
                raise self.fail(path, "properties must be an object")
            _over(len(properties), self.limits.properties, "the properties of one object", path)
            for name, prop in properties.items():
                _over(len(name), self.limits.property_name, "a property name's length", path)
                out.append((prop, f"{path}/properties/{name[:40]}", depth, hops))
        if "additionalProperties" in schema:
            extra = schema["additionalProperties"]
            if isinstance(extra, dict):
                out.append((extra, f"{path}/additionalProperties", depth, hops))
            elif not isinstance(extra, bool):
                raise self.fail(path, "additionalProperties must be a boolean or a schema")
        return out

    def array(self, schema: dict[str, Any], path: str, depth: int, hops: int) -> _Todo:
        out: _Todo = []
        if "items" in schema or "prefixItems" in schema:
            key = "items" if "items" in schema else "prefixItems"
            items = schema[key]
            if isinstance(items, list):
                return [(item, f"{path}/{key}/{i}", depth, hops) for i, item in enumerate(items)]
            out.append((items, f"{path}/{key}", depth, hops))
        low = _count(schema, "minItems", path, 0)
        high = _count(schema, "maxItems", path, -1)
        self.repeat(low, high, path)
        return out

    def string(self, schema: dict[str, Any], path: str) -> _Todo:
        pattern = schema.get("pattern", "")
        if not isinstance(pattern, str):
            raise self.fail(path, "pattern must be a string")
        formatted = _format(schema, path)
        low = _count(schema, "minLength", path, 0)
        high = _count(schema, "maxLength", path, -1)
        if pattern:
            self.repetitions += _pattern(pattern, path, self.limits)
            _over(self.repetitions, self.limits.repetitions, "the schema's repetitions", path)
        elif not formatted and (low > 0 or high >= 0):
            self.repeat(low, high, path)
        return []

    def repeat(self, low: int, high: int, path: str) -> None:
        """What ``build_repetition`` then the GBNF parser make of minItems..maxItems (or a length)."""
        if low > _CHILD_REPETITION:
            raise self.fail(path, f"a minimum of more than {_CHILD_REPETITION} (the child's grammar limit)")
        bounded = 0 <= high <= _CHILD_REPETITION
        self.repetitions += max(low, high if bounded else 1)
        _over(self.repetitions, self.limits.repetitions, "the schema's repetitions", path)


def _count(schema: dict[str, Any], key: str, path: str, default: int) -> int:
    if key not in schema:
        return default
    value = schema[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProgramError(f"{key} must be a non-negative integer", path)
    if value > 2**31 - 1:
        raise ProgramError(f"{key} must fit a 32-bit integer", path)
    return value


def _format(schema: dict[str, Any], path: str) -> bool:
    if "format" not in schema:
        return False
    value = schema["format"]
    if not isinstance(value, str):
        raise ProgramError("format must be a string", path)
    return value in ("date", "time", "date-time", "uuid") or (
        len(value) == 5 and value.startswith("uuid") and value[4] in "12345"
    )


_NON_LITERAL = frozenset("|.()[]{}*+?^$")


def _pattern(pattern: str, path: str, limits: SchemaLimits) -> int:
    """A schema ``pattern`` as the converter's ``_pattern_to_rule`` reads it: refused when the child would
    refuse it (an invalid regex) or when it is over a bound; else the repetitions it expands to. One that
    is not anchored ``^...$`` (or uses what the converter does not support) becomes "any string"."""
    _over(len(pattern), limits.pattern_length, "a pattern's length", path)
    if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
        return 0
    s = pattern[1:-1]
    n = len(s)
    i = 0
    depth = 0
    seq = [0]  # items in the sequence of each open group
    repetitions = 0
    while i < n:
        c = s[i]
        if c == "(":
            i += 1
            if i < n and s[i] == "?":
                if i + 1 < n and s[i + 1] == ":":
                    i += 2
                else:
                    return 0  # unsupported group syntax: any string
            depth += 1
            if depth > 100:  # the converter's own MAX_PATTERN_DEPTH: any string
                return 0
            _over(depth, limits.pattern_nesting, "a pattern's group nesting", path)
            seq[-1] += 1
            seq.append(0)
        elif c == ")":
            i += 1
            if depth == 0:
                raise ProgramError("invalid pattern: unbalanced parentheses", path)
            depth -= 1
            seq.pop()
        elif c in "^$":
            return 0
        elif c == "[":
            i += 1
            while i < n and s[i] != "]":
                if s[i] == "\\":
                    length = _gbnf_escape(s, i)
                    if length == 0:
                        return 0
                    i += length
                else:
                    i += 1
            if i >= n:
                raise ProgramError("invalid pattern: unterminated character class", path)
            i += 1
            seq[-1] += 1
        elif c == "|" or c == ".":
            seq[-1] += 1
            i += 1
        elif c in "*+?":
            if seq[-1] == 0:
                raise ProgramError("invalid pattern: nothing to repeat", path)
            i += 1
        elif c == "{":
            end = s.find("}", i)
            if end < 0:
                return 0
            nums = s[i + 1 : end].split(",")
            i = end + 1
            if len(nums) not in (1, 2):
                return 0
            if len(nums) == 1:
                low = high = _stoi(nums[0])
            else:
                low = _stoi(nums[0]) if nums[0] else 0
                high = _stoi(nums[1]) if nums[1] else -1
            if low is None or high is None:
                return 0  # std::stoi threw: any string
            if seq[-1] == 0:
                raise ProgramError("invalid pattern: nothing to repeat", path)
            if low > _CHILD_REPETITION or low < 0:
                raise ProgramError(f"a pattern repetition of more than {_CHILD_REPETITION}", path)
            repetitions += max(low, high if 0 <= high <= _CHILD_REPETITION else 1)
        else:
            start = i
            while i < n:
                if s[i] == "\\":
                    if i == n - 1:
                        raise ProgramError("invalid pattern: trailing backslash", path)
                    if s[i + 1] in _NON_LITERAL:
                        i += 2
                    else:
                        length = _gbnf_escape(s, i)
                        if length == 0:
                            return 0
                        i += length
                elif s[i] not in _NON_LITERAL and (
                    i == n - 1 or i == start or s[i + 1] == "." or s[i + 1] not in _NON_LITERAL
                ):
                    i += 1
                else:
                    break
            if i == start:
                return 0  # a stray ']' or '}': any string
            seq[-1] += 1
    if depth != 0:
        raise ProgramError("invalid pattern: unbalanced parentheses", path)
    return repetitions


def _stoi(text: str) -> int | None:
    """``std::stoi``: leading blanks, a sign, the digits that follow (the rest ignored); None where it
    throws (no digits, or beyond int32)."""
    digits = text.lstrip(" \t\n\r\f\v")
    sign = -1 if digits[:1] == "-" else 1
    if digits[:1] in "+-" and digits[:1]:
        digits = digits[1:]
    end = 0
    while end < len(digits) and digits[end] in "0123456789":
        end += 1
    if end == 0 or end > 12:
        return None
    value = sign * int(digits[:end])
    return value if -(2**31) <= value < 2**31 else None


def _gbnf_escape(s: str, i: int) -> int:
    """``gbnf_escape_length``: the length of an escape the grammar can carry, 0 if none."""
    if i + 1 >= len(s) or s[i] != "\\":
        return 0
    kind = s[i + 1]
    digits = {"x": 2, "u": 4, "U": 8}.get(kind)
    if digits is None:
        return 2 if kind in 'trn\\"[]-' else 0
    if i + 2 + digits > len(s) or any(h not in _HEX for h in s[i + 2 : i + 2 + digits]):
        return 0
    return 2 + digits


def measure_schema(schema: Any, limits: SchemaLimits = SCHEMA, totals: Totals | None = None) -> Totals:
    """Refuse (``ProgramError``) a JSON schema the child's builder would refuse, or one over a bound;
    ``totals``: what schemas measured before cost, which this one's counts add to. Returns the sums."""
    if isinstance(schema, dict) and not schema:
        return totals or Totals()  # "any object"
    walk = _SchemaWalk(schema, limits, totals)
    walk.run()
    return walk.totals()


# --- regular expressions (grammar triggers) ---------------------------------------------------------------


def measure_regex(pattern: str, limits: RegexLimits = REGEX) -> None:
    """A trigger pattern's length, group nesting and ``{m,n}`` counts (ECMAScript syntax, as std::regex
    reads it: a backslash escapes the next character; a class ends at an unescaped ``]``)."""
    _over(len(pattern), limits.length, "the pattern's length")
    depth = 0
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
            continue
        if c == "(":
            depth += 1
            _over(depth, limits.nesting, "the pattern's group nesting", f"offset {i}")
        elif c == ")":
            depth = max(0, depth - 1)
        elif c == "{":
            end = pattern.find("}", i)
            if end > 0:
                for part in pattern[i + 1 : end].split(","):
                    part = part.strip()
                    if part.isdigit() and part.isascii():
                        _over(
                            int(part) if len(part) < 10 else 10**10, limits.repetition, "a repetition count"
                        )
        i += 1


# --- the kinds the request schema uses --------------------------------------------------------------------

# The vocabulary the bounds were measured with (the demo model, SmolLM2 135M). A constrained token is
# tested against the grammar's stacks over the candidates, up to the whole vocabulary: a model with a
# larger one gets proportionally fewer alternatives, stacks and enum members (its own size, read at load).
MEASURED_VOCAB = 49_152


def _vocab_share(ctx: Context) -> float:
    return 1.0 if not ctx.n_vocab or ctx.n_vocab <= MEASURED_VOCAB else MEASURED_VOCAB / ctx.n_vocab


def grammar_limits(ctx: Context) -> GrammarLimits:
    """The grammar bounds for this request's model."""
    share = _vocab_share(ctx)
    if share == 1.0:
        return GRAMMAR
    return replace(
        GRAMMAR, alternatives=int(GRAMMAR.alternatives * share), stacks=int(GRAMMAR.stacks * share)
    )


def schema_limits(ctx: Context) -> SchemaLimits:
    """The schema bounds for this request's model."""
    share = _vocab_share(ctx)
    return SCHEMA if share == 1.0 else replace(SCHEMA, enum_members=int(SCHEMA.enum_members * share))


def _refuse(path: str, err: ProgramError, what: str) -> FieldError:
    where = f" (at {err.where})" if err.where else ""
    return FieldError(path, f"{what}: {err.what}{where}")


@dataclass(frozen=True, slots=True)
class Grammar:
    """A GBNF grammar, read as the child's parser reads it and bounded in what it costs the child.
    ``text``: the string it must be first, with its size bound (``proxy.schema.costs``: per character)."""

    text: Value

    def check(self, value: Any, path: str, ctx: Context) -> None:
        self.text.check(value, path, ctx)
        if not value:
            return
        try:
            measure_grammar(value, grammar_limits(ctx))
        except ProgramError as err:
            raise _refuse(path, err, "is a grammar the door refuses") from None

    def describe(self) -> str:
        return (
            f"GBNF grammar, {self.text.describe()} (nesting <= {GRAMMAR.nesting}, rules <= {GRAMMAR.rules}, "
            f"alternatives <= {GRAMMAR.alternatives}, elements <= {GRAMMAR.elements})"
        )


@dataclass(frozen=True, slots=True)
class JsonSchema:
    """A JSON schema the child converts to a grammar, bounded in what the conversion costs. ``shape``: what
    the value must be first (an object with its size bound, or ``Either`` of that and a boolean where
    ``true``/``false`` pass, as ``json_schema`` may be one)."""

    shape: Value

    def check(self, value: Any, path: str, ctx: Context) -> None:
        self.shape.check(value, path, ctx)
        if not isinstance(value, dict):
            return
        try:
            measure_schema(value, schema_limits(ctx))
        except ProgramError as err:
            raise _refuse(path, err, "is a JSON schema the door refuses") from None

    def describe(self) -> str:
        return (
            f"JSON schema, {self.shape.describe()} (nodes <= {SCHEMA.nodes}, enum members <= "
            f"{SCHEMA.enum_members}, properties <= {SCHEMA.properties}, $ref chain <= {SCHEMA.ref_chain})"
        )


@dataclass(frozen=True, slots=True)
class Triggers:
    """``grammar_triggers``: ``item`` checks each trigger's shape (its type, its token); then the value of
    each PATTERN (2) or PATTERN_FULL (3) trigger, a regular expression, is measured."""

    items: Value

    def check(self, value: Any, path: str, ctx: Context) -> None:
        self.items.check(value, path, ctx)
        for i, trigger in enumerate(value):
            kind, text = trigger.get("type"), trigger.get("value")
            if kind == 1 and isinstance(text, str) and len(text) > REGEX.length:
                # A word becomes a pattern too (escaped), compiled and matched the same way.
                raise FieldError(
                    f"{path}[{i}].value", f"is a trigger word longer than {REGEX.length} characters"
                )
            if kind in (2, 3) and isinstance(text, str):
                try:
                    measure_regex(text)
                except ProgramError as err:
                    raise _refuse(
                        f"{path}[{i}].value", err, "is a trigger pattern the door refuses"
                    ) from None

    def describe(self) -> str:
        return (
            f"{self.items.describe()} (a pattern's length <= {REGEX.length}, group nesting <= "
            f"{REGEX.nesting}, repetition counts <= {REGEX.repetition})"
        )


# The chat-shaped routes, whose body the child parses as a chat completion first.
_CHAT_SHAPED = ("chat", "responses", "messages")


def check_exclusive(schema: str, payload: dict[str, Any]) -> None:
    """A chat-shaped body with both ``json_schema`` and ``grammar``: the child's chat parser throws a
    ``runtime_error`` ("Cannot use both json_schema and grammar", ``oaicompat_chat_params_parse``), which
    it answers 500; the door says it is the client's."""
    if schema in _CHAT_SHAPED and payload.get("json_schema") is not None and payload.get("grammar"):
        raise FieldError("grammar", "cannot be sent with json_schema: choose one")


@dataclass(frozen=True, slots=True)
class Tools:
    """A request's tools: ``items`` checks each tool (its schema a ``JsonSchema`` on its own); then the
    schemas at ``where`` in every tool are measured together, within one schema's bounds, since the child
    builds one grammar of them all (the nodes, enum members and repetitions add up)."""

    items: Value
    where: tuple[str, ...]  # dotted paths of a tool's schema: "function.parameters", "input_schema"

    def check(self, value: Any, path: str, ctx: Context) -> None:
        self.items.check(value, path, ctx)
        totals = Totals()
        for i, tool in enumerate(value):
            for where in self.where:
                schema = _dig(tool, where)
                if not isinstance(schema, dict):
                    continue
                try:
                    totals = measure_schema(schema, schema_limits(ctx), totals)
                except ProgramError as err:
                    what = "is a JSON schema the door refuses (all the tools' schemas count together)"
                    raise _refuse(f"{path}[{i}].{where}", err, what) from None

    def describe(self) -> str:
        return f"{self.items.describe()} (their schemas together within one JSON schema's bounds)"


def _dig(value: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value
