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
last answer read), llama-server's own prompt and decode milliseconds, the tokens it evaluated and the
tokens it took from its cache (0 for every recomputed step: nothing was reused), and whether both ways
gave the same tokens (by sha256 of the ids, never the text). Then the growth of the median time per
answer with N (``growth``: linear against quadratic, and the log-log exponent).

Greedy decoding of the same tokens is the same computation either way, but a prompt is evaluated in a
batch and a decode step one token at a time: the float sums differ in order, so on a near tie the two
ways may pick different tokens from some step on. The record says where they first differ; the times
compare the same amount of work either way.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Sequence
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


class ExperimentFailed(LlamagateError):
    exit_code = 1


@dataclass(frozen=True)
class Answer:
    way: str  # "reused" or "recomputed"
    n: int
    repeat: int
    seconds: float  # client wall clock for the whole answer
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
    growth: dict[str, Growth]
    launched: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

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
            "median_seconds": {w: {str(n): self.median_seconds(w, n) for n in self.ns} for w in WAYS},
            "first_difference_step": {str(n): v for n, v in self.same_answer.items()},
            "growth": {w: g.to_dict() for w, g in self.growth.items()},
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


def _reused(server: _Server, prompt: list[int], n: int, repeat: int) -> tuple[Answer, list[int]]:
    started = time.monotonic()
    ids, t = server.complete(prompt, n)
    seconds = time.monotonic() - started
    answer = Answer(
        "reused",
        n,
        repeat,
        seconds,
        1,
        _num(t, "prompt_ms"),
        _num(t, "predicted_ms"),
        int(_num(t, "prompt_n") + _num(t, "predicted_n")),
        int(_num(t, "cache_n")),
        _sha(ids),
    )
    return answer, ids


def _recomputed(
    server: _Server, prompt: list[int], n: int, repeat: int, keep_steps: bool, progress: Progress
) -> tuple[Answer, list[int]]:
    ids: list[int] = []
    prompt_ms = decode_ms = 0.0
    evaluated = cached = 0
    steps: list[float] = []
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
    kept = tuple(round(s, 2) for s in steps) if keep_steps else ()
    answer = Answer(
        "recomputed", n, repeat, seconds, n, prompt_ms, decode_ms, evaluated, cached, _sha(ids), kept
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
) -> KvReuseResult:
    """Both ways at every N (ascending), ``repeats`` times; ways alternate which goes first."""
    progress = progress or NullProgress()
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
            for i, n in enumerate(ns):
                progress.update("kv-reuse", None, f"N={n} (repeat {repeat + 1}/{repeats})")
                keep = n == ns[-1] and repeat == 0
                pair: dict[str, tuple[Answer, list[int]]] = {}
                order = WAYS if (repeat + i) % 2 == 0 else WAYS[::-1]
                for way in order:
                    if way == "reused":
                        pair[way] = _reused(server, prompt, n, repeat)
                    else:
                        pair[way] = _recomputed(server, prompt, n, repeat, keep, progress)
                answers += [pair[w][0] for w in WAYS]
                if repeat == 0:
                    same[n] = _first_difference(pair["reused"][1], pair["recomputed"][1])
    finally:
        server.close()
    progress.done("kv-reuse", f"{len(answers)} answers")
    result = KvReuseResult(list(ns), repeats, len(prompt), answers, same, {})
    for way in WAYS:
        result.growth[way] = growth([float(n) for n in ns], [result.median_seconds(way, n) for n in ns])
    return result


def markdown(result: KvReuseResult) -> str:
    lines = [
        "# Experiment: kv-reuse",
        "",
        f"The same greedy answer of N tokens after a {result.prompt_tokens}-token prompt; median of "
        f"{result.repeats} run(s) per point. *reused*: one request decoding N tokens (the KV cache keeps "
        "the attention state); *recomputed*: N one-token requests, each with the whole text so far as "
        "its prompt and `cache_prompt: false` (the state recomputed every step). Seconds per answer on "
        "the client's clock; llama-server's own prompt + decode time beside it (the first answer of "
        "each point).",
        "",
        "| N | reused s/answer | recomputed s/answer | recomputed / reused | llama-server s, reused "
        "| llama-server s, recomputed | tokens evaluated, reused | tokens evaluated, recomputed "
        "| from cache, recomputed | same answer |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for n in result.ns:
        a, b = result.median_seconds("reused", n), result.median_seconds("recomputed", n)
        ra, rb = result.first("reused", n), result.first("recomputed", n)
        diff = result.same_answer.get(n)
        same = "yes" if diff is None else f"no: from token {diff}"
        lines.append(
            f"| {n} | {a:.3f} | {b:.3f} | {b / a:.1f}x | {(ra.prompt_ms + ra.decode_ms) / 1000:.3f} "
            f"| {(rb.prompt_ms + rb.decode_ms) / 1000:.3f} | {ra.tokens_evaluated} | {rb.tokens_evaluated} "
            f"| {rb.tokens_from_cache} | {same} |"
        )
    lines += ["", "Growth of the time per answer with N (least squares on the medians):", ""]
    lines += [
        "| way | a*N + b | R^2 | a*N^2 + b*N + c | R^2 | N^2 share at max N | log-log exponent | fits |"
    ]
    lines += ["|---|---|---:|---|---:|---:|---:|---|"]
    for way in WAYS:
        lines.append(_growth_row(way, result.growth[way]))
    lines += ["", f"Rule: {result.growth['reused'].to_dict()['rule']}."]
    lines += [f"- {note}" for note in result.notes]
    return "\n".join(lines) + "\n"


def _growth_row(way: str, g: Growth) -> str:
    def r2(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    lin = "-" if g.linear is None else "{:.4g}*N + {:.3g}".format(*g.linear.coefficients)
    quad = "-" if g.quadratic is None else "{:.3g}*N^2 + {:.3g}*N + {:.3g}".format(*g.quadratic.coefficients)
    share = "-" if g.quadratic_share is None else f"{g.quadratic_share:.0%}"
    exp = "-" if g.exponent is None else f"{g.exponent:.2f}"
    return (
        f"| {way} | {lin} | {r2(g.linear.r_squared if g.linear else None)} | {quad} "
        f"| {r2(g.quadratic.r_squared if g.quadratic else None)} | {share} | {exp} | **{g.verdict}** |"
    )
