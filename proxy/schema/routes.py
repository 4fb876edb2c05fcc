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

from proxy.schema.fields import Field
from proxy.schema.llama import LLAMA, logprob_limit
from proxy.schema.programs import JsonSchema, Tools
from proxy.schema.values import (
    TOKEN,
    Arr,
    Bool,
    Context,
    Either,
    FieldError,
    Int,
    Json,
    Num,
    Obj,
    Str,
    TokenList,
)


def prompt_limit(ctx: Context) -> tuple[float, str]:
    """tenant max_prompts"""
    # Each element of a prompt array is a task of its own in the child (``tokenize_input_prompts``).
    return ctx.tenant.max_prompts, "this tenant's limit is"


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as ``tokenize_input_prompts`` reads it: a string; an array with an integer at its top
    level is one prompt of tokens (strings mixed in); any other array is a list of prompts (strings,
    token arrays, ``{"prompt_string": ...}`` objects), at most the tenant's ``max_prompts``."""

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if isinstance(value, str):
            return
        if isinstance(value, dict):
            _ONE.check(value, path, ctx)
            return
        if not isinstance(value, list):
            raise FieldError(path, "must be a string, an array of token ids or an array of prompts")
        if any(isinstance(e, int) and not isinstance(e, bool) for e in value):
            TokenList().check(value, path, ctx)
            return
        _LIST.check(value, path, ctx)

    def describe(self) -> str:
        return "string, array of token ids, or array of prompts (at most the tenant's max_prompts)"


_ONE = Obj({"prompt_string": Str(), "multimodal_data": Arr(Str())}, required=("prompt_string",))
_LIST = Arr(Either((Str(), TokenList(), _ONE)), max_items=prompt_limit)
PROMPT = Prompt()

_ANY = Field(Json(), "accepted for the SDKs; llama-server does not read it")


def _sdk_only(*names: str) -> dict[str, Field]:
    """Fields an SDK sends that llama-server never reads: accepted as any JSON."""
    return dict.fromkeys(names, _ANY)


_MESSAGES = Field(Arr(Obj()), "the conversation", nullable=False)
# Chat's tools as ``common_chat_tools_parse_oaicompat`` reads them: any other shape is the child's 500.
_FUNCTION = Obj(
    {"name": Str(), "description": Str(), "parameters": JsonSchema()}, required=("name",), nulls=False
)
_TOOLS = Field(
    Tools(
        Arr(Obj({"type": Str(("function",)), "function": _FUNCTION}, required=("type", "function"))),
        ("function.parameters",),
    ),
    "functions the model may call ({type: function, function: {name, description, parameters}})",
)
# Responses and Anthropic tools have shapes of their own, converted by the child.
# The child converts their parameters (Responses) or input_schema (Anthropic) as chat's.
_OTHER_TOOLS = Field(
    Tools(
        Arr(Obj({"parameters": JsonSchema(), "input_schema": JsonSchema()})), ("parameters", "input_schema")
    ),
    "tools the model may call",
    nullable=False,
)
_TOOL_CHOICE = Field(Either((Str(), Obj())), "auto, none, required, or one tool")
_OTHER_CHOICE = Field(Either((Str(), Obj())), "auto, none, any, or one tool", nullable=False)
_MODEL = Field(Str(), "the model's name or alias")
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
                "json_schema": Obj({"schema": JsonSchema()}),
                "schema": JsonSchema(),
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
        "audio",
        "function_call",
        "functions",
        "metadata",
        "modalities",
        "moderation",
        "prediction",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "safety_identifier",
        "service_tier",
        "store",
        "user",
        "verbosity",
        "web_search_options",
    ),
)

# OpenAI Completions (``oaicompat_completion_params_parse``), then the pinned schema.
COMPLETIONS = _fields(
    LLAMA,
    model=_MODEL,
    prompt=Field(PROMPT, "the prompt(s)", nullable=False),
    suffix=Field(Str(), "text after the completion"),
    best_of=Field(Int(1), "accepted for the SDKs; llama-server does not read it"),
    user=_ANY,
    id_slot=_ID_SLOT,
)

# llama.cpp's /completion.
COMPLETION = _fields(
    LLAMA, model=_MODEL, prompt=Field(PROMPT, "the prompt(s)", nullable=False), id_slot=_ID_SLOT
)

# llama.cpp's /infill (``handle_infill``): prefix, suffix, extra context files, and the prompt.
INFILL = _fields(
    LLAMA,
    model=_MODEL,
    prompt=Field(PROMPT, "text after the prefix, before the cursor"),
    input_prefix=Field(Str(), "code before the cursor"),
    input_suffix=Field(Str(), "code after the cursor"),
    input_extra=Field(Arr(Obj({"filename": Str(), "text": Str()}, required=("text",))), "other files"),
    id_slot=_ID_SLOT,
)

# OpenAI Responses (``convert_responses_to_chatcmpl``).
RESPONSES = _fields(
    LLAMA,
    model=_MODEL,
    input=Field(Either((Str(), Arr(Obj()))), "the input: text or items", nullable=False),
    instructions=Field(Str(), "the system prompt", nullable=False),
    max_output_tokens=Field(Int(-1), "most tokens to generate", nullable=False),
    tools=_OTHER_TOOLS,
    tool_choice=_OTHER_CHOICE,
    parallel_tool_calls=Field(Bool(), "several tool calls in one answer"),
    reasoning=Field(Obj(), "reasoning options", nullable=False),
    top_logprobs=Field(Int(0, logprob_limit), "candidates per token"),
    id_slot=_ID_SLOT,
    **_sdk_only(
        "access_programs",
        "background",
        "background_options",
        "context_management",
        "conversation",
        "image",
        "include",
        "metadata",
        "moderation",
        "personality",
        "previous_response_id",
        "prompt",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "safety_identifier",
        "service_tier",
        "store",
        "text",
        "truncation",
        "user",
        "max_tool_calls",
    ),
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
    max_tokens=Field(Int(-1), "most tokens to generate", nullable=False),
    system=Field(Either((Str(), Arr(Obj()))), "the system prompt", nullable=False),
    stop_sequences=Field(Arr(Str()), "stop strings", nullable=False),
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
    system=Field(Either((Str(), Arr(Obj()))), "the system prompt", nullable=False),
    tools=_OTHER_TOOLS,
    tool_choice=_OTHER_CHOICE,
    thinking=Field(Obj({"budget_tokens": Int(-1)}), "extended thinking", nullable=False),
)

# OpenAI Embeddings and llama.cpp's /embedding(s): ``input`` (else ``content``).
EMBEDDINGS = _fields(
    model=_MODEL,
    input=Field(PROMPT, "text(s) or token ids to embed"),
    content=Field(PROMPT, "llama.cpp's name for input"),
    encoding_format=Field(Str(("float", "base64")), "float or base64"),
    embd_normalize=Field(
        Int(-1, 2**31 - 1), "normalisation (-1 none, 0 max-abs, 1 taxicab, 2 euclidean, >2 p-norm)"
    ),
    dimensions=_ANY,
    user=_ANY,
)

# llama.cpp's rerank: one task per document.
RERANK = _fields(
    model=_MODEL,
    query=Field(Str(), "the query", nullable=False),
    documents=Field(Arr(Str(), max_items=prompt_limit), "the documents to rank"),
    texts=Field(Arr(Str(), max_items=prompt_limit), "llama.cpp's name for documents"),
    top_n=Field(Int(0), "how many results"),
    return_text=Field(Bool(), "include each document's text"),
    return_documents=Field(Bool(), "include each document"),
)

TOKENIZE = _fields(
    model=_MODEL,
    content=Field(Either((Str(), TokenList())), "the text (strings and token ids mixed)", nullable=False),
    add_special=Field(Bool(), "add the BOS token"),
    parse_special=Field(Bool(), "parse special tokens in the text"),
    with_pieces=Field(Bool(), "return each token's text"),
)

DETOKENIZE = _fields(
    model=_MODEL, tokens=Field(Arr(TOKEN), "token ids, each within the model's vocabulary", nullable=False)
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

__all__ = ["SCHEMAS", "Num"]
