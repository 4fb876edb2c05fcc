"""The child's argv and environment, from one declarative table.

Every flag the supervisor sets is a row: its spellings (the first is what we pass; all of them are
refused in ``llama.extra_args``) and how its value comes from the ``LaunchSpec``. The rows every child
has are ``FLAGS``; the knobs' rows (``KNOB_FLAGS``) come from ``knobs.KNOBS`` and read the spec's
resolved knobs (``spec.llama``). Flags we never pass but that would undo a guarantee are in
``REFUSED`` with the reason, so config validation can say why. Everything is explicit because
llama-server's own defaults ("auto" slots, auto GPU layers, the web UI) are not what a supervised
service wants.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from proxy.source import SlotStates
from supervisor.launch.knobs import KNOBS, Flag, LlamaKnobs

# Only the child's loopback address: the proxy is the only door.
CHILD_HOST = "127.0.0.1"


@dataclass(frozen=True)
class LaunchSpec:
    """One child's launch: what every child has, and its knobs as ``prepare.launch_spec`` resolved them
    (threads and threads_batch set from the host, the demo model's chat template chosen)."""

    binary: Path
    model: Path
    alias: str
    port: int  # 0: the driver picks a free one per boot
    llama: LlamaKnobs
    # The disk tier's folder and what it checks (daemon/state_disk.py); None: off.
    slot_states: SlotStates | None = None
    # llamagate adds --swa-full: a sliding-window model whose states go to disk (budget/window.py).
    swa_full: bool = False

    def __post_init__(self) -> None:
        if self.llama.threads is None or self.llama.threads_batch is None:
            raise ValueError("a LaunchSpec's threads and threads_batch are resolved (prepare.launch_spec)")

    def with_llama(self, **changes: Any) -> LaunchSpec:
        """This spec with some knobs changed."""
        return replace(self, llama=replace(self.llama, **changes))

    @property
    def threads(self) -> int:
        return self.llama.threads or 1  # never None (__post_init__); "or" only tells the type checker


FLAGS: tuple[Flag[LaunchSpec], ...] = (
    # Always -m: without it llama-server starts in router mode instead of failing.
    Flag(("-m", "--model"), lambda s: str(s.model)),
    Flag(("--host",), lambda s: CHILD_HOST),
    Flag(("--port",), lambda s: str(s.port)),
    Flag(("--metrics",), lambda s: True),
    Flag(("-a", "--alias"), lambda s: s.alias),
    Flag(("--no-ui", "--no-webui", "--ui", "--webui"), lambda s: True),
    # The proxy places conversations on slots (proxy/conversations/slots.py says why both): no prompt is
    # more than 100 % similar, so every request on a used slot goes through the RAM prompt cache (the
    # state it replaces is saved there), and idle slots are not copied to it on every new task.
    Flag(("-sps", "--slot-prompt-similarity"), lambda s: "1.0"),
    Flag(("--no-cache-idle-slots", "--cache-idle-slots"), lambda s: True),
    # The private folder of the child's identity: the proxy saves and restores its slots there.
    Flag(("--slot-save-path",), lambda s: s.slot_states.directory if s.slot_states is not None else None),
)
# Flags llamagate decides but an operator may also give in ``extra_args`` (so they are not refused):
# the decision then does not add them twice.
DECIDED: tuple[Flag[LaunchSpec], ...] = (
    # Full-size KV cache for sliding-window layers, so a state saved to disk restores whole.
    Flag(("--swa-full",), lambda s: s.swa_full or None),
)
# The knobs' own rows, in the table's order, after the rows every child has.
KNOB_FLAGS: tuple[Flag[LlamaKnobs], ...] = tuple(flag for k in KNOBS for flag in k.flags())

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
    "--list-devices": "prints the devices and exits: llamagate verify --variant NAME lists them",
    "--models-dir": "router mode is not supervised",
    "--models-preset": "router mode is not supervised",
    "-hf": _MODEL,
    "-hfr": _MODEL,
    "--hf-repo": _MODEL,
    "-hff": _MODEL,
    "--hf-file": _MODEL,
    "-mu": _MODEL,
    "--model-url": _MODEL,
    # Advisories (docs/security.md): each flag opens a door the proxy cannot guard.
    "--rpc": "offloads to remote ggml RPC servers, which trust whoever reaches them (the --rpc advisories)",
    "--context-shift": "context shifting with a request's n_keep/n_discard (CVE-2026-21869); off by default",
}


def owned_flags() -> dict[str, str]:
    """Every spelling refused in ``extra_args``, with the reason."""
    rows: list[Flag[LaunchSpec] | Flag[LlamaKnobs]] = [*FLAGS, *KNOB_FLAGS]
    out = {name: "set by the supervisor from the config" for flag in rows for name in flag.names}
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
    values = [(f.names[0], f.value(spec)) for f in (*FLAGS, *DECIDED)]
    values += [(f.names[0], f.value(spec.llama)) for f in KNOB_FLAGS]
    for name, value in values:
        if value is None or value is False:
            continue
        argv.append(name)
        if value is not True:
            argv.append(value)
    argv.extend(spec.llama.extra_args)
    return argv


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def knob_env(knobs: LlamaKnobs) -> dict[str, str]:
    """The environment variables the knobs set (``Row.env``), for those that are not null."""
    values = {k.env: getattr(knobs, k.name) for k in KNOBS if k.env is not None}
    return {name: str(v) for name, v in values.items() if v is not None}


def build_env(secret: str, private_dir: Path, knobs: LlamaKnobs | None = None) -> dict[str, str]:
    """A scrubbed environment: nothing inherited. No LLAMA_ARG_* (llama-server reads every one as a
    flag), no HF_* tokens, and XDG_CONFIG_HOME/HOME pointed at an empty private folder so no user
    config.ini is picked up. (/etc/llama.cpp/config.ini cannot be turned off; every setting that
    matters is passed explicitly, and argv wins over that file.) ``knobs``: the variables they set."""
    return {
        **(knob_env(knobs) if knobs is not None else {}),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(private_dir),
        "XDG_CONFIG_HOME": str(private_dir / "config"),
        "XDG_CACHE_HOME": str(private_dir / "cache"),
        "LANG": "C.UTF-8",
        "LLAMA_API_KEY": secret,
    }
