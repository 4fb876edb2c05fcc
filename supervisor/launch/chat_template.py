"""``llama.chat_template``: one of llama.cpp's built-in chat formats by name, or a Jinja template file.

A built-in name is passed as ``--chat-template NAME --no-jinja``. The ``--no-jinja`` is not optional:
at the pinned commit llama-server runs chat templates through Jinja by default, and Jinja takes a
name as template *text*; seen: ``--chat-template gemma`` turned every chat request into the prompt
``gemma``. Only the non-Jinja formatter (``llama_chat_apply_template``) knows the names. A file is
passed as ``--chat-template-file PATH`` and rendered by Jinja, like a GGUF's own template.

The names are ``LLM_CHAT_TEMPLATES`` in ``vendor/llama.cpp/src/llama-chat.cpp`` of the pinned source
(what ``llama_chat_builtin_templates`` returns); tests/unit/test_chat_template.py compares them with
the cached source tarball when it is there. ``flags.FLAGS`` turns a checked value into flags.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

BUILTIN_CHAT_TEMPLATES: tuple[str, ...] = (
    "chatml", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "mistral-v1", "mistral-v3",
    "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken", "phi3", "phi4", "falcon3", "zephyr", "monarch",
    "gemma", "orion", "openchat", "vicuna", "vicuna-orca", "deepseek", "deepseek2", "deepseek3",
    "deepseek-ocr", "command-r", "llama3", "chatglm3", "chatglm4", "glmedge", "minicpm", "exaone3",
    "exaone4", "exaone-moe", "rwkv-world", "granite", "granite-4.0", "granite-4.1", "gigachat", "megrez",
    "yandex", "bailing", "bailing-think", "bailing2", "llama4", "smolvlm", "hunyuan-moe", "gpt-oss",
    "hunyuan-dense", "hunyuan-vl", "kimi-k2", "seed_oss", "grok-2", "pangu-embedded", "solar-open",
)  # fmt: skip


def is_builtin(value: str) -> bool:
    return value in BUILTIN_CHAT_TEMPLATES


def check_chat_template(value: str) -> str | None:
    """None when ``value`` is a built-in name or a readable file; otherwise what is wrong."""
    if is_builtin(value):
        return None
    path = Path(value)
    if path.is_file():
        return None if os.access(path, os.R_OK) else f"template file {value} is not readable"
    if path.exists():
        return f"{value} is not a file"
    close = difflib.get_close_matches(path.name, BUILTIN_CHAT_TEMPLATES, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return (
        f"{path.name!r} is neither a built-in template name{hint} nor an existing file {value}; "
        "built-in names: " + ", ".join(BUILTIN_CHAT_TEMPLATES)
    )
