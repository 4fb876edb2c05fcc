"""``kv-reuse``: the same greedy answer of N tokens made two ways, to show what the KV cache saves.

- **reused**: one ``/completion`` request decoding N tokens. llama-server keeps every token's keys and
  values (the KV cache), so each step computes only the new token: the work per answer grows as N (plus
  attention over the cache, small at these lengths).
- **recomputed**: N requests of one token each, the prompt plus every token generated so far as the
  prompt, with ``cache_prompt: false``: each step recomputes the whole state from nothing, N evaluations
  of 1 + 2 + ... tokens, so the work per answer grows as N^2/2.

Both ask at temperature 0 with a fixed seed and ``ignore_eos`` (every answer has exactly N tokens), as
token ids (the text is tokenized once, by the server, so nothing is re-tokenized differently between
steps), on a server with one slot. Recorded per answer: the client's wall time (first request sent to
last answer read), the CPU time llama-server spent on it, llama-server's own prompt and decode
milliseconds, the tokens it evaluated and the tokens it took from its cache (0 for every recomputed step:
nothing was reused), and whether both ways gave the same tokens (by sha256 of the ids, never the text).
Then the growth with N of each of three medians (``growth``: linear against quadratic, and the
log-log exponent): wall seconds, CPU seconds and tokens evaluated.

Why three: the tokens evaluated are the work itself, exact and the same on any host; wall time is what a
client waits, and on a shared host it follows the other jobs' load as much as the work (a recorded run
on 2 cores at load 6 to 9 saw one recomputed step take 0.45 s or 6 s for the same context); the server's
CPU time is that work as this host's CPU does it, inflated less than the wall time by other jobs but
still inflated: while one of llama-server's threads is preempted the other spins at the next barrier
(measured: a 2-thread child spent 3 times the CPU per token at load 8 that it spent at load 4). Only the
tokens are the same on any host. With ``repeats`` above 1 every other repeat walks the Ns in reverse
order, so a load that drifts during the run does not line up with N.

Greedy decoding of the same tokens is the same computation either way, but a prompt is evaluated in a
batch and a decode step one token at a time: the float sums differ in order, so on a near tie the two
ways may pick different tokens from some step on. The record says where they first differ; the times
compare the same amount of work either way.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from supervisor.bench.client import Target
from supervisor.bench.growth import Growth, growth
from supervisor.errors import LlamagateError
from supervisor.progress import NullProgress, Progress

PROMPT = (
    "Write a long story about a lighthouse keeper on a small island who finds a message in a bottle. "
    "Describe the island, the weather and the keeper's days in detail."
)
WAYS = ("reused", "recomputed")


# What each growth fit is of, by the key it has in ``KvReuseResult.growth`` and the record.
METRICS = {
    "seconds": "wall seconds per answer (client clock)",
    "cpu_seconds": "llama-server CPU seconds per answer",
    "tokens_evaluated": "tokens llama-server evaluated per answer",
}


class ExperimentFailed(LlamagateError):
    exit_code = 1


@dataclass(frozen=True)
class Answer:
    way: str  # "reused" or "recomputed"
    n: int
    repeat: int
    seconds: float  # client wall clock for the whole answer
    cpu_seconds: float | None  # llama-server's user + system CPU time during the answer
    requests: int
    prompt_ms: float  # llama-server's own, summed over the answer's requests
    decode_ms: float
    tokens_evaluated: int  # prompt tokens evaluated + tokens decoded, summed
    tokens_from_cache: int  # prompt tokens taken from the cache, summed
    answer_sha256: str  # of the generated ids, comma-separated
    step_ms: tuple[float, ...] = ()  # recomputed: wall ms of each step (the largest N only)


@dataclass
class KvReuseResult:
    ns: list[int]
    repeats: int
    prompt_tokens: int
    answers: list[Answer]
    same_answer: dict[int, int | None]  # per N: first step where the ways differ, None if never
    growth: dict[str, dict[str, Growth]]  # metric (METRICS) -> way -> growth of its median with N
    launched: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def median(self, way: str, n: int, metric: str = "seconds") -> float | None:
        values = [getattr(a, metric) for a in self.answers if a.way == way and a.n == n]
        known = [float(v) for v in values if v is not None]
        return statistics.median(known) if known else None

    def median_seconds(self, way: str, n: int) -> float:
        return statistics.median(a.seconds for a in self.answers if a.way == way and a.n == n)

    def first(self, way: str, n: int) -> Answer:
        return next(a for a in self.answers if a.way == way and a.n == n)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "llamagate.bench.kv-reuse/1",
            "ns": self.ns,
            "repeats": self.repeats,
            "prompt_tokens": self.prompt_tokens,
            "medians": {
                metric: {w: {str(n): self.median(w, n, metric) for n in self.ns} for w in WAYS}
                for metric in METRICS
            },
            "first_difference_step": {str(n): v for n, v in self.same_answer.items()},
            "growth": {
                metric: {"of": METRICS[metric], **{w: g.to_dict() for w, g in by_way.items()}}
                for metric, by_way in self.growth.items()
            },
            "answers": [{**asdict(a), "step_ms": list(a.step_ms)} for a in self.answers],
            "launched": self.launched,
            "notes": self.notes,
            "extra": self.extra,
        }


class _Server:
    """The few llama-server routes the experiment needs, on one keep-alive connection."""

    def __init__(
        self, target: Target, timeout_s: float, seed: int, transport: httpx.BaseTransport | None
    ) -> None:
        self.target = target
        self.seed = seed
        self.client = httpx.Client(
            timeout=timeout_s, trust_env=False, headers=target.headers(), transport=transport
        )

    def close(self) -> None:
        self.client.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self.client.post(self.target.server_root + path, json=body)
        except httpx.HTTPError as exc:
            raise ExperimentFailed(f"POST {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise ExperimentFailed(f"POST {path}: HTTP {response.status_code}: {response.text[:300]}")
        data = response.json()
        if not isinstance(data, dict):
            raise ExperimentFailed(f"POST {path}: expected a JSON object")
        return data

    def tokenize(self, text: str) -> list[int]:
        tokens = self._post("/tokenize", {"content": text, "add_special": True}).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ExperimentFailed("/tokenize: no token ids in the answer")
        return tokens

    def complete(self, prompt: Sequence[int], n: int) -> tuple[list[int], dict[str, Any]]:
        data = self._post(
            "/completion",
            {
                "prompt": list(prompt),
                "n_predict": n,
                "temperature": 0.0,
                "seed": self.seed,
                "ignore_eos": True,
                "cache_prompt": False,
                "return_tokens": True,
                "stream": False,
            },
        )
        tokens = data.get("tokens")
        timings = data.get("timings")
        if not isinstance(tokens, list) or len(tokens) != n or not isinstance(timings, dict):
            got = len(tokens) if isinstance(tokens, list) else "no"
            raise ExperimentFailed(f"/completion: asked for {n} tokens, got {got} (and timings: {timings!r})")
        return [int(t) for t in tokens], timings


def _sha(ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def _num(timings: dict[str, Any], key: str) -> float:
    value = timings.get(key)
    return float(value) if isinstance(value, int | float) else 0.0


CpuClock = Callable[[], float | None]


def _spent(cpu: CpuClock, before: float | None) -> float | None:
    after = cpu()
    return None if before is None or after is None else round(after - before, 3)


def _reused(
    server: _Server, prompt: list[int], n: int, repeat: int, cpu: CpuClock
) -> tuple[Answer, list[int]]:
    cpu_before = cpu()
    started = time.monotonic()
    ids, t = server.complete(prompt, n)
    seconds = time.monotonic() - started
    answer = Answer(
        way="reused",
        n=n,
        repeat=repeat,
        seconds=seconds,
        cpu_seconds=_spent(cpu, cpu_before),
        requests=1,
        prompt_ms=_num(t, "prompt_ms"),
        decode_ms=_num(t, "predicted_ms"),
        tokens_evaluated=int(_num(t, "prompt_n") + _num(t, "predicted_n")),
        tokens_from_cache=int(_num(t, "cache_n")),
        answer_sha256=_sha(ids),
    )
    return answer, ids


def _recomputed(
    server: _Server,
    prompt: list[int],
    n: int,
    repeat: int,
    keep_steps: bool,
    progress: Progress,
    cpu: CpuClock,
) -> tuple[Answer, list[int]]:
    ids: list[int] = []
    prompt_ms = decode_ms = 0.0
    evaluated = cached = 0
    steps: list[float] = []
    cpu_before = cpu()
    started = time.monotonic()
    for step in range(n):
        t0 = time.monotonic()
        (token,), t = server.complete([*prompt, *ids], 1)
        steps.append((time.monotonic() - t0) * 1000.0)
        ids.append(token)
        prompt_ms += _num(t, "prompt_ms")
        decode_ms += _num(t, "predicted_ms")
        evaluated += int(_num(t, "prompt_n") + _num(t, "predicted_n"))
        cached += int(_num(t, "cache_n"))
        if step % 8 == 0:
            progress.update("kv-reuse", (step + 1) / n, f"recomputed N={n}: step {step + 1}/{n}")
    seconds = time.monotonic() - started
    answer = Answer(
        way="recomputed",
        n=n,
        repeat=repeat,
        seconds=seconds,
        cpu_seconds=_spent(cpu, cpu_before),
        requests=n,
        prompt_ms=prompt_ms,
        decode_ms=decode_ms,
        tokens_evaluated=evaluated,
        tokens_from_cache=cached,
        answer_sha256=_sha(ids),
        step_ms=tuple(round(s, 2) for s in steps) if keep_steps else (),
    )
    return answer, ids


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return i + 1
    return None


def run(
    target: Target,
    ns: Sequence[int],
    *,
    repeats: int = 1,
    seed: int = 0,
    timeout_s: float = 600.0,
    progress: Progress | None = None,
    transport: httpx.BaseTransport | None = None,
    cpu: CpuClock | None = None,
) -> KvReuseResult:
    """Both ways at every N, ``repeats`` times (odd repeats walk N downwards); the ways take turns
    going first. ``cpu``: the server's cumulative CPU seconds (``rss.cpu_seconds`` of its pid)."""
    progress = progress or NullProgress()
    clock: CpuClock = cpu or (lambda: None)
    ns = sorted(set(ns))
    server = _Server(target, timeout_s, seed, transport)
    try:
        prompt = server.tokenize(PROMPT)
        # Warm-up (not recorded): the first requests pay for page faults and buffer allocation.
        server.complete(prompt, 4)
        server.complete(prompt, 1)
        answers: list[Answer] = []
        same: dict[int, int | None] = {}
        for repeat in range(repeats):
            for i, n in enumerate(ns if repeat % 2 == 0 else ns[::-1]):
                progress.update("kv-reuse", None, f"N={n} (repeat {repeat + 1}/{repeats})")
                keep = n == ns[-1] and repeat == 0
                pair: dict[str, tuple[Answer, list[int]]] = {}
                order = WAYS if (repeat + i) % 2 == 0 else WAYS[::-1]
                for way in order:
                    if way == "reused":
                        pair[way] = _reused(server, prompt, n, repeat, clock)
                    else:
                        pair[way] = _recomputed(server, prompt, n, repeat, keep, progress, clock)
                answers += [pair[w][0] for w in WAYS]
                if repeat == 0:
                    same[n] = _first_difference(pair["reused"][1], pair["recomputed"][1])
    finally:
        server.close()
    progress.done("kv-reuse", f"{len(answers)} answers")
    result = KvReuseResult(list(ns), repeats, len(prompt), answers, same, {})
    for metric in METRICS:
        by_way: dict[str, Growth] = {}
        for way in WAYS:
            medians = [(float(n), result.median(way, n, metric)) for n in ns]
            known = [(n, m) for n, m in medians if m is not None]
            if known:
                by_way[way] = growth([n for n, _ in known], [m for _, m in known])
        if by_way:
            result.growth[metric] = by_way
    return result


def markdown(result: KvReuseResult) -> str:
    lines = [
        "# Experiment: kv-reuse",
        "",
        f"The same greedy answer of N tokens after a {result.prompt_tokens}-token prompt; median of "
        f"{result.repeats} run(s) per point. *reused*: one request decoding N tokens (the KV cache keeps "
        "the attention state); *recomputed*: N one-token requests, each with the whole text so far as "
        "its prompt and `cache_prompt: false` (the state recomputed every step). Wall seconds on the "
        "client's clock, llama-server's CPU seconds, and the tokens it evaluated and took from its "
        "cache (llama-server's own counts, the first answer of each point).",
        "",
        "| N | wall s, reused | wall s, recomputed | recomputed / reused | CPU s, reused "
        "| CPU s, recomputed | recomputed / reused | tokens evaluated, reused "
        "| tokens evaluated, recomputed | from cache, recomputed | same answer |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for n in result.ns:
        a, b = result.median("reused", n), result.median("recomputed", n)
        ca, cb = result.median("reused", n, "cpu_seconds"), result.median("recomputed", n, "cpu_seconds")
        ra, rb = result.first("reused", n), result.first("recomputed", n)
        diff = result.same_answer.get(n)
        same = "yes" if diff is None else f"no: from token {diff}"
        lines.append(
            f"| {n} | {_f(a)} | {_f(b)} | {_ratio(b, a)} | {_f(ca)} | {_f(cb)} | {_ratio(cb, ca)} "
            f"| {ra.tokens_evaluated} | {rb.tokens_evaluated} | {rb.tokens_from_cache} | {same} |"
        )
    lines += ["", "Growth with N (least squares on the medians):", ""]
    lines += [
        "| of | way | a*N + b | R^2 | a*N^2 + b*N + c | R^2 | N^2 share at max N | log-log exponent | fits |"
    ]
    lines += ["|---|---|---|---:|---|---:|---:|---:|---|"]
    rule = ""
    for metric, by_way in result.growth.items():
        for way, g in by_way.items():
            lines.append(_growth_row(METRICS[metric], way, g))
            rule = g.to_dict()["rule"]
    lines += ["", f"Rule: {rule}."]
    lines += [f"- {note}" for note in result.notes]
    return "\n".join(lines) + "\n"


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.1f}x"


def _growth_row(of: str, way: str, g: Growth) -> str:
    def r2(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    lin = "-" if g.linear is None else "{:.4g}*N + {:.3g}".format(*g.linear.coefficients)
    quad = "-" if g.quadratic is None else "{:.3g}*N^2 + {:.3g}*N + {:.3g}".format(*g.quadratic.coefficients)
    share = "-" if g.quadratic_share is None else f"{g.quadratic_share:.0%}"
    exp = "-" if g.exponent is None else f"{g.exponent:.2f}"
    return (
        f"| {of} | {way} | {lin} | {r2(g.linear.r_squared if g.linear else None)} | {quad} "
        f"| {r2(g.quadratic.r_squared if g.quadratic else None)} | {share} | {exp} | **{g.verdict}** |"
    )
