"""``python -m tests.benchmarks.loop_cost``: how long one request's costly values hold llama-server's server
loop, per unit, on the pinned server with the demo model: the figures ``proxy/schema/costs.py`` declares
and the door's default bounds are computed from (docs/security.md, "What a value costs the server loop").

llama-server runs every slot on one thread; a request's setup (sampler chain, DRY's breaker table, logit
biases, grammar) runs there, and while it runs no slot makes progress. ``/health`` is answered without the
loop, ``GET /slots`` through it (a ``SLOT_GET`` task the loop serves between batches): so a probe thread
sends ``/slots`` back to back while each request runs, and the longest a probe waited is how long the
loop was held (a probe that arrives as the hold starts waits all of it). Work done in an HTTP thread
(``/tokenize``, a chat template, a JSON schema turned into a grammar) leaves the probes fast: its cost
shows in the request's wall time instead, and the table prints both.

Each value is sent at a few sizes to a bare llama-server (the argv llamagate gives its child, 2 slots);
the cost per unit is the slope, by least squares, of the held time and of the request's time over the
units (stop strings and ``n_probs`` cost at each generated token: their held time is one token step);
per character of the bounded field's JSON text by the time where the cost table says it is held (loop
or HTTP thread); where the cost scales with the vocabulary (DRY), also per vocabulary token. The wall
times include the machine's noise (another process's turn): on a busy host, run it twice.
About two minutes on 2 cores. Writes nothing; prints the table and the per-unit figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from proxy.schema.costs import COSTS
from supervisor.bench.launcher import BareServer, start_llama_server
from supervisor.progress import ConsoleProgress
from tests.benchmarks import cli

# A special token of the demo model's vocabulary (SmolLM2's chat template).
SPECIAL = "<|im_start|>"
TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Case:
    """One costly value: ``body(units)`` is the request, ``per_token``: its cost is paid at every
    generated token (``tokens`` of them), not once at setup."""

    name: str
    cost: str  # the cost table's entry (proxy/schema/costs.py), or "-": measured, found cheap
    unit: str
    path: str
    field: str  # the body field whose size the door bounds (its JSON text's characters are printed)
    sizes: tuple[int, ...]
    body: Callable[[int, int], dict[str, Any]]  # (units, n_vocab) -> body
    per_vocab: bool = False
    per_token: int = 0


def _completion(extra: dict[str, Any], n_predict: int = 1) -> dict[str, Any]:
    return {"prompt": "Hello", "n_predict": n_predict, "cache_prompt": False, "temperature": 0, **extra}


def _tools(n: int) -> list[dict[str, Any]]:
    params = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": params}} for i in range(n)]


def _grammar_alternatives(n: int) -> str:
    return "root ::= " + " | ".join(f'"w{i}"' for i in range(n)) + "\n"


def _grammar_rules(n: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1} | "y"\n' for i in range(n)) + f'r{n} ::= "z"\n'


GENERATED = 16

CASES: tuple[Case, ...] = (
    Case(
        "DRY sequence breakers",
        "dry_breaker",
        "breaker",
        "/completion",
        "dry_sequence_breakers",
        (8, 16, 32, 48),
        lambda n, v: _completion(
            {"dry_multiplier": 0.8, "dry_sequence_breakers": [f"b{i}" for i in range(n)]}
        ),
        per_vocab=True,
    ),
    Case(
        "logit_bias entries (token ids)",
        "logit_bias_entry",
        "entry",
        "/completion",
        "logit_bias",
        (1000, 12000, 49152),
        lambda n, v: _completion({"logit_bias": [[i % v, -1.0] for i in range(n)]}, GENERATED),
    ),
    Case(
        "logit_bias entries (text)",
        "logit_bias_entry",
        "entry",
        "/completion",
        "logit_bias",
        (500, 2000, 8000),
        lambda n, v: _completion({"logit_bias": [[f"word{i}", -1.0] for i in range(n)]}),
    ),
    Case(
        "stop strings",
        "-",
        "stop string",
        "/completion",
        "stop",
        (10, 1000, 4000),
        lambda n, v: _completion({"stop": [f"never-{i}" for i in range(n)], "ignore_eos": True}, GENERATED),
        per_token=GENERATED,
    ),
    Case(
        "n_probs",
        "-",
        "probability",
        "/completion",
        "n_probs",
        (1, 1000, 10000),
        lambda n, v: _completion({"n_probs": n, "ignore_eos": True}, GENERATED),
        per_token=GENERATED,
    ),
    Case(
        "tools",
        "-",
        "tool",
        "/v1/chat/completions",
        "tools",
        (4, 32, 128),
        lambda n, v: {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "tools": _tools(n),
            "tool_choice": "required",
            "cache_prompt": False,
        },
    ),
    Case(
        "/tokenize special tokens",
        "tokenize_char",
        "character",
        "/tokenize",
        "content",
        (20000, 80000, 240000),
        lambda n, v: {"content": SPECIAL * (n // len(SPECIAL)), "parse_special": True},
    ),
    Case(
        "json_schema enum members",
        "json_schema_char",
        "member",
        "/completion",
        "json_schema",
        (500, 2000, 4000),
        lambda n, v: _completion({"json_schema": {"enum": [f"value{i}" for i in range(n)]}}),
    ),
    Case(
        "grammar alternatives",
        "grammar_char",
        "alternative",
        "/completion",
        "grammar",
        (500, 1000, 3000),
        lambda n, v: _completion({"grammar": _grammar_alternatives(n)}),
    ),
    Case(
        "grammar rules",
        "grammar_char",
        "rule",
        "/completion",
        "grammar",
        (200, 1000, 3000),
        lambda n, v: _completion({"grammar": _grammar_rules(n)}),
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--binary", type=Path, help="llama-server (default: built from the lock)")
    parser.add_argument("--model", type=Path, help="GGUF model (default: the demo model)")
    parser.add_argument("--only", help="comma list of case names' first words (e.g. DRY,stop)")
    parser.add_argument("--repeat", type=int, default=1, help="repetitions of each size (the median)")


class Probe:
    """``GET /slots`` back to back on its own connection; ``longest(since)`` is the longest a probe took
    among those sent after ``since`` (the loop's longest hold, plus a probe's own few milliseconds)."""

    def __init__(self, server: BareServer) -> None:
        headers = {"Authorization": f"Bearer {server.target.api_key}"}
        self._client = httpx.Client(base_url=server.target.base_url, headers=headers, timeout=TIMEOUT_S)
        self._spans: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Probe:
        self._client.get("/slots").raise_for_status()  # the endpoint exists (no --no-slots)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            self._client.get("/slots")
            with self._lock:
                self._spans.append((start, time.monotonic()))
            time.sleep(0.002)

    def longest(self, since: float, until: float) -> float:
        with self._lock:
            spans = [(a, b) for a, b in self._spans if b >= since and a <= until]
        return max((b - a for a, b in spans), default=0.0)


@dataclass
class Row:
    case: Case
    units: int
    chars: int  # of the bounded field's JSON text
    wall_s: float
    held_s: float
    status: int


def _send(client: httpx.Client, probe: Probe, path: str, body: dict[str, Any]) -> tuple[float, float, int]:
    raw = json.dumps(body).encode()
    started = time.monotonic()
    answer = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    ended = time.monotonic()
    time.sleep(0.02)  # the probe in flight at the end reports
    return ended - started, probe.longest(started, ended), answer.status_code


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares seconds per unit (through the points, not the origin: a fixed cost stays out)."""
    if len(points) < 2:
        return points[0][1] / points[0][0] if points else float("nan")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")


@contextmanager
def _server(args: argparse.Namespace) -> Iterator[BareServer]:
    llama: dict[str, Any] = {"slots": 2, "ctx_per_slot": 2048}
    if args.binary is not None:
        llama["binary"] = str(args.binary.resolve())
    if args.model is not None:
        from supervisor.artifacts.files import sha256_file

        llama["model"] = {"path": str(args.model.resolve()), "sha256": sha256_file(args.model)}
    with tempfile.TemporaryDirectory(prefix="llamagate-bench-loop-") as folder:
        server, _ = start_llama_server({"llama": llama}, Path(folder), progress=ConsoleProgress())
        try:
            yield server
        finally:
            server.stop()


def handle(args: argparse.Namespace) -> int:
    only = [w.strip().lower() for w in args.only.split(",")] if args.only else []
    cases = [c for c in CASES if not only or c.name.split()[0].lower().strip("/") in only]
    with _server(args) as server:
        headers = {"Authorization": f"Bearer {server.target.api_key}"}
        with httpx.Client(base_url=server.target.base_url, headers=headers, timeout=TIMEOUT_S) as client:
            models = client.get("/v1/models").json()
            n_vocab = int(models["data"][0]["meta"]["n_vocab"])
            with Probe(server) as probe:
                base_wall, base_held, _ = _send(client, probe, "/completion", _completion({}, GENERATED))
                rows: list[Row] = []
                for case in cases:
                    for units in case.sizes:
                        runs = [
                            _send(client, probe, case.path, case.body(units, n_vocab))
                            for _ in range(args.repeat)
                        ]
                        wall = statistics.median(r[0] for r in runs)
                        held = statistics.median(r[1] for r in runs)
                        body = case.body(units, n_vocab)
                        chars = len(
                            json.dumps(body.get(case.field), ensure_ascii=False, separators=(",", ":"))
                        )
                        rows.append(Row(case, units, chars, wall, held, runs[-1][2]))
                        print(
                            f"  {case.name}: {units} -> {runs[-1][2]}, wall {wall:.3f} s, held {held:.3f} s",
                            flush=True,
                        )
    _print(rows, n_vocab, base_wall, base_held)
    return 0


def _print(rows: list[Row], n_vocab: int, base_wall: float, base_held: float) -> None:
    print(f"\nllama-server loop cost, demo model ({n_vocab:,} tokens of vocabulary); baseline /completion of")
    print(f"{GENERATED} tokens: wall {base_wall:.3f} s, longest /slots probe {base_held * 1000:.1f} ms\n")
    print("| value | units | characters | status | wall s | loop held s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = (
            r.case.name,
            f"{r.units:,}",
            f"{r.chars:,}",
            str(r.status),
            f"{r.wall_s:.3f}",
            f"{r.held_s:.3f}",
        )
        print("| " + " | ".join(cells) + " |")
    head = ("value", "cost entry", "held s per unit", "wall s per unit", "s per character", "per vocab token")
    print("\n| " + " | ".join(head) + " |")
    print("|---|---|---:|---:|---:|---:|")
    for case in dict.fromkeys(r.case for r in rows):
        mine = [r for r in rows if r.case is case and r.status == 200]
        # The loop held (at setup, or for stop strings and n_probs at each token step: the longest probe
        # is one hold), and the request's own time (work in an HTTP thread shows only there).
        held = _slope([(r.units, r.held_s) for r in mine])
        wall = _slope([(r.units, r.wall_s) for r in mine])
        entry = COSTS.get(case.cost)
        key = "wall_s" if entry is not None and entry.where == "http" else "held_s"
        per_char = _slope([(r.chars, getattr(r, key)) for r in mine])
        vocab = f"{held / n_vocab:.3g}" if case.per_vocab else "-"
        cells = (
            f"{case.name} ({case.unit})",
            case.cost,
            f"{held:.3g}",
            f"{wall:.3g}",
            f"{per_char:.3g}",
            vocab,
        )
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(cli.run("loop_cost", __doc__, add_arguments, handle))
