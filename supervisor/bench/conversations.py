"""``conversations``: multi-turn chats against a target, measured in prompt tokens served from cache.

A chat client sends the whole history every turn, so all of turn k's prompt but the last user message
could come from llama-server's cache: the *reusable maximum* of a later turn is what the previous turn's
prompt and answer held. The workload: ``conversations`` chats of ``turns`` turns, all open at once, at
most ``concurrency`` requests in flight; every chat opens with the same system prompt (an application's)
and a first message of its own; user turns of ``user_tokens``, answers of ``answer_tokens`` (greedy,
``ignore_eos``). The text is drawn from a word list with a fixed seed: the same workload on every target.

Recorded per target, over the later turns (k >= 2): the cached share (cached / prompt tokens, from the
child's own ``cached_tokens``/``cache_n``: the same on any host) against the reusable maximum, turns
below 50 % cached, prompt tokens evaluated (every turn), and the median time to first token by turn.

With an ``Event`` (a SIGHUP reload, an idle unload, a stop and start, a child SIGKILL), every conversation
plays its first ``after_turn`` turns, the event happens (``act``: blocking, it returns the target to go on
with), and then the rest: the turn right after the event is recorded on its own against its reusable
maximum (``after_event``).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from supervisor.bench.client import Target, stream_chat
from supervisor.errors import LlamagateError
from supervisor.progress import NullProgress, Progress

_TEXT = (
    "the river runs past old stone walls where farmers bring apples bread and cheese to the market "
    "each morning while children watch boats drift slowly under bridges painted green and blue "
    "a quiet town keeps its history in small museums gardens libraries and long stories told at dinner"
)
_WORDS = tuple(_TEXT.split(" "))


class ConversationFailed(LlamagateError):
    exit_code = 1


@dataclass(frozen=True)
class Workload:
    conversations: int = 8
    turns: int = 4
    concurrency: int = 4
    system_tokens: int = 300
    user_tokens: int = 150
    answer_tokens: int = 8
    seed: int = 1


@dataclass(frozen=True)
class Event:
    """Something that happens to the target between two turns of every conversation."""

    name: str
    after_turn: int  # the turns every conversation plays first (>= 1)
    act: Callable[[], Target]  # blocking; the target to go on with (a restarted one may move)


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    reusable_tokens: int = 0  # what the previous turn's prompt and answer held (0 on a first turn)


@dataclass
class TargetResult:
    target: str
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0
    event: str | None = None
    event_turn: int | None = None  # the 0-based turn right after the event
    # A daemon's disk tier at the end (its /metrics: saves, restores, bytes, seconds, misses); None: bare.
    tier: dict[str, float] | None = None
    # ``handover``: the conversations whose replica left the ring at the event (None: another event).
    moved: list[int] | None = None

    def later(self) -> list[Turn]:
        return [t for t in self.turns if t.turn > 0]

    def summary(self) -> dict[str, Any]:
        later = self.later()
        prompt = sum(t.prompt_tokens for t in later)
        cached = sum(t.cached_tokens for t in later)
        reusable = sum(min(t.reusable_tokens, t.prompt_tokens) for t in later)
        by_turn: dict[int, list[float]] = {}
        for t in self.turns:
            by_turn.setdefault(t.turn, []).append(t.ttft_s)
        return {
            "target": self.target,
            "cached_share": cached / prompt if prompt else 0.0,
            "reusable_share": reusable / prompt if prompt else 0.0,
            "of_reusable": cached / reusable if reusable else 0.0,
            "turns_below_half": sum(1 for t in later if t.cached_tokens < 0.5 * t.prompt_tokens),
            "later_turns": len(later),
            "prompt_tokens_evaluated": sum(t.prompt_tokens - t.cached_tokens for t in self.turns),
            "ttft_median_ms_by_turn": {
                k + 1: round(1000 * statistics.median(v), 1) for k, v in sorted(by_turn.items())
            },
            "seconds": round(self.seconds, 1),
            **self._after_event(),
            **({"tier": self.tier} if self.tier is not None else {}),
        }

    def _after_event(self) -> dict[str, Any]:
        if self.event is None:
            return {}
        after = [t for t in self.turns if t.turn == self.event_turn]
        cached = sum(t.cached_tokens for t in after)
        reusable = sum(min(t.reusable_tokens, t.prompt_tokens) for t in after)
        out: dict[str, Any] = {
            "event": self.event,
            "after_event_of_reusable": cached / reusable if reusable else 0.0,
            "after_event_turns": len(after),
        }
        if self.moved is not None:
            # From the event on: the moved conversations' turns, and the others' (they stayed put).
            since = [t for t in self.turns if t.turn >= (self.event_turn or 0)]
            moved = [t for t in since if t.conversation in self.moved]
            stayed = [t for t in since if t.conversation not in self.moved]
            for name, turns in (("moved", moved), ("stayed", stayed)):
                cached = sum(t.cached_tokens for t in turns)
                reusable = sum(min(t.reusable_tokens, t.prompt_tokens) for t in turns)
                out[f"{name}_conversations"] = len({t.conversation for t in turns})
                out[f"{name}_of_reusable"] = cached / reusable if reusable else 0.0
        return out


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def run(
    target: Target, name: str, work: Workload, progress: Progress | None = None, event: Event | None = None
) -> TargetResult:
    return asyncio.run(_run(target, name, work, progress or NullProgress(), event))


def _texts(work: Workload) -> tuple[str, list[str], list[list[str]]]:
    """The workload's system prompt, each conversation's opening and its follow-ups."""
    rng = random.Random(work.seed)  # noqa: S311 - a reproducible workload, not a secret
    # About one token per word of this list; the counts recorded are the child's own.
    system = "You are a helpful assistant for a small town. " + _text(rng, work.system_tokens - 10)
    openings = [f"Conversation {c}: " + _text(rng, work.user_tokens - 4) for c in range(work.conversations)]
    follow_ups = [
        [_text(rng, work.user_tokens) for _ in range(work.turns)] for _ in range(work.conversations)
    ]
    return system, openings, follow_ups


def openings(work: Workload) -> list[list[dict[str, str]]]:
    """Each conversation's first messages (the system prompt and its opening): what names it."""
    system, first, _ = _texts(work)
    return [[{"role": "system", "content": system}, {"role": "user", "content": f}] for f in first]


async def _run(
    target: Target, name: str, work: Workload, progress: Progress, event: Event | None
) -> TargetResult:
    system, openings, follow_ups = _texts(work)
    result = TargetResult(name)
    gate = asyncio.Semaphore(work.concurrency)
    done = 0
    total = work.conversations * work.turns
    started = time.monotonic()
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": system}, {"role": "user", "content": openings[c]}]
        for c in range(work.conversations)
    ]
    reusable = [0] * work.conversations
    # A fresh connection per request: llama-server does not keep one alive after a streamed answer, and
    # reusing one it is closing fails with "Server disconnected" (``supervisor.bench.runner`` says the same).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:

        async def conversation(c: int, turns: range) -> None:
            nonlocal done
            messages = histories[c]
            for k in turns:
                async with gate:
                    turn, answer = await _ask(client, target, messages, work.answer_tokens)
                turn.conversation, turn.turn, turn.reusable_tokens = c, k, reusable[c]
                result.turns.append(turn)
                reusable[c] = turn.prompt_tokens + turn.completion_tokens
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": follow_ups[c][k]},
                ]
                done += 1
                progress.update(f"{name}: turns", done / total)

        split = work.turns if event is None else max(1, min(event.after_turn, work.turns - 1))
        await asyncio.gather(*(conversation(c, range(split)) for c in range(work.conversations)))
        if event is not None:
            progress.update(f"{name}: {event.name}", None)
            # On the loop's own (main) thread, blocking: every turn is done, and a restart forks a daemon
            # tied to this thread (``popen_tied``).
            target = event.act()
            result.event, result.event_turn = event.name, split
            await asyncio.gather(
                *(conversation(c, range(split, work.turns)) for c in range(work.conversations))
            )
    result.seconds = time.monotonic() - started
    progress.done(f"{name}: turns", f"{total} in {result.seconds:.0f} s")
    return result


async def _ask(
    client: httpx.AsyncClient, target: Target, messages: list[dict[str, str]], answer_tokens: int
) -> tuple[Turn, str]:
    body = {
        "messages": messages,
        "max_tokens": answer_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ex = await stream_chat(client, target, body, timeout_s=600, keep_text=True)
    if ex.outcome != "ok" or ex.t_send is None or ex.t_first_content is None:
        raise ConversationFailed(f"a turn failed: {ex.error or ex.outcome}")
    cached = ex.cached_tokens if ex.cached_tokens is not None else ex.server.cache_n if ex.server else None
    turn = Turn(
        conversation=0,
        turn=0,
        prompt_tokens=ex.prompt_tokens or 0,
        cached_tokens=cached or 0,
        completion_tokens=ex.completion_tokens or 0,
        ttft_s=ex.t_first_content - ex.t_send,
    )
    return turn, "".join(ex.text or ())


def markdown(results: Sequence[TargetResult], work: Workload, notes: Sequence[str] = ()) -> str:
    turns = range(1, work.turns + 1)
    head = (
        "| target | cached / prompt, turns >= 2 | of the reusable maximum | turns below 50 % "
        "| prompt tokens evaluated | " + " | ".join(f"TTFT turn {k} (ms)" for k in turns) + " |"
    )
    lines = [
        f"{work.conversations} conversations x {work.turns} turns at concurrency {work.concurrency}: "
        f"a shared system prompt of ~{work.system_tokens} tokens, user turns of ~{work.user_tokens}, "
        f"answers of {work.answer_tokens} tokens (greedy, ignore_eos).",
        "",
        head,
        "|" + "---|" * (5 + work.turns),
    ]
    for r in results:
        s = r.summary()
        ttft = s["ttft_median_ms_by_turn"]
        lines.append(
            f"| {r.target} | {s['cached_share']:.2f} (max {s['reusable_share']:.2f}) | "
            f"{100 * s['of_reusable']:.0f} % | {s['turns_below_half']} of {s['later_turns']} | "
            f"{s['prompt_tokens_evaluated']:,} | "
            + " | ".join(f"{ttft.get(k, 0):,.0f}" for k in turns)
            + " |"
        )
    tiers = [r for r in results if r.tier]
    if tiers:
        lines += [
            "",
            "| target | saves | saved | ms/MiB waited | ms/MiB child | restores | restored | ms/MiB waited"
            " | ms/MiB child | misses |",
        ]
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in tiers:
            lines.append(f"| {r.target} | " + tier_cells(r.tier or {}) + " |")
    events = [r for r in results if r.event is not None]
    if events:
        lines += ["", "| target | event | turn after it: of its reusable maximum |", "|---|---|---:|"]
        for r in events:
            s = r.summary()
            lines.append(f"| {r.target} | {r.event} | {100 * s['after_event_of_reusable']:.0f} % |")
    handed = [r for r in results if r.moved is not None]
    if handed:
        lines += [
            "",
            "| target | conversations moved | moved: of the reusable maximum"
            " | stayed: of the reusable maximum |",
            "|---|---:|---:|---:|",
        ]
        for r in handed:
            s = r.summary()
            lines.append(
                f"| {r.target} | {s['moved_conversations']} of {work.conversations} | "
                f"{100 * s['moved_of_reusable']:.1f} % | {100 * s['stayed_of_reusable']:.1f} % |"
            )
    lines += ["", *notes]
    return "\n".join(lines) + "\n"


def tier_cells(t: dict[str, float]) -> str:
    """A tier's figures as table cells: counts, MiB, and milliseconds per MiB: as the turn waited (the
    child's queue, its write or read, our hash and rename) and the child's own (its loop, so its other
    slots, wait that long)."""
    mib = 2**20

    def per_mib(seconds: float, nbytes: float) -> str:
        return f"{1000 * seconds / (nbytes / mib):.1f}" if nbytes else "-"

    return " | ".join(
        (
            f"{t.get('saves', 0):.0f}",
            f"{t.get('save_bytes', 0) / mib:,.0f} MiB",
            per_mib(t.get("save_seconds", 0), t.get("save_bytes", 0)),
            per_mib(t.get("save_child_seconds", 0), t.get("save_bytes", 0)),
            f"{t.get('restores', 0):.0f}",
            f"{t.get('restore_bytes', 0) / mib:,.0f} MiB",
            per_mib(t.get("restore_seconds", 0), t.get("restore_bytes", 0)),
            per_mib(t.get("restore_child_seconds", 0), t.get("restore_bytes", 0)),
            f"{t.get('misses', 0):.0f}",
        )
    )


def to_dict(results: Sequence[TargetResult], work: Workload) -> dict[str, Any]:
    return {
        "workload": asdict(work),
        "targets": [{**r.summary(), "turns": [asdict(t) for t in r.turns]} for r in results],
    }
