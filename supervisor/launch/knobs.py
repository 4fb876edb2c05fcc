"""llama-server's knobs, each declared once: the one list the rest is derived from.

A knob is a setting of the ``llama:`` section that reaches the child. Its row says its name, type,
default, reference text and range check, the flag(s) it becomes, whether a ``models[]`` entry may set
it for one model, and whether it is part of the child's identity. From ``KNOBS``:
- ``config/schema.py`` builds the ``llama:`` fields (``LlamaConfig``) and the ``models[]`` overrides
  (``ServedModelConfig``, null = inherit);
- ``config/models.py`` puts a ``models[]`` entry's non-null overrides over the ``llama:`` section;
- ``launch/flags.py`` builds ``LaunchSpec`` (one field per knob) and the argv rows (every spelling is
  refused in ``extra_args``);
- ``daemon/prepare.py`` fills the spec from the section and ``daemon/identity.py`` writes the
  identity's ``serving`` record.
Adding a row is the whole change for a plain ``--flag VALUE`` knob (tests/unit/test_knobs.py adds one
and finds it in all four). Only code that reads a knob by name needs the type checker's view of it
(the ``TYPE_CHECKING`` classes in ``schema.py`` and ``flags.py``, held to this table by a test).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NewType

from supervisor.checks import Check, at_least, multiple_of_256
from supervisor.launch.chat_template import check_chat_template, is_builtin

CacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
# A built-in name kept as given, or a file path (relative to the config file, like every path).
NameOrPath = NewType("NameOrPath", str)

# How a flag's value comes from the launch spec (a ``LaunchSpec``); None leaves the flag out, True
# passes it bare.
Value = Callable[[Any], str | bool | None]


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # the first is what we pass; every one is refused in extra_args
    value: Value


def own_value(name: str) -> Value:
    """The knob's value as the flag's: None leaves it out, a bool is a bare flag or nothing."""

    def value(spec: Any) -> str | bool | None:
        v = getattr(spec, name)
        return v if v is None or isinstance(v, bool) else str(v)

    return value


@dataclass(frozen=True)
class Knob:
    name: str
    type: Any  # the config field's type (a model's override is this or None)
    default: Any
    doc: str
    check: Check | None = None
    flag: tuple[str, ...] = ()  # the spellings of its option; () = no option of its own
    value: Value | None = None  # the option's value from the spec; None = the knob's own value
    also: tuple[Flag, ...] = ()  # further flags it decides
    per_model: bool = True  # a models[] entry may set it for its child
    identity: bool = True  # part of what the identity says was served

    def flags(self) -> tuple[Flag, ...]:
        own = (Flag(self.flag, self.value or own_value(self.name)),) if self.flag else ()
        return own + self.also


def _template_name(s: Any) -> str | None:
    t = s.chat_template
    return t if t is not None and is_builtin(t) else None


def _template_file(s: Any) -> str | None:
    t = s.chat_template
    return t if t is not None and not is_builtin(t) else None


KNOBS: tuple[Knob, ...] = (
    Knob(
        "threads",
        int | None,
        None,
        "decode threads (-t); null = physical cores",
        at_least(1),
        flag=("-t", "--threads"),
    ),
    Knob(
        "threads_batch",
        int | None,
        None,
        "prompt threads (-tb); null = same as threads",
        at_least(1),
        flag=("-tb", "--threads-batch"),
    ),
    # Never leave -np unset: "auto" means 4 slots sharing one unified pool.
    Knob("slots", int, 2, "parallel sequences (-np)", at_least(1), flag=("-np", "--parallel")),
    Knob(
        "ctx_per_slot",
        int,
        4096,
        "context tokens per slot, a multiple of 256; -c is this times slots",
        multiple_of_256,
        # -c is the TOTAL context; with -np explicit each slot gets c / np (LLAMA_SERVER.md).
        flag=("-c", "--ctx-size"),
        value=lambda s: str(s.ctx_per_slot * s.slots),
    ),
    Knob(
        "gpu_layers",
        int,
        0,
        "layers offloaded to a GPU (-ngl); 0 for CPU serving",
        at_least(0),
        flag=("-ngl", "--gpu-layers", "--n-gpu-layers"),
    ),
    Knob(
        "embeddings", bool, False, "serve /v1/embeddings (--embeddings)", flag=("--embeddings", "--embedding")
    ),
    Knob(
        "reranking",
        bool,
        False,
        "serve /v1/rerank (--rerank; needs a reranker model)",
        flag=("--rerank", "--reranking"),
    ),
    Knob("cache_type_k", CacheType, "f16", "KV cache type for K (-ctk)", flag=("-ctk", "--cache-type-k")),
    Knob("cache_type_v", CacheType, "f16", "KV cache type for V (-ctv)", flag=("-ctv", "--cache-type-v")),
    # RAM beyond the KV cache that llama-server's defaults leave nearly unbounded (an 8 GiB prompt
    # cache, 32 checkpoints per slot): set so the memory budget can count it.
    Knob(
        "prompt_cache_mib",
        int,
        256,
        "RAM for llama-server's cache of earlier prompts' states, reused by later requests (--cache-ram);"
        " in the memory budget; 0 = off",
        at_least(0),
        flag=("--cache-ram", "-cram"),
    ),
    Knob(
        "ctx_checkpoints",
        int,
        8,
        "context checkpoints kept per slot by sliding-window models (--ctx-checkpoints); in the memory"
        " budget; 0 = off",
        at_least(0),
        flag=("--ctx-checkpoints", "-ctxcp", "--swa-checkpoints"),
    ),
    # Becomes --slot-save-path with the identity's private folder (daemon/state_disk.py), not a flag value.
    Knob(
        "state_disk_mib",
        int | None,
        None,
        "disk for conversations' states under the slots (the disk tier: llama-server's slot save and"
        " restore) in llama.state_dir; null = 4096 MiB where that file system has room for it, else off;"
        " 0 = off",
        at_least(0),
        identity=False,
    ),
    # Appended after every flag (flags.build_argv); no option of its own.
    Knob(
        "extra_args",
        tuple[str, ...],
        (),
        "appended to the child's argv; flags the supervisor sets itself are refused",
    ),
    # A built-in name needs --no-jinja: with Jinja on (the default) llama-server renders the name
    # itself as the template (launch/chat_template.py).
    Knob(
        "chat_template",
        NameOrPath | None,
        None,
        "chat format: a llama.cpp built-in name (--chat-template NAME --no-jinja) or a Jinja template file"
        " (--chat-template-file); null = the GGUF's own template (gemma for the Gemma demo model, whose"
        " GGUF has none)",
        check_chat_template,
        flag=("--chat-template",),
        value=_template_name,
        also=(
            Flag(("--no-jinja", "--jinja"), lambda s: True if _template_name(s) else None),
            Flag(("--chat-template-file",), _template_file),
        ),
    ),
)


def knob(name: str) -> Knob:
    for k in KNOBS:
        if k.name == name:
            return k
    raise KeyError(name)
