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
)
