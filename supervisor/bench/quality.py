"""A small quality set: prompts with an expected-answer check, run greedily, one at a time.

File format (JSONL, one item a line)::

    {"prompt": "What is the capital of France?", "expect": "Paris"}
    {"messages": [{"role": "user", "content": "2+2?"}], "expect_regex": "\\b4\\b"}

``expect`` is a case-insensitive substring, ``expect_regex`` a case-insensitive regular expression.
Only pass/fail per item is kept: answers are never written anywhere.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from supervisor.bench.client import Target
from supervisor.bench.prompts import Message
from supervisor.errors import UsageError


@dataclass(frozen=True)
class Item:
    id: str
    messages: tuple[Message, ...]
    pattern: re.Pattern[str]


@dataclass(frozen=True)
class QualityResult:
    passed: int
    total: int
    errors: int
    failed_ids: tuple[str, ...]

    @property
    def rate(self) -> float | None:
        return self.passed / self.total if self.total else None


def _item(obj: Any, where: str, lineno: int) -> Item:
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: expected a JSON object")
    if isinstance(obj.get("prompt"), str):
        messages: tuple[Message, ...] = ({"role": "user", "content": obj["prompt"]},)
    elif isinstance(obj.get("messages"), list) and obj["messages"]:
        msgs = obj["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
            raise UsageError(f"{where}: every message needs a string 'content'")
        messages = tuple({"role": str(m.get("role", "user")), "content": m["content"]} for m in msgs)
    else:
        raise UsageError(f"{where}: needs 'prompt' (string) or 'messages' (list)")
    if isinstance(obj.get("expect"), str) and obj["expect"]:
        pattern = re.compile(re.escape(obj["expect"]), re.IGNORECASE)
    elif isinstance(obj.get("expect_regex"), str):
        try:
            pattern = re.compile(obj["expect_regex"], re.IGNORECASE)
        except re.error as exc:
            raise UsageError(f"{where}: expect_regex does not compile ({exc})") from exc
    else:
        raise UsageError(f"{where}: needs 'expect' (substring) or 'expect_regex'")
    return Item(str(obj.get("id", f"q{lineno}")), messages, pattern)


def load(path: Path) -> list[Item]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"quality set {path}: {exc.strerror or exc}") from exc
    items = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: invalid JSON ({exc.msg})") from exc
        items.append(_item(obj, where, lineno))
    if not items:
        raise UsageError(f"quality set {path}: no items")
    return items


def evaluate(
    target: Target,
    model: str,
    items: Sequence[Item],
    max_tokens: int = 64,
    timeout_s: float = 300.0,
    transport: httpx.BaseTransport | None = None,
) -> QualityResult:
    passed = errors = 0
    failed: list[str] = []
    with httpx.Client(timeout=timeout_s, transport=transport) as client:
        for item in items:
            body = {
                "model": model,
                "messages": list(item.messages),
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            try:
                response = client.post(
                    target.api_root + "/chat/completions", json=body, headers=target.headers()
                )
                text = (
                    response.json()["choices"][0]["message"]["content"]
                    if response.status_code == 200
                    else None
                )
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                text = None
            if text is None:
                errors += 1
                failed.append(item.id)
            elif item.pattern.search(str(text)):
                passed += 1
            else:
                failed.append(item.id)
    return QualityResult(passed, len(items), errors, tuple(failed))
