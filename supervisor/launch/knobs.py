"""llama-server's knobs, each declared once: a field of ``LlamaKnobs`` with its ``knob(...)`` row.

A knob is a setting of the ``llama:`` section that reaches the child. Its field says its name, type and
default; its ``knob()`` metadata says the reference text, the range check, the flag(s) it becomes,
whether a ``models[]`` entry may set it for one model, and whether it is part of the child's identity.
``KNOBS`` is read from the fields, and the rest is derived from it:
- ``config/schema.py``: ``LlamaConfig`` (the ``llama:`` section) is ``LlamaKnobs`` plus the lock, the
  binary and the model; ``ServedModelConfig`` (a ``models[]`` entry) gets a field per per-model knob,
  null = inherit;
- ``config/models.py`` puts a ``models[]`` entry's non-null overrides over the ``llama:`` section;
- ``launch/flags.py``: ``LaunchSpec`` holds the resolved knobs, and the argv rows come from ``KNOBS``
  (every spelling is refused in ``extra_args``);
- ``daemon/identity.py`` writes the identity's ``serving`` record.
Adding a field is the whole change for a plain ``--flag VALUE`` knob (tests/unit/test_knobs.py adds one
to a copy of this file and finds it in all four). This module sits below ``config/`` (the layers of
tests/unit/test_layout.py), which is why the knobs are a base class of ``LlamaConfig`` and not its body.
"""

# ruff: noqa: RUF009 - knob() returns dataclasses.field(...), which ruff cannot see through
from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Generic, Literal, NewType, TypeVar

from supervisor.checks import Check, at_least, matches, multiple_of_256
from supervisor.launch.chat_template import check_chat_template, is_builtin

CacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
# A built-in name kept as given, or a file path (relative to the config file, like every path).
NameOrPath = NewType("NameOrPath", str)

T = TypeVar("T")


@dataclass(frozen=True)
class Flag(Generic[T]):
    """One option of the child's argv: its spellings (the first is what we pass; every one is refused
    in extra_args) and its value from a ``T`` (the knobs, or the whole launch spec): None leaves the
    flag out, True passes it bare."""

    names: tuple[str, ...]
    value: Callable[[T], str | bool | None]


@dataclass(frozen=True)
class Row:
    """What a knob's field carries in its metadata (under ``"knob"``) beside ``doc`` and ``check``."""

    flag: tuple[str, ...] = ()  # the spellings of its option; () = no option of its own
    value: Callable[[LlamaKnobs], str | bool | None] | None = None  # None: the knob's own value
    also: tuple[Flag[LlamaKnobs], ...] = ()  # further flags it decides
    per_model: bool = True  # a models[] entry may set it for its child
    identity: bool = True  # part of what the identity says was served
    env: str | None = None  # the child's environment variable it sets (instead of a flag)
    # A saved KV state depends on it (the cells' layout or meaning): part of the states folder's identity
    # (``daemon/state_disk.state_identity``), so a state is never restored into a child it does not fit.
    kv_state: bool = False


def knob(
    default: Any,
    doc: str,
    check: Check | None = None,
    *,
    flag: tuple[str, ...] = (),
    value: Callable[[LlamaKnobs], str | bool | None] | None = None,
    also: tuple[Flag[LlamaKnobs], ...] = (),
    per_model: bool = True,
    identity: bool = True,
    env: str | None = None,
    kv_state: bool = False,
) -> Any:
    """A knob's field: its default, reference text and check (read like every config ``setting``) and
    its ``Row``. Defaults are immutable (tuples): a frozen config holds no shared list."""
    if isinstance(default, list | dict):
        raise TypeError("use a tuple default")
    row = Row(flag, value, also, per_model, identity, env, kv_state)
    return field(default=default, metadata={"doc": doc, "check": check, "knob": row})


def _template_name(k: LlamaKnobs) -> str | None:
    t = k.chat_template
    return t if t is not None and is_builtin(t) else None


def _template_file(k: LlamaKnobs) -> str | None:
    t = k.chat_template
    return t if t is not None and not is_builtin(t) else None


@dataclass(frozen=True)
class LlamaKnobs:
    threads: int | None = knob(
        None, "decode threads (-t); null = physical cores", at_least(1), flag=("-t", "--threads")
    )
    threads_batch: int | None = knob(
        None, "prompt threads (-tb); null = same as threads", at_least(1), flag=("-tb", "--threads-batch")
    )
    # Never leave -np unset: "auto" means 4 slots sharing one unified pool.
    slots: int = knob(2, "parallel sequences (-np)", at_least(1), flag=("-np", "--parallel"))
    ctx_per_slot: int = knob(
        4096,
        "context tokens per slot, a multiple of 256; -c is this times slots",
        multiple_of_256,
        # -c is the TOTAL context; with -np explicit each slot gets c / np (LLAMA_SERVER.md).
        flag=("-c", "--ctx-size"),
        value=lambda k: str(k.ctx_per_slot * k.slots),
        kv_state=True,  # a restore must fit the slot
    )
    gpu_layers: int = knob(
        0,
        "layers offloaded to a GPU (-ngl); 0 for CPU serving",
        at_least(0),
        flag=("-ngl", "--gpu-layers", "--n-gpu-layers"),
    )
    embeddings: bool = knob(
        False, "serve /v1/embeddings (--embeddings)", flag=("--embeddings", "--embedding")
    )
    reranking: bool = knob(
        False, "serve /v1/rerank (--rerank; needs a reranker model)", flag=("--rerank", "--reranking")
    )
    cache_type_k: CacheType = knob(
        "f16", "KV cache type for K (-ctk)", flag=("-ctk", "--cache-type-k"), kv_state=True
    )
    cache_type_v: CacheType = knob(
        "f16", "KV cache type for V (-ctv)", flag=("-ctv", "--cache-type-v"), kv_state=True
    )
    # RAM beyond the KV cache that llama-server's defaults leave nearly unbounded (an 8 GiB prompt
    # cache, 32 checkpoints per slot): set so the memory budget can count it.
    prompt_cache_mib: int = knob(
        256,
        "RAM for llama-server's cache of earlier prompts' states, reused by later requests (--cache-ram);"
        " in the memory budget; 0 = off",
        at_least(0),
        flag=("--cache-ram", "-cram"),
    )
    ctx_checkpoints: int = knob(
        8,
        "context checkpoints kept per slot by sliding-window models (--ctx-checkpoints); in the memory"
        " budget; 0 = off",
        at_least(0),
        flag=("--ctx-checkpoints", "-ctxcp", "--swa-checkpoints"),
    )
    # Becomes --slot-save-path with the identity's private folder (daemon/state_disk.py), not a flag value.
    state_disk_mib: int | None = knob(
        None,
        "disk for conversations' states under the slots (the disk tier: llama-server's slot save and"
        " restore) in llama.state_dir; null = 4096 MiB where that file system has room for it, else off;"
        " 0 = off",
        at_least(0),
        identity=False,
    )
    # Read by the proxy's disk tier (``proxy.conversations.writes``) through ``SlotStates``, not a flag.
    state_write_mib_s: int | None = knob(
        None,
        "the most MiB a second the disk tier writes for the model, on average (a burst of 2 s of it);"
        " null = no bound beyond writing only states likely to be read again",
        at_least(1),
        identity=False,
    )
    # Appended after every flag (flags.build_argv); no option of its own.
    extra_args: tuple[str, ...] = knob(
        (),
        "appended to the child's argv; flags the supervisor sets itself are refused",
        kv_state=True,  # anything there may change the cache: -fa, --swa-full...
    )
    # A built-in name needs --no-jinja: with Jinja on (the default) llama-server renders the name
    # itself as the template (launch/chat_template.py).
    chat_template: NameOrPath | None = knob(
        None,
        "chat format: a llama.cpp built-in name (--chat-template NAME --no-jinja) or a Jinja template file"
        " (--chat-template-file); null = the GGUF's own template (gemma for the Gemma demo model, whose"
        " GGUF has none)",
        check_chat_template,
        flag=("--chat-template",),
        value=_template_name,
        also=(
            Flag(("--no-jinja", "--jinja"), lambda k: True if _template_name(k) else None),
            Flag(("--chat-template-file",), _template_file),
        ),
    )
    # No flag: it chooses the binary the child runs (daemon/prepare.py, resolve_binary).
    variant: str = knob(
        "cpu",
        "which build of llama-build.lock runs this model: cpu, or a [variant.NAME] table of the lock such as"
        " vulkan (built by llamagate build --variant NAME); ignored with llama.binary",
        matches(r"[a-z][a-z0-9_-]{0,31}", "a build variant's name, such as cpu or vulkan"),
    )
    device: str | None = knob(
        None,
        "devices the layers are offloaded to (--device): names from llama-server --list-devices, comma-"
        "separated, such as Vulkan0; none = no offload; null = every GPU the build finds",
        matches(
            r"none|[A-Za-z][A-Za-z0-9_]*(,[A-Za-z][A-Za-z0-9_]*)*", "device names such as Vulkan0, or none"
        ),
        flag=("--device", "-dev"),
    )
    # ggml-vulkan enumerates discrete and integrated GPUs only, unless this names devices: the one way
    # to reach a CPU-type device such as lavapipe (ggml-vulkan.cpp, ggml_vk_instance_init).
    vulkan_devices: str | None = knob(
        None,
        "Vulkan devices the vulkan build may use, by index (GGML_VK_VISIBLE_DEVICES, such as 0 or 0,1);"
        " null = every discrete and integrated GPU; a CPU-type device (Mesa's lavapipe) only when named",
        matches(r"[0-9]+(,[0-9]+)*", "device indexes such as 0 or 0,1"),
        env="GGML_VK_VISIBLE_DEVICES",
    )


@dataclass(frozen=True)
class Knob:
    """A knob as the code that derives from it reads it: its field and its ``Row`` together."""

    name: str
    type: Any  # the config field's type (a model's override is this or None)
    default: Any
    doc: str
    check: Check | None
    row: Row

    @property
    def per_model(self) -> bool:
        return self.row.per_model

    @property
    def identity(self) -> bool:
        return self.row.identity

    @property
    def env(self) -> str | None:
        return self.row.env

    def flags(self) -> tuple[Flag[LlamaKnobs], ...]:
        if not self.row.flag:
            return self.row.also
        return (Flag(self.row.flag, self.row.value or own_value(self.name)), *self.row.also)


def own_value(name: str) -> Callable[[LlamaKnobs], str | bool | None]:
    """The knob's value as the flag's: None leaves it out, a bool is a bare flag or nothing."""

    def value(k: LlamaKnobs) -> str | bool | None:
        v = getattr(k, name)
        return v if v is None or isinstance(v, bool) else str(v)

    return value


def knobs_of(cls: type[LlamaKnobs]) -> tuple[Knob, ...]:
    """Every field of ``cls`` declared with ``knob()``, in declaration order."""
    hints = typing.get_type_hints(cls)
    return tuple(
        Knob(f.name, hints[f.name], f.default, f.metadata["doc"], f.metadata["check"], f.metadata["knob"])
        for f in fields(cls)
        if "knob" in f.metadata
    )


KNOBS: tuple[Knob, ...] = knobs_of(LlamaKnobs)
