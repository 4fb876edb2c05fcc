"""The child's argv and environment, from one declarative table.

Every flag the supervisor sets is a row of ``FLAGS``: its spellings (the first is what we pass; all of
them are refused in ``llama.extra_args``) and how its value comes from the ``LaunchSpec``. Flags we
never pass but that would undo a guarantee are in ``REFUSED`` with the reason, so config validation
can say why. Everything is explicit because llama-server's own defaults ("auto" slots, auto GPU
layers, the web UI) are not what a supervised service wants.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor.launch.chat_template import is_builtin

# Only the child's loopback address: the proxy is the only door.
CHILD_HOST = "127.0.0.1"


@dataclass(frozen=True)
class LaunchSpec:
    binary: Path
    model: Path
    alias: str
    port: int
    threads: int
    threads_batch: int
    slots: int
    ctx_per_slot: int
    gpu_layers: int = 0
    embeddings: bool = False
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    extra_args: tuple[str, ...] = ()
    prompt_cache_mib: int = 256
    ctx_checkpoints: int = 8
    reranking: bool = False
    chat_template: str | None = None  # checked: a built-in name or a readable file (chat_template.py)


def _template_name(s: LaunchSpec) -> str | None:
    return s.chat_template if s.chat_template is not None and is_builtin(s.chat_template) else None


def _template_file(s: LaunchSpec) -> str | None:
    return s.chat_template if s.chat_template is not None and not is_builtin(s.chat_template) else None


# A value of None leaves the flag out; True passes it bare.
Value = Callable[[LaunchSpec], str | bool | None]


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    value: Value


FLAGS: tuple[Flag, ...] = (
    # Always -m: without it llama-server starts in router mode instead of failing.
    Flag(("-m", "--model"), lambda s: str(s.model)),
    Flag(("--host",), lambda s: CHILD_HOST),
    Flag(("--port",), lambda s: str(s.port)),
    # -c is the TOTAL context; with -np explicit each slot gets c / np (LLAMA_SERVER.md).
    Flag(("-c", "--ctx-size"), lambda s: str(s.ctx_per_slot * s.slots)),
    # Never leave -np unset: "auto" means 4 slots sharing one unified pool.
    Flag(("-np", "--parallel"), lambda s: str(s.slots)),
    Flag(("-t", "--threads"), lambda s: str(s.threads)),
    Flag(("-tb", "--threads-batch"), lambda s: str(s.threads_batch)),
    Flag(("-ngl", "--gpu-layers", "--n-gpu-layers"), lambda s: str(s.gpu_layers)),
    Flag(("--metrics",), lambda s: True),
    Flag(("-a", "--alias"), lambda s: s.alias),
    Flag(("--no-ui", "--no-webui", "--ui", "--webui"), lambda s: True),
    Flag(("--embeddings", "--embedding"), lambda s: True if s.embeddings else None),
    Flag(("--rerank", "--reranking"), lambda s: True if s.reranking else None),
    Flag(("-ctk", "--cache-type-k"), lambda s: s.cache_type_k),
    Flag(("-ctv", "--cache-type-v"), lambda s: s.cache_type_v),
    # RAM beyond the KV cache that llama-server's defaults leave nearly unbounded (an 8 GiB prompt
    # cache, 32 checkpoints per slot): set so the memory budget can count it.
    Flag(("--cache-ram", "-cram"), lambda s: str(s.prompt_cache_mib)),
    Flag(("--ctx-checkpoints", "-ctxcp", "--swa-checkpoints"), lambda s: str(s.ctx_checkpoints)),
    # llama.chat_template. A built-in name needs --no-jinja: with Jinja on (the default) llama-server
    # renders the name itself as the template (supervisor/launch/chat_template.py).
    Flag(("--chat-template",), _template_name),
    Flag(("--no-jinja", "--jinja"), lambda s: True if _template_name(s) else None),
    Flag(("--chat-template-file",), _template_file),
)

_VIA_ENV = "the per-boot secret travels in LLAMA_API_KEY, never in argv (visible to every user in ps)"
_MODEL = "the model is the verified local file in llama.model.path"
_LOGS = "the supervisor captures the child's log and must never see prompt text"
REFUSED: dict[str, str] = {
    "--api-key": _VIA_ENV,
    "--api-key-file": _VIA_ENV,
    "-kvu": "each slot must own its context (the readiness gate and admission assume it)",
    "--kv-unified": "each slot must own its context (the readiness gate and admission assume it)",
    "-v": "verbose logging prints prompt text",
    "--verbose": "verbose logging prints prompt text",
    "--log-verbose": "verbose logging prints prompt text",
    "-lv": "higher verbosity prints prompt text",
    "--verbosity": "higher verbosity prints prompt text",
    "--log-verbosity": "higher verbosity prints prompt text",
    "--verbose-prompt": "prints prompt text",
    "--log-prompts-dir": "writes prompt text to disk",
    "--log-file": _LOGS,
    "--log-disable": _LOGS,
    "--log-jsonl": _LOGS,
    "--reuse-port": "another process could bind the child's port",
    "--api-prefix": "the proxy routes to llama-server's own paths",
    "--ssl-key-file": "the child is reached over loopback only",
    "--ssl-cert-file": "the child is reached over loopback only",
    "--tools": "gives clients file and shell access on the host",
    "--models-dir": "router mode is not supervised",
    "--models-preset": "router mode is not supervised",
    "-hf": _MODEL,
    "-hfr": _MODEL,
    "--hf-repo": _MODEL,
    "-hff": _MODEL,
    "--hf-file": _MODEL,
    "-mu": _MODEL,
    "--model-url": _MODEL,
}


def owned_flags() -> dict[str, str]:
    """Every spelling refused in ``extra_args``, with the reason."""
    out = {name: "set by the supervisor from the config" for flag in FLAGS for name in flag.names}
    out.update(REFUSED)
    return out


def refused_extra_args(extra: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """(index, flag, reason) for each extra argument the supervisor does not allow."""
    owned = owned_flags()
    bad = []
    for i, arg in enumerate(extra):
        name = arg.split("=", 1)[0]
        if name in owned:
            bad.append((i, name, owned[name]))
    return bad


def budget_flags(extra: tuple[str, ...], default_ubatch: int = 512) -> tuple[bool, int]:
    """(--swa-full given, the -ub micro-batch) from ``extra_args``: both change the KV cache's size.
    The last spelling wins, as in llama-server's parser; a value that is not a number stays default."""
    swa_full, ubatch = False, default_ubatch
    for i, arg in enumerate(extra):
        name, eq, inline = arg.partition("=")
        if name == "--swa-full":
            swa_full = True
        elif name in ("-ub", "--ubatch-size"):
            value = inline if eq else (extra[i + 1] if i + 1 < len(extra) else "")
            if value.isdigit() and int(value) > 0:
                ubatch = int(value)
    return swa_full, ubatch


def build_argv(spec: LaunchSpec) -> list[str]:
    argv = [str(spec.binary)]
    for flag in FLAGS:
        value = flag.value(spec)
        if value is None or value is False:
            continue
        argv.append(flag.names[0])
        if value is not True:
            argv.append(value)
    argv.extend(spec.extra_args)
    return argv


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def build_env(secret: str, private_dir: Path) -> dict[str, str]:
    """A scrubbed environment: nothing inherited. No LLAMA_ARG_* (llama-server reads every one as a
    flag), no HF_* tokens, and XDG_CONFIG_HOME/HOME pointed at an empty private folder so no user
    config.ini is picked up. (/etc/llama.cpp/config.ini cannot be turned off; every setting that
    matters is passed explicitly, and argv wins over that file.)"""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(private_dir),
        "XDG_CONFIG_HOME": str(private_dir / "config"),
        "XDG_CACHE_HOME": str(private_dir / "cache"),
        "LANG": "C.UTF-8",
        "LLAMA_API_KEY": secret,
    }
