"""The pinned llama-server's own request schema, field by field: ``tools/server/server-schema.cpp`` of
llama.cpp 0c1e570 (``make_llama_cmpl_schema``), read for every field's JSON type and limits.

How the child reads these (``server-schema.cpp``, the ``eval`` functions): a field that is absent or
null is left at the server's default; ``field_num`` reads the number into its C type (``int32_t``,
``float``, ``uint32_t`` for the seed, ``int64_t`` for ``t_max_predict_ms``), then a *hard* limit refuses a
value outside it and a *soft* one clamps it. So here: a hard limit is the range; a soft-limited or
unlimited field takes any value of its C type (the child clamps), never more (a double beyond float32
becomes infinity in the child; an integer beyond int32 wraps). ``field_json`` fields are read by a handler
each: their shapes are written out below from those handlers.

What the pinned source does not check, and this table does (docs/security.md has each as data):
- ``grammar_triggers[].type`` is cast from any int (``server_grammar_trigger``): type 99 aborts the
  child (CVE-2026-134540). Here: 0..3, and a token trigger's ``token`` within the vocabulary.
- ``chat_parser`` is parsed from the body (CVE-2026-107183); ``chat_format`` is cast to an enum from any
  int; ``lora`` names adapters the supervisor never loads. Internal plumbing: refused from every key.
- ``n_keep``/``n_discard`` shift a full context (CVE-2026-21869): the supervisor launches the child
  with context shift off (``launch/flags.py``), and the hard limits hold here as well.
- token ids (``logit_bias``, token triggers) within the model's vocabulary, from the GGUF header.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from proxy.schema.fields import Field
from proxy.schema.programs import Grammar, JsonSchema, Triggers
from proxy.schema.values import (
    INT32,
    INT64,
    TOKEN,
    UINT32_MAX,
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
)

I32 = INT32[1]


def n_limit(ctx: Context) -> tuple[float, str]:
    """min(tenant max_n, slots)"""
    # A task with n_cmpl > 1 starts only when n_cmpl slots are free at once (get_free_slots): more than
    # the child has can never run; and each runs in its own slot, which the tenant's max_n bounds.
    if ctx.capacity > 0 and ctx.capacity < ctx.tenant.max_n:
        return ctx.capacity, "the server's slots,"
    return ctx.tenant.max_n, "this tenant's limit of completions per prompt,"


def logprob_limit(ctx: Context) -> tuple[float, str]:
    """tenant max_logprobs"""
    # Candidates per generated token: up to the whole vocabulary in the child; each one is answer bytes.
    return ctx.tenant.max_logprobs, "this tenant's limit,"


# A grammar trigger (common/common.h ``common_grammar_trigger_type``): TOKEN 0, WORD 1, PATTERN 2,
# PATTERN_FULL 3. A TOKEN trigger carries the token id the sampler indexes with.
# A trigger's value is a word or a regular expression (``proxy.schema.programs`` reads the patterns).
TRIGGER = Obj({"type": Int(0, 3), "value": Text(4096), "token": TOKEN}, required=("type", "value"))

# A list of names the child looks up one by one (sampler names, answer fields, preserved tokens): the
# longest real one is llama.cpp's default sampler chain, 10 names.
_NAMES = Arr(Str(), size=Size(256, "elements"))
# OpenAI allows 4 stop strings; llama.cpp's own clients send a handful. Each generated token is searched
# for every one of them: 4,000 cost a few ms a token step (tests/benchmarks/loop_cost.py); none is longer
# than a line.
STOP_STRINGS = Arr(Text(1024), size=Size(1024, "elements"))
_STOP = Either((Text(1024), STOP_STRINGS))
# DRY's breakers: llama.cpp's default list has 4; the child truncates each to 40 characters
# (``llama_sampler_init_dry``); each costs a pass over the vocabulary (the cost table's ``dry_breaker``).
_BREAKERS = Arr(Str(size=Size(1024, "characters")), min_items=1, size=Size(1024, "elements", "dry_breaker"))
# The grammar and JSON schema are programs (``proxy.schema.programs`` bounds their structure); their
# text is bounded here: 256 KiB, twice OpenAI's 120,000 characters of a structured-output schema's names,
# and for the ones parsed at the request's setup, by what a character costs there at worst (many short
# alternatives or enum members: the cost table's ``grammar_char`` and ``json_schema_char``).
PROGRAM_CHARS = 256 * 1024
SCHEMA_TEXT = Size(PROGRAM_CHARS, "characters of JSON", "json_schema_char")


# Entries of logit_bias: each given as text is tokenized (the cost table's ``logit_bias_entry``); a
# token's text is short.
_BIAS_ENTRIES = Size(1_000_000, "entries", "logit_bias_entry")
_BIAS_TEXT = Size(1024, "characters", each=True)


@dataclass(frozen=True, slots=True)
class LogitBias:
    """``[[token id or text, bias or false], ...]`` or ``{"token id or text": bias or false}``: a token id
    (an array's integer, an object's all-digit key) within the vocabulary; a bias a finite float32; at
    most ``size`` entries (each is tokenized if text and copied into the sampler: ``logit_bias_entry``),
    each text at most ``text`` characters."""

    size: Size = _BIAS_ENTRIES
    text: Size = _BIAS_TEXT

    def check(self, value: Any, path: str, ctx: Context) -> None:
        if isinstance(value, list | dict):
            self.size.check(len(value), path, ctx)
        if isinstance(value, list):
            for i, pair in enumerate(value):
                where = f"{path}[{i}]"
                if not isinstance(pair, list) or len(pair) != 2:
                    raise FieldError(where, "must be a [token, bias] pair")
                _TOKEN_OR_TEXT.check(pair[0], f"{where}[0]", ctx)
                if isinstance(pair[0], str):
                    self.text.check(len(pair[0]), where, ctx)
                _BIAS.check(pair[1], f"{where}[1]", ctx)
        elif isinstance(value, dict):
            for key, bias in value.items():
                if key.lstrip("-").isdigit():
                    TOKEN.check(int(key), f"{path}.{key}", ctx)
                else:
                    self.text.check(len(key), f"{path}[]", ctx)
                _BIAS.check(bias, f"{path}.{key}", ctx)
        else:
            raise FieldError(path, "must be an array of [token, bias] pairs or an object of token: bias")

    def describe(self) -> str:
        return (
            "[[token or text, bias or false], ...] or {token or text: bias or false},"
            f" {self.size.describe()}"
        )


_TOKEN_OR_TEXT = Either((TOKEN, Str()))
_BIAS = Either((Num(), Bool()))
LOGIT_BIAS = LogitBias()

_INTERNAL = "llama-server's internal plumbing (it sets this itself); no key may send it"


def _num(doc: str, lo: float = INT32[0], hi: float = I32) -> Field:
    return Field(Int(lo, hi), doc)


def _cap(doc: str) -> Field:
    return Field(Int(-1, I32), doc, roles=("token_cap",))


def _f(doc: str) -> Field:
    return Field(Num(), doc)


# Name (and alias) -> declaration, in the source's order. Aliases are fields of their own here: the
# body may carry either, and each is checked.
LLAMA: Mapping[str, Field] = MappingProxyType(
    {
        "verbose": Field(Bool(), "include debug detail (__verbose) in the answer"),
        "timings_per_token": Field(Bool(), "speed figures on every event"),
        "stream": Field(Bool(), "stream the answer as server-sent events"),
        "stream_options": Field(Obj({"include_usage": Bool()}), "include_usage: a final usage event"),
        "cache_prompt": Field(Bool(), "reuse the KV cache of an earlier request's common prefix"),
        "return_tokens": Field(Bool(), "return the generated token ids"),
        "return_progress": Field(Bool(), "prompt-processing progress events"),
        "sse_ping_interval": _num("seconds between keep-alive comments, -1 off", -1),
        "n_predict": _cap("most tokens to generate (-1: until the context is full)"),
        "max_completion_tokens": _cap("alias of n_predict"),
        "max_tokens": _cap("alias of n_predict"),
        "n_indent": _num("minimum indentation of generated lines", 0),
        "n_keep": _num("prompt tokens kept when the context shifts (-1: all)", -1),
        "n_discard": _num("tokens discarded when the context shifts (0: half)", 0),
        "n_cmpl": Field(Int(1, n_limit), "completions per prompt, each in its own slot", roles=("n",)),
        "n": Field(Int(1, n_limit), "alias of n_cmpl", roles=("n",)),
        "n_cache_reuse": _num("minimum chunk reused from the cache by KV shifting", 0),
        "t_max_predict_ms": Field(Int(-1, INT64[1]), "time limit of the generation phase (ms)"),
        "response_fields": Field(_NAMES, "answer fields to return"),
        "top_k": _num("keep the K most probable tokens (0: off)"),
        "top_p": _f("nucleus sampling threshold (clamped to 0..1)"),
        "min_p": _f("minimum relative probability (clamped to 0..1)"),
        "top_n_sigma": _f("keep tokens within n standard deviations of the top logit"),
        "xtc_probability": _f("XTC removal chance (clamped to 0..1)"),
        "xtc_threshold": _f("XTC threshold (clamped to 0..1)"),
        "typical_p": _f("locally typical sampling"),
        "temperature": _f("randomness (0: greedy; clamped to >= 0)"),
        "dynatemp_range": _f("dynamic temperature range"),
        "dynatemp_exponent": _f("dynamic temperature exponent"),
        "repeat_last_n": _num("tokens considered for the repetition penalty", 0),
        "repeat_penalty": _f("repetition penalty"),
        "frequency_penalty": _f("frequency penalty"),
        "presence_penalty": _f("presence penalty"),
        "dry_multiplier": _f("DRY penalty multiplier"),
        "dry_base": _f("DRY penalty base"),
        "dry_allowed_length": _num("DRY allowed repetition length", 0),
        "dry_penalty_last_n": _num("tokens DRY scans", 0),
        "mirostat": _num("Mirostat version (clamped to 0..2)"),
        "mirostat_tau": _f("Mirostat target entropy"),
        "mirostat_eta": _f("Mirostat learning rate"),
        "adaptive_target": _f("adaptive sampling target (clamped to <= 1)"),
        "adaptive_decay": Field(Num(0.0, 0.99), "adaptive sampling decay"),
        "seed": Field(Int(-1, UINT32_MAX), "random seed (-1: random; read as uint32)"),
        "n_probs": Field(Int(0, logprob_limit), "probabilities of the top N tokens per generated token"),
        "logprobs": Field(Int(0, logprob_limit), "alias of n_probs"),
        "min_keep": _num("samplers keep at least this many tokens", 0),
        "backend_sampling": Field(Bool(), "sample in the backend"),
        "post_sampling_probs": Field(Bool(), "probabilities after the sampling chain"),
        "lora": Field(
            Json(Size(64 * 1024, "characters of JSON")),
            "LoRA adapters and scales",
            who="nobody",
            why="the supervisor loads no LoRA adapters",
        ),
        "dry_sequence_breakers": Field(_BREAKERS, "DRY sequence breakers"),
        "json_schema": Field(
            JsonSchema(Either((Obj(text=SCHEMA_TEXT), Bool()))),
            "constrain the output to a JSON schema",
        ),
        "grammar": Field(
            Grammar(Text(PROGRAM_CHARS, "grammar_char")), "constrain the output to a GBNF grammar"
        ),
        "grammar_lazy": Field(Bool(), "apply the grammar only once a trigger appears"),
        "chat_format": Field(
            Json(Size(64 * 1024, "characters of JSON")), "chat format", who="nobody", why=_INTERNAL
        ),
        # Not null: the chat parser reads it whenever the key is present (``body.at(...).get<string>``).
        "reasoning_format": Field(
            Str(("none", "auto", "deepseek", "deepseek-legacy")), "where reasoning text goes", nullable=False
        ),
        "generation_prompt": Field(Text(), "text appended to the chat template's output"),
        "parse_tool_calls": Field(Bool(), "parse tool calls from the output"),
        "chat_parser": Field(
            Json(Size(64 * 1024, "characters of JSON")), "chat parser program", who="nobody", why=_INTERNAL
        ),
        "continue_final_message": Field(
            Either((Bool(), Str(("content", "reasoning_content")))), "continue the last message"
        ),
        "echo": Field(Bool(), "echo the prompt in the answer"),
        "preserved_tokens": Field(_NAMES, "token strings never split"),
        "grammar_triggers": Field(
            Triggers(Arr(TRIGGER, size=Size(256, "elements"))), "what starts a lazy grammar"
        ),
        "reasoning_control": Field(Bool(), "reasoning can be ended at run time"),
        "reasoning_budget_tokens": _num("tokens of reasoning (-1: no budget)", -1),
        "reasoning_budget_start_tag": Field(Str(), "start of the reasoning section"),
        "reasoning_budget_end_tags": Field(_NAMES, "ends of the reasoning section"),
        "reasoning_budget_end_tag": Field(Str(), "end of the reasoning section"),
        "reasoning_budget_message": Field(Text(64 * 1024), "text forced before the end tag"),
        "logit_bias": Field(LOGIT_BIAS, "bias of tokens (id or text) -> number or false"),
        "ignore_eos": Field(Bool(), "go on past end-of-generation tokens"),
        "stop": Field(_STOP, "stop strings"),
        "samplers": Field(Either((Str(), _NAMES)), "sampler order"),
    }
)

# Fields the pinned source declares that are nested in another (``field_nested``).
NESTED = {"stream_options": ("include_usage",)}
