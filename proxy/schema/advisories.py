"""Published llama-server advisories that request input (or a launch flag) can reach at the pin, as data:
the field or flag, the check that closes it, and the shape of the exploit that a test sends through the
door to the real pinned child (``tests/integration/test_advisories_e2e.py``: its pid must not change).
docs/security.md shows the same table; a unit test holds the two together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Advisory:
    id: str
    reaches: str  # the field, route or flag
    pinned: str  # what the pinned source (0c1e570) does with it
    closed_by: str  # llamagate's check
    # The exploit's shape: (route, body) pairs sent through the door (none: no request reaches it).
    exploits: tuple[tuple[str, Mapping[str, object]], ...] = field(default=())


_LAZY = {"prompt": "Say yes or no:", "n_predict": 4, "grammar": 'root ::= "yes" | "no"', "grammar_lazy": True}
_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
_PROMPT = {"prompt": "hi", "n_predict": 2}
# ggml-org/llama.cpp #26600: 60,000 nested parentheses (about 120 KB) overflow the GBNF parser's stack.
_DEEP = 60_000
# A $ref cycle with no schema between, reached through allOf (``_visit_all_of`` follows it forever).
_REF_CYCLE = {
    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
    "allOf": [{"$ref": "#/$defs/a"}],
}


def _nested(depth: int, name: str = "root") -> str:
    return (
        f"{name} ::= " + "(" * depth + '"a"' + ")" * depth + ("" if name == "root" else f"\nroot ::= {name}")
    )


ADVISORIES: tuple[Advisory, ...] = (
    Advisory(
        "CVE-2026-134540",
        "`grammar_triggers[].type` (and a token trigger's `token`)",
        "cast to the trigger enum from any integer; type 99 aborts the child in `common_sampler_init`",
        "the schema: `type` an integer 0..3, `token` within the model's vocabulary (400 `invalid_field`)",
        (
            ("/completion", {**_LAZY, "grammar_triggers": [{"type": 99, "value": "x"}]}),
            (
                "/v1/completions",
                {**_LAZY, "grammar_triggers": [{"type": 0, "value": "x", "token": 2**31 - 1}]},
            ),
            ("/infill", {**_LAZY, "input_prefix": "a", "grammar_triggers": [{"type": 99, "value": "x"}]}),
        ),
    ),
    Advisory(
        "CVE-2026-107183",
        "`chat_parser`",
        "parsed from the body (`server-schema.cpp`, `parser.load`) on `/completion`, and on chat routes"
        " whenever the chat template sets no parser of its own: the pin is affected",
        "the schema: no key may send it (internal plumbing, as `chat_format`)",
        (
            ("/completion", {"prompt": "hi", "n_predict": 2, "chat_parser": "\\x00" * 64}),
            ("/v1/chat/completions", {**_CHAT, "chat_parser": "{" * 32}),
        ),
    ),
    Advisory(
        "CVE-2026-21869",
        "`n_keep`, `n_discard` (context shift)",
        "used only when the child shifts a full context, which is off by default at the pin",
        "the child never gets `--context-shift` (refused in `extra_args`); the schema holds both to the"
        " pinned hard limits (`n_keep` -1.., `n_discard` 0..)",
        (
            ("/completion", {"prompt": "hi", "n_predict": 2, "n_keep": -(2**31), "n_discard": 2**31 - 1}),
            ("/completion", {"prompt": "hi " * 50, "n_predict": 8, "n_keep": 2**31 - 1, "n_discard": 1}),
        ),
    ),
    Advisory(
        "the `--rpc` family",
        "`--rpc` (and `LLAMA_ARG_RPC`)",
        "offloads to remote ggml RPC servers, which trust whoever reaches them",
        "llamagate never passes `--rpc`; `extra_args` refuses it; the child's environment is scrubbed",
    ),
    Advisory(
        "CVE-2026-43629",
        "`POST /slots/{id}?action=restore` (a state file)",
        "a crafted state file overflows the heap on restore",
        "the `/slots` actions are refused to every key (404): no request names or restores a state file;"
        " the disk tier restores only files the gateway wrote, in its private 0700 folder, whose sha256"
        " recorded at save still matches (proxy/conversations/disk.py)",
        (("/slots/0?action=restore", {"filename": "../../etc/passwd"}),),
    ),
    Advisory(
        "ggml-org/llama.cpp #26600",
        "`grammar` (a GBNF grammar nested deep in parentheses)",
        "the parser recurses twice per level with no depth counter: about 60,000 levels (120 KB) die with"
        " SIGSEGV, 13,000 still parse; unfixed upstream (PR #26602 proposes a cap of 1000): the pin is"
        " affected. The door's nesting bound can go when the pin includes that fix",
        "the door reads the grammar as the child's parser does (`proxy.schema.programs`, iteratively) and"
        " refuses one nested more than 1000 levels, with its other bounds (400 `invalid_field`)",
        (
            ("/completion", {**_PROMPT, "grammar": _nested(_DEEP)}),
            ("/completion", {**_PROMPT, "grammar": _nested(_DEEP + 1)}),
            ("/v1/completions", {**_PROMPT, "grammar": _nested(_DEEP, "expr")}),
            ("/v1/chat/completions", {**_CHAT, "grammar": _nested(_DEEP)}),
        ),
    ),
    Advisory(
        "unreported (found for issue 54)",
        "a JSON schema (`json_schema`, `response_format`, tool parameters) whose `allOf` names a `$ref`"
        " cycle with no schema between",
        "the converter's `allOf` (`_visit_all_of`) follows the references without end: 100 % of a core for"
        " about a minute, then SIGSEGV (seen at the pin with a 130-byte schema)",
        "the door reads the schema as the child's builder does and refuses a cycle of references with no"
        " schema between, with its other bounds (400 `invalid_field`)",
        (
            ("/completion", {**_PROMPT, "json_schema": _REF_CYCLE}),
            (
                "/v1/chat/completions",
                {**_CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": _REF_CYCLE}}},
            ),
        ),
    ),
)
