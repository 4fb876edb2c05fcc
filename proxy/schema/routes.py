"""Which body fields each route accepts: the pinned server's own schema (``proxy.schema.llama``) where the
child reads it, and each dialect's fields (OpenAI chat completions, completions, Responses, embeddings;
Anthropic Messages and count_tokens; llama.cpp's completion, infill, tokenize, detokenize, rerank).

Where the child reads a dialect's field, its shape is the child's (``server-common.cpp``
``oaicompat_chat_params_parse``, ``server-chat.cpp`` for Responses and Anthropic, ``server-context.cpp``
for the native routes). A field the OpenAI or Anthropic SDKs send that llama-server ignores is declared
as any JSON: it passes (the child never reads it) and a client is not refused for what its SDK adds.
Chat-shaped routes are turned into a chat completion by the child, which copies the fields it does not
know into the completion's parameters: so they take the pinned schema's fields too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from proxy.schema.fields import Field, Role
from proxy.schema.llama import LLAMA, PROGRAM_CHARS, SCHEMA_TEXT, STOP_STRINGS, logprob_limit
from proxy.schema.programs import JsonSchema, Tools
from proxy.schema.values import (
    TEXT_CHARS,
    TOKEN,
    TOKENS,
    Arr,
    Bool,
    Context,
    Either,
    FieldError,
    Int,
    Json,
    Num,
    Obj,
    Size,
    Str,
    Text,
    TokenList,
)


def prompt_limit(ctx: Context) -> tuple[float, str]:
    """tenant max_prompts"""
    # Each element of a prompt array is a task of its own in the child (``tokenize_input_prompts``).
    return ctx.tenant.max_prompts, "this tenant's limit is"


def is_prompt_list(value: Any) -> bool:
    """``tokenize_input_prompts``: an array is a list of prompts unless an integer sits at its top level
    (json ``is_number_integer``: a boolean is not one, nor is a float). The schema and admission's cost
    (``proxy.admission.cost``) read a prompt by this one rule."""
    return isinstance(value, list) and not any(isinstance(e, int) and not isinstance(e, bool) for e in value)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as ``tokenize_input_prompts`` reads it: a string; an array with an integer at its top
    level is one prompt of tokens (strings mixed in); any other array is a list of prompts (strings,
    token arrays, ``{"prompt_string": ...}`` objects), at most the tenant's ``max_prompts``."""

    text: Size
    one: Obj  # {"prompt_string": ..., "multimodal_data": [...]}
    tokens: TokenList
    prompts: Arr

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if isinstance(value, str):
            self.text.check(len(value), path, ctx)
            return
        if isinstance(value, dict):
            self.one.check(value, path, ctx)
            return
        if not isinstance(value, list):
            raise FieldError(path, "must be a string, an array of token ids or an array of prompts")
        if not is_prompt_list(value):
            self.tokens.check(value, path, ctx)
            return
        self.prompts.check(value, path, ctx)

    def describe(self) -> str:
        return (
            f"string ({self.text.describe()}), array of token ids, or array of prompts"
            " (at most the tenant's max_prompts)"
        )


# Media parts of a multimodal prompt (base64): as many as a client may attach to one message.
_MEDIA = Arr(Text(), size=Size(256, "elements"))
_ONE = Obj({"prompt_string": Text(), "multimodal_data": _MEDIA}, required=("prompt_string",))
_TOKENS = TokenList()
_LIST = Arr(Either((Text(), _TOKENS, _ONE)), max_items=prompt_limit, size=Size(TOKENS, "elements"))
PROMPT = Prompt(Size(TEXT_CHARS, "characters"), _ONE, _TOKENS, _LIST)

# What an SDK sends that llama-server never reads (metadata, prediction, web search options...): at most
# 1 MiB of JSON each, far beyond the OpenAI API's own (metadata: 16 pairs of 64 and 512 characters).
_ANY = Field(
    Json(Size(1024 * 1024, "characters of JSON")), "accepted for the SDKs; llama-server does not read it"
)


def _sdk_only(*names: str) -> dict[str, Field]:
    """Fields an SDK sends that llama-server never reads: accepted as any JSON."""
    return dict.fromkeys(names, _ANY)


# The SDK-only names both OpenAI bodies (chat completions and Responses) carry.
_SDK_COMMON = (
    "metadata",
    "moderation",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "safety_identifier",
    "service_tier",
    "store",
    "user",
)

# Anthropic allows 100,000 messages in one request; each message an object of a few members.
_MESSAGES = Field(
    Arr(Obj(), size=Size(100_000, "elements")), "the conversation", nullable=False, roles=("prompt",)
)
# OpenAI takes at most 128 tools; each adds rules to the tool-call grammar the child parses at the
# request's setup (128 with a required call: under 40 ms, tests/benchmarks/loop_cost.py). A tool's
# parameters is a JSON schema (``proxy.schema.programs`` bounds its structure).
_TOOL_COUNT = Size(1024, "elements")
_PARAMETERS = Obj(text=Size(PROGRAM_CHARS, "characters of JSON"))
# Chat's tools as ``common_chat_tools_parse_oaicompat`` reads them: any other shape is the child's 500.
_FUNCTION = Obj(
    {"name": Str(), "description": Text(64 * 1024), "parameters": JsonSchema(_PARAMETERS)},
    required=("name",),
    nulls=False,
)
_TOOLS = Field(
    Tools(
        Arr(
            Obj(
                {"type": Str(("function",)), "function": _FUNCTION},
                required=("type", "function"),
                text=Size(PROGRAM_CHARS, "characters of JSON"),
            ),
            size=_TOOL_COUNT,
        ),
        ("function.parameters",),
    ),
    "functions the model may call ({type: function, function: {name, description, parameters}})",
)
# Responses and Anthropic tools have shapes of their own, converted by the child.
# The child converts their parameters (Responses) or input_schema (Anthropic) as chat's.
_OTHER_TOOLS = Field(
    Tools(
        Arr(
            Obj(
                {"parameters": JsonSchema(_PARAMETERS), "input_schema": JsonSchema(_PARAMETERS)},
                text=Size(PROGRAM_CHARS, "characters of JSON"),
            ),
            size=_TOOL_COUNT,
        ),
        ("parameters", "input_schema"),
    ),
    "tools the model may call",
    nullable=False,
)
_TOOL_CHOICE = Field(Either((Str(), Obj())), "auto, none, required, or one tool")
_OTHER_CHOICE = Field(Either((Str(), Obj())), "auto, none, any, or one tool", nullable=False)
_MODEL = Field(Str(), "the model's name or alias")
_PROMPT = Field(PROMPT, "the prompt(s)", nullable=False, roles=("prompt", "prompts"))
_ID_SLOT = Field(
    Int(-1, 2**31 - 1),
    "the slot to run on (-1: any)",
    who="admin",
    why="it chooses a slot: a tenant could queue behind a busy one or aim at another tenant's cache",
    default=-1,
)


def _fields(*parts: Mapping[str, Field], **more: Field) -> Mapping[str, Field]:
    out: dict[str, Field] = {}
    for part in parts:
        out.update(part)
    out.update(more)
    return MappingProxyType(out)


# OpenAI Chat Completions (and the fields llama-server's chat parser reads).
CHAT = _fields(
    LLAMA,
    model=_MODEL,
    messages=_MESSAGES,
    tools=_TOOLS,
    tool_choice=_TOOL_CHOICE,
    parallel_tool_calls=Field(Bool(), "several tool calls in one answer"),
    response_format=Field(
        Obj(
            {
                "type": Str(("text", "json_object", "json_schema")),
                "json_schema": Obj({"schema": JsonSchema(Obj(text=SCHEMA_TEXT))}, text=SCHEMA_TEXT),
                "schema": JsonSchema(Obj(text=SCHEMA_TEXT)),
            }
        ),
        "text, json_object or json_schema",
    ),
    chat_template_kwargs=Field(Obj(), "extra arguments of the chat template"),
    add_generation_prompt=Field(Bool(), "end the prompt with the assistant's turn"),
    reasoning_effort=Field(Str(), "passed to the chat template; none: no reasoning"),
    thinking_budget_tokens=Field(Int(-1), "alias of reasoning_budget_tokens"),
    # Chat's logprobs is a boolean (top_logprobs says how many); an integer is n_probs, as llama.cpp reads it.
    logprobs=Field(Either((Bool(), Int(0, logprob_limit))), "return log probabilities"),
    top_logprobs=Field(Int(0, logprob_limit), "candidates per token with logprobs"),
    id_slot=_ID_SLOT,
    **_sdk_only(
        *_SDK_COMMON,
        "audio",
        "function_call",
        "functions",
        "modalities",
        "prediction",
        "verbosity",
        "web_search_options",
    ),
)

# OpenAI Completions (``oaicompat_completion_params_parse``), then the pinned schema.
COMPLETIONS = _fields(
    LLAMA,
    model=_MODEL,
    prompt=_PROMPT,
    suffix=Field(Text(), "text after the completion", roles=("prompt",)),
    best_of=Field(Int(1), "accepted for the SDKs; llama-server does not read it"),
    user=_ANY,
    id_slot=_ID_SLOT,
)

# llama.cpp's /completion.
COMPLETION = _fields(LLAMA, model=_MODEL, prompt=_PROMPT, id_slot=_ID_SLOT)

# llama.cpp's /infill (``handle_infill``): prefix, suffix, extra context files, and the prompt.
INFILL = _fields(
    LLAMA,
    model=_MODEL,
    prompt=Field(PROMPT, "text after the prefix, before the cursor", roles=("prompt", "prompts")),
    input_prefix=Field(Text(), "code before the cursor", roles=("prompt",)),
    input_suffix=Field(Text(), "code after the cursor", roles=("prompt",)),
    input_extra=Field(
        Arr(Obj({"filename": Str(), "text": Text()}, required=("text",)), size=Size(10_000, "elements")),
        "other files",
        roles=("prompt",),
    ),
    id_slot=_ID_SLOT,
)

# OpenAI Responses (``convert_responses_to_chatcmpl``).
RESPONSES = _fields(
    LLAMA,
    model=_MODEL,
    input=Field(
        Either((Text(), Arr(Obj(), size=Size(100_000, "elements")))),
        "the input: text or items",
        nullable=False,
        roles=("prompt",),
    ),
    instructions=Field(Text(), "the system prompt", nullable=False, roles=("prompt",)),
    max_output_tokens=Field(Int(-1), "most tokens to generate", nullable=False, roles=("token_cap",)),
    tools=_OTHER_TOOLS,
    tool_choice=_OTHER_CHOICE,
    parallel_tool_calls=Field(Bool(), "several tool calls in one answer"),
    reasoning=Field(Obj(), "reasoning options", nullable=False),
    top_logprobs=Field(Int(0, logprob_limit), "candidates per token"),
    id_slot=_ID_SLOT,
    **_sdk_only(
        *_SDK_COMMON,
        "access_programs",
        "background",
        "background_options",
        "context_management",
        "conversation",
        "image",
        "include",
        "personality",
        "previous_response_id",
        "prompt",
        "text",
        "truncation",
        "max_tool_calls",
    ),
)

_SYSTEM = Field(
    Either((Text(), Arr(Obj(), size=Size(10_000, "elements")))),
    "the system prompt",
    nullable=False,
    roles=("prompt",),
)

_ANTHROPIC = _sdk_only(
    "cache_control",
    "container",
    "context_management",
    "diagnostics",
    "inference_geo",
    "mcp_servers",
    "metadata",
    "output_config",
    "service_tier",
    "speed",
    "user_profile_id",
    "workspace_id",
)

# Anthropic Messages (``convert_anthropic_to_oai``).
MESSAGES = _fields(
    LLAMA,
    _ANTHROPIC,
    model=_MODEL,
    messages=_MESSAGES,
    max_tokens=Field(Int(-1), "most tokens to generate", nullable=False, roles=("token_cap",)),
    system=_SYSTEM,
    stop_sequences=Field(STOP_STRINGS, "stop strings", nullable=False),
    tools=_OTHER_TOOLS,
    tool_choice=_OTHER_CHOICE,
    thinking=Field(Obj({"budget_tokens": Int(-1)}), "extended thinking", nullable=False),
    id_slot=_ID_SLOT,
)

# Anthropic count_tokens: the request as Messages would template it, nothing generated.
COUNT_TOKENS = _fields(
    _ANTHROPIC,
    model=_MODEL,
    messages=_MESSAGES,
    system=_SYSTEM,
    tools=_OTHER_TOOLS,
    tool_choice=_OTHER_CHOICE,
    thinking=Field(Obj({"budget_tokens": Int(-1)}), "extended thinking", nullable=False),
)

# OpenAI Embeddings and llama.cpp's /embedding(s): ``input`` (else ``content``).
EMBEDDINGS = _fields(
    model=_MODEL,
    input=Field(PROMPT, "text(s) or token ids to embed", roles=("prompt", "prompts")),
    content=Field(PROMPT, "llama.cpp's name for input", roles=("prompt", "prompts")),
    encoding_format=Field(Str(("float", "base64")), "float or base64"),
    embd_normalize=Field(
        Int(-1, 2**31 - 1), "normalisation (-1 none, 0 max-abs, 1 taxicab, 2 euclidean, >2 p-norm)"
    ),
    dimensions=_ANY,
    user=_ANY,
)

# llama.cpp's rerank: one task per document.
_DOCUMENTS = Arr(Text(), max_items=prompt_limit, size=Size(TOKENS, "elements"))
RERANK = _fields(
    model=_MODEL,
    query=Field(Text(), "the query", nullable=False),
    documents=Field(_DOCUMENTS, "the documents to rank", roles=("documents",)),
    texts=Field(_DOCUMENTS, "llama.cpp's name for documents", roles=("documents",)),
    top_n=Field(Int(0), "how many results"),
    return_text=Field(Bool(), "include each document's text"),
    return_documents=Field(Bool(), "include each document"),
)

# /tokenize splits its text at every special token it names (``parse_special``; the cost table's
# ``tokenize_char``); a client counting a prompt's tokens sends the prompt.
TOKENIZE = _fields(
    model=_MODEL,
    content=Field(
        Either((Text(TEXT_CHARS, "tokenize_char"), TokenList())),
        "the text (strings and token ids mixed)",
        nullable=False,
    ),
    add_special=Field(Bool(), "add the BOS token"),
    parse_special=Field(Bool(), "parse special tokens in the text"),
    with_pieces=Field(Bool(), "return each token's text"),
)

DETOKENIZE = _fields(
    model=_MODEL,
    tokens=Field(
        Arr(TOKEN, size=Size(TOKENS, "elements")),
        "token ids, each within the model's vocabulary",
        nullable=False,
    ),
)

# The counting routes template exactly as their generation routes do (the child's own counter).
SCHEMAS: Mapping[str, Mapping[str, Field]] = MappingProxyType(
    {
        "chat": CHAT,
        "completions": COMPLETIONS,
        "completion": COMPLETION,
        "infill": INFILL,
        "responses": RESPONSES,
        "messages": MESSAGES,
        "count_tokens": COUNT_TOKENS,
        "embeddings": EMBEDDINGS,
        "rerank": RERANK,
        "tokenize": TOKENIZE,
        "detokenize": DETOKENIZE,
    }
)


def with_role(role: Role, schema: str | None = None) -> tuple[str, ...]:
    """The fields that play ``role`` (``Field.roles``), in the order they are declared (the child's order
    of precedence where it reads the first present): of ``schema``, or of every route, each name once."""
    names: dict[str, None] = {}
    for name_of_schema, fields in SCHEMAS.items():
        if schema is not None and name_of_schema != schema:
            continue
        names.update((name, None) for name, field in fields.items() if role in field.roles)
    return tuple(names)


__all__ = ["SCHEMAS", "Num", "is_prompt_list", "with_role"]
