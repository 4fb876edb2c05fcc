"""Prompt sets: ``builtin`` short questions, a FILE of prompts, ``gen:TOKENS`` synthetic documents, or
``shared:TOKENS`` (one shared document + a different question each time: the prompt cache's case).

Every set is deterministic for a given seed, so two runs (or the direct and the gated side of a
comparison) send the same sequence. Generated prompts differ from their first word on, so llama-server's
prompt cache cannot reuse one request's prefix for the next: each one pays its full prompt, like a
retrieval-augmented request carrying a fresh document.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.errors import UsageError

Message = dict[str, str]

BUILTIN: tuple[str, ...] = (
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "List three uses for a paperclip.",
    "What does a compiler do?",
    "Give one tip for writing clear emails.",
    "Why do cats purr?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "What is the difference between weather and climate?",
    "Name three planets of the solar system.",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a small bakery.",
    "What is photosynthesis?",
    "Translate 'good morning' into Spanish.",
    "Describe a sunset in one sentence.",
    "What is a prime number? Give two examples.",
    "Why is exercise good for health?",
    "Explain what an API is to a child.",
    "What are the three states of matter?",
    "Write a short thank-you note to a teacher.",
    "How many days are there in a leap year?",
    "What causes ocean tides?",
    "Give a synonym for 'happy'.",
    "What is the boiling point of water at sea level?",
)

# Common English words that Gemma-, Llama- and GPT-style tokenizers encode as one token each with
# a leading space; ``gen:N`` lands within a few percent of N prompt tokens. The exact count comes
# back in each record's ``prompt_tokens`` (from usage), so nothing relies on this estimate.
_WORD_BLOCK = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education food energy market light river garden
table window paper music field street plan road price report model rate voice value cost
"""
_WORDS = tuple(_WORD_BLOCK.split())
# The chat template and the instruction add about this many tokens (measured on Gemma 3: gen:512 -> 512).
_GEN_OVERHEAD_TOKENS = 38


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: tuple[Message, ...]


class PromptSet:
    """Prompt ``i`` of a run, deterministic for a seed; fixed sets are cycled in a seeded order.

    ``gen_tokens``: a fresh document per request. ``shared_tokens``: ONE document for every request,
    each followed by a different built-in question (a shared prefix, what the prompt cache is for).
    """

    def __init__(
        self,
        name: str,
        prompts: Sequence[Prompt] | None,
        gen_tokens: int | None,
        seed: int,
        shared_tokens: int | None = None,
    ) -> None:
        self.name = name
        self._prompts = list(prompts or ())
        self._gen_tokens = gen_tokens
        self._shared = None if shared_tokens is None else _words(shared_tokens, f"{seed}:shared")
        self._shared_tokens = shared_tokens
        self._seed = seed
        self._order = list(range(len(self._prompts)))
        random.Random(seed).shuffle(self._order)  # noqa: S311 (reproducible, not secret)

    def get(self, index: int) -> Prompt:
        if self._gen_tokens is not None:
            return _generated(self._gen_tokens, self._seed, index)
        prompt = self._prompts[self._order[index % len(self._order)]]
        if self._shared is None:
            return prompt
        question = prompt.messages[-1]["content"]
        text = f"Reference text: {self._shared}\n\nIgnore the reference text and answer: {question}"
        return Prompt(f"shared:{self._shared_tokens}:{prompt.id}", ({"role": "user", "content": text},))


def _words(tokens: int, seed: str) -> str:
    rng = random.Random(seed)  # noqa: S311 (reproducible, not secret)
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, tokens - _GEN_OVERHEAD_TOKENS)))


def _generated(tokens: int, seed: int, index: int) -> Prompt:
    words = _words(tokens, f"{seed}:{index}")
    text = f"{words}\n\nThe text above is a list of words. Which word appears first?"
    return Prompt(f"gen:{tokens}:{index}", ({"role": "user", "content": text},))


def _user(text: str) -> tuple[Message, ...]:
    return ({"role": "user", "content": text},)


def _parse_messages(value: Any, where: str) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise UsageError(f"{where}: 'messages' must be a non-empty list")
    out: list[Message] = []
    for i, msg in enumerate(value):
        if (
            not isinstance(msg, dict)
            or not isinstance(msg.get("role"), str)
            or not isinstance(msg.get("content"), str)
        ):
            raise UsageError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
        out.append({"role": msg["role"], "content": msg["content"]})
    return tuple(out)


def _load_file(path: Path) -> list[Prompt]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"prompt file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"prompt file {path}: not UTF-8 text ({exc.reason})") from exc
    jsonl = path.suffix == ".jsonl"
    prompts: list[Prompt] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        pid = f"file:{lineno}"
        if not jsonl:
            prompts.append(Prompt(pid, _user(line)))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: invalid JSON ({exc.msg})") from exc
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(Prompt(pid, _user(obj["prompt"])))
        elif isinstance(obj, dict) and "messages" in obj:
            prompts.append(Prompt(pid, _parse_messages(obj["messages"], where)))
        else:
            raise UsageError(f"{where}: expected {{'prompt': str}} or {{'messages': [...]}}")
    if not prompts:
        raise UsageError(f"prompt file {path}: no prompts (one per line, or JSONL with 'prompt'/'messages')")
    return prompts


def _builtin() -> list[Prompt]:
    return [Prompt(f"builtin:{i}", _user(t)) for i, t in enumerate(BUILTIN)]


def load_prompts(spec: str, seed: int) -> PromptSet:
    """``builtin``, ``gen:TOKENS``, ``shared:TOKENS`` or a path (``.jsonl``: one JSON object a line;
    else one prompt a line)."""
    if spec == "builtin":
        return PromptSet(spec, _builtin(), None, seed)
    for prefix in ("gen:", "shared:"):
        if spec.startswith(prefix):
            raw = spec[len(prefix) :]
            if not raw.isdigit() or not 1 <= int(raw) <= 1_000_000:
                raise UsageError(f"--prompts {spec}: expected {prefix}TOKENS with TOKENS a positive integer")
            if prefix == "gen:":
                return PromptSet(spec, None, int(raw), seed)
            return PromptSet(spec, _builtin(), None, seed, shared_tokens=int(raw))
    return PromptSet(spec, _load_file(Path(spec)), None, seed)
