"""A non-streamed OpenAI answer built from the child's stream.

Why the proxy asks llama-server for a stream even when the client did not: the child notices a closed
connection only when it writes to it, or after a full second in which *no task at all* produced a result
(server-queue.cpp ``recv_with_timeout``: any other request's token resets the wait). A non-streamed
request writes nothing until it is done, so with any other traffic its client could leave and the slot
kept generating to the end while the proxy had already handed the permit on. Streamed from the child, a
client that leaves closes the upstream connection and the child stops at its next token, like a stream.

The answer is the one llama-server itself builds for ``stream: false`` (tools/server/server-task.cpp
``to_json_oaicompat_chat`` / ``to_json_oaicompat``), assembled per choice ``index``:
- chat: ``message`` = ``role``, ``content`` (always, ``""`` when empty), ``reasoning_content`` and
  ``tool_calls`` when present (tool-call deltas joined by their index); ``finish_reason``; ``logprobs``
  (``{"content": [...]}``) when any were sent.
- completions: ``text``, ``logprobs`` (null when none), ``finish_reason``.
- ``usage`` is the sum over the request's sequences (llama-server's own non-streamed answer for ``n`` > 1
  or a prompt array reports only the first sequence's); ``timings`` is the first sequence's.
- ``__verbose`` (a child started verbose: its debugging copy of the result in llama-server's own
  format) is the first finished sequence's, as the stream's final chunk carries it
  (``to_json_oaicompat_chat_stream``: the final result's ``to_json_non_oaicompat``, ``"stop": true``),
  which is what the child's non-streamed answer carries. It goes through the same privacy rule as the
  rest of the answer (``proxy.streams.privacy``).
Differences that remain: with a stop word, the non-streamed answer drops the stop word's token
probabilities, the streamed one does not.

The proxy also asks for ``return_progress``: llama-server then writes a progress event after each batch
of the prompt, so it notices a client that left while a long prompt is processed; those events carry no
text and are dropped here.

Held in memory: the answer being built, bounded by ``limit`` bytes of stream received.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from proxy.errors import UpstreamFailure

Kind = Literal["chat", "completion"]


def assembled_as(kind: Kind | None, payload: dict[str, Any]) -> Kind | None:
    """What to assemble when this non-streamed request of a route that assembles ``kind`` is streamed
    from the child, or None to relay the child's own non-streamed answer (a route that does not
    assemble; and chat with tools and logprobs, which llama-server refuses to stream)."""
    if kind == "chat" and payload.get("logprobs") is True and payload.get("tools"):
        return None
    return kind


class AnswerTooLarge(UpstreamFailure):
    """The answer grew beyond the proxy's bound for non-streamed answers."""


@dataclass
class _Choice:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tools: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: list[Any] | None = None
    finish_reason: str | None = None


class Assembler:
    """Feed the child's stream chunk by chunk; ``answer()`` gives (status, body) at the end."""

    def __init__(self, kind: Kind, limit: int) -> None:
        self.kind = kind
        self.limit = limit
        self.received = 0
        self._pending = b""
        self._head: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        self._usage: dict[str, Any] | None = None
        self._timings: dict[str, Any] | None = None
        self._verbose: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        self.received += len(chunk)
        if self.received > self.limit:
            raise AnswerTooLarge(
                f"the answer exceeds the proxy's limit of {self.limit} bytes for non-streamed answers; "
                "ask for fewer tokens or stream it"
            )
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return
        self._pending = data[end + 2 :]
        for event in data[:end].split(b"\n\n"):
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._event(line[5:].strip())

    def _event(self, payload: bytes) -> None:
        if payload == b"[DONE]" or not payload:
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            raise UpstreamFailure("llama-server sent a stream event that is not JSON") from None
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            self.error = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
            return
        if not self._head:
            self._head = {k: obj[k] for k in ("id", "created", "model", "system_fingerprint") if k in obj}
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._add_usage(usage)
        timings = obj.get("timings")
        if isinstance(timings, dict) and self._timings is None:
            self._timings = timings
        verbose = obj.get("__verbose")
        if isinstance(verbose, dict):
            self._keep_verbose(verbose)
        for raw in obj.get("choices") or ():
            self._choice(raw)

    def _keep_verbose(self, verbose: dict[str, Any]) -> None:
        """The first finished sequence's (``stop``), else the latest partial one's."""
        kept = self._verbose
        if kept is None or not kept.get("stop"):
            self._verbose = verbose

    def _add_usage(self, usage: dict[str, Any]) -> None:
        if self._usage is None:
            self._usage = json.loads(json.dumps(usage))  # a copy we may add to
            return
        for key in ("completion_tokens", "prompt_tokens", "total_tokens"):
            if isinstance(usage.get(key), int):
                self._usage[key] = self._usage.get(key, 0) + usage[key]
        details = usage.get("prompt_tokens_details")
        mine = self._usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(mine, dict):
            cached = details.get("cached_tokens")
            if isinstance(cached, int):
                mine["cached_tokens"] = mine.get("cached_tokens", 0) + cached

    def _choice(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            return
        index = raw.get("index", 0)
        if not isinstance(index, int):
            index = 0
        choice = self._choices.get(index)
        if choice is None:  # not ``setdefault(index, _Choice())``: that builds one per event, not per choice
            choice = self._choices[index] = _Choice()
        if raw.get("finish_reason") is not None:
            choice.finish_reason = raw["finish_reason"]
        logprobs = raw.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            choice.logprobs = (choice.logprobs or []) + logprobs["content"]
        if self.kind == "completion":
            text = raw.get("text")
            if isinstance(text, str) and text:
                choice.content.append(text)
            return
        delta = raw.get("delta")
        if not isinstance(delta, dict):
            return
        if isinstance(delta.get("content"), str):
            choice.content.append(delta["content"])
        if isinstance(delta.get("reasoning_content"), str):
            choice.reasoning.append(delta["reasoning_content"])
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict):
                self._tool_call(choice, call)

    @staticmethod
    def _tool_call(choice: _Choice, call: dict[str, Any]) -> None:
        index = call.get("index", 0)
        slot = choice.tools.setdefault(index if isinstance(index, int) else 0, {"name": [], "arguments": []})
        if isinstance(call.get("id"), str):
            slot["id"] = call["id"]
        function = call.get("function")
        if isinstance(function, dict):
            for key in ("name", "arguments"):
                if isinstance(function.get(key), str):
                    slot[key].append(function[key])

    def answer(self) -> tuple[int, dict[str, Any]]:
        """The status and the JSON answer a non-streamed request would have had."""
        if self.error is not None:
            code = self.error.get("code")
            status = code if isinstance(code, int) and 400 <= code <= 599 else 500
            return status, {"error": self.error}
        if not self._choices:
            raise UpstreamFailure("llama-server's stream ended without an answer")
        choices = [self._render(i, c) for i, c in sorted(self._choices.items())]
        out: dict[str, Any] = {"choices": choices}
        out.update({k: v for k, v in self._head.items() if k != "id"})
        out["object"] = "chat.completion" if self.kind == "chat" else "text_completion"
        if self._usage is not None:
            out["usage"] = self._usage
        if "id" in self._head:
            out["id"] = self._head["id"]
        if self._verbose is not None:
            out["__verbose"] = self._verbose
        if self._timings is not None:
            out["timings"] = self._timings
        return 200, out

    def _render(self, index: int, c: _Choice) -> dict[str, Any]:
        finish = c.finish_reason or "length"
        if self.kind == "completion":
            logprobs = {"content": c.logprobs} if c.logprobs else None
            return {"text": "".join(c.content), "index": index, "logprobs": logprobs, "finish_reason": finish}
        message: dict[str, Any] = {"role": "assistant", "content": "".join(c.content)}
        if c.reasoning:
            message["reasoning_content"] = "".join(c.reasoning)
        if c.tools:
            calls = []
            for _, t in sorted(c.tools.items()):
                call: dict[str, Any] = {
                    "type": "function",
                    "function": {"name": "".join(t["name"]), "arguments": "".join(t["arguments"])},
                }
                if "id" in t:
                    call["id"] = t["id"]
                calls.append(call)
            message["tool_calls"] = calls
        choice: dict[str, Any] = {"finish_reason": finish, "index": index, "message": message}
        if c.logprobs:
            choice["logprobs"] = {"content": c.logprobs}
        return choice
