"""``python -m tests.benchmarks.program_cost``: what a program inside a request string holds the pinned
child's server loop for (the bounds of ``proxy.schema.programs``; docs/security.md, "Programs inside
strings").

A bare pinned ``llama-server`` with the demo model (one slot), no llamagate in front. For each shape
(a GBNF grammar N parentheses deep, with N rules, N alternatives, a leftmost chain of N rules, N
elements; a JSON schema enum of N members, N optional properties, a ``$ref`` chain of N; a trigger
pattern), at a few sizes: one request generating 4 tokens is sent while another thread asks the
child's own ``GET /slots`` every 20 ms. ``/slots`` is answered by the server loop between batches, so
its slowest answer during the request is how long the loop was held; the request's own time is
beside it. Whether the door would pass the shape (``proxy.schema.programs``) is the last column.

It measures; it has no target. A few minutes on two cores. Exit status 0, or 2 on bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from proxy.schema.programs import ProgramError, measure_grammar, measure_regex, measure_schema
from supervisor.child.spawn import free_port
from supervisor.progress import ConsoleProgress
from tests.benchmarks import cli

REPO = Path(__file__).resolve().parents[2]
PROBE_EVERY_S = 0.02
REQUEST_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--binary", type=Path, help="llama-server (default: the locked build, cached)")
    parser.add_argument("--model", type=Path, help="GGUF model (default: the demo model, cached)")
    parser.add_argument("--quick", action="store_true", help="the smallest sizes only")


# --- the shapes ---------------------------------------------------------------------------------------


def _nesting(n: int) -> dict[str, Any]:
    return {"grammar": "root ::= " + "(" * n + '"a"' + ")" * n}


def _rules(n: int) -> dict[str, Any]:
    # root ::= r0; r_i ::= "a" r_{i+1}? : n named rules (and n synthesized for the ?).
    lines = ["root ::= r0"] + [f'r{i} ::= "a" r{i + 1}?' for i in range(n - 1)] + [f'r{n - 1} ::= "a"']
    return {"grammar": "\n".join(lines)}


def _alternatives(n: int) -> dict[str, Any]:
    return {"grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(n))}


def _chain(n: int) -> dict[str, Any]:
    lines = ["root ::= r0"] + [f'r{i} ::= r{i + 1} "a"' for i in range(n - 1)] + [f'r{n - 1} ::= "a"']
    return {"grammar": "\n".join(lines)}


def _elements(n: int) -> dict[str, Any]:
    # A literal of n/2000 characters repeated 2000 times: n elements after expansion.
    width = max(1, n // 2000)
    return {"grammar": 'root ::= "' + "a" * width + '"{0,2000}'}


def _left_steps(n: int) -> dict[str, Any]:
    # Each rule's two nullable references to the next: the left-recursion check takes 2^n steps.
    lines = ['root ::= a0 "x"'] + [f'a{i} ::= a{i + 1}? a{i + 1}? "y"' for i in range(n)] + [f'a{n} ::= "z"']
    return {"grammar": "\n".join(lines)}


def _enum(n: int) -> dict[str, Any]:
    return {"json_schema": {"enum": [f"value number {i}" for i in range(n)]}}


def _properties(n: int) -> dict[str, Any]:
    return {"json_schema": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}}


def _ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {
        f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"json_schema": {"$defs": defs, "$ref": "#/$defs/d0"}}


def _repetitions(n: int) -> dict[str, Any]:
    # n/1000 arrays, each up to 1000 items: the converter writes {0,999}, the parser makes 999 rules each.
    # (At 2000 the child refuses it itself: its own limit counts the group around them.)
    count = max(1, n // 1000)
    props = {f"a{i}": {"type": "array", "items": {"type": "integer"}, "maxItems": 1000} for i in range(count)}
    return {"json_schema": {"type": "object", "properties": props}}


def _trigger(n: int) -> dict[str, Any]:
    pattern = "(" * n + "x" + ")" * n
    return {
        "grammar": 'root ::= "a"',
        "grammar_lazy": True,
        "grammar_triggers": [{"type": 2, "value": pattern}],
    }


@dataclass(frozen=True)
class Shape:
    name: str
    make: Callable[[int], dict[str, Any]]
    sizes: tuple[int, ...]


SHAPES: tuple[Shape, ...] = (
    Shape("grammar: nesting depth", _nesting, (100, 999, 13_000)),
    Shape("grammar: rules", _rules, (500, 2000, 8000)),
    Shape("grammar: alternatives", _alternatives, (250, 500, 2000)),
    Shape("grammar: leftmost chain", _chain, (250, 1000, 3000)),
    Shape("grammar: elements", _elements, (20_000, 100_000, 1_000_000)),
    Shape("grammar: nullable chain 2^n", _left_steps, (6, 7, 9)),
    Shape("schema: enum members", _enum, (250, 500, 2000)),
    Shape("schema: optional properties", _properties, (50, 100, 300)),
    Shape("schema: $ref chain", _ref_chain, (8, 31, 128)),
    Shape("schema: repetitions", _repetitions, (2000, 10_000, 40_000)),
    Shape("trigger pattern: nesting", _trigger, (8, 32, 1000)),
)


def _door(body: dict[str, Any]) -> str:
    try:
        if "grammar_triggers" in body:
            for t in body["grammar_triggers"]:
                measure_regex(t["value"])
        elif "grammar" in body:
            measure_grammar(body["grammar"])
        if "json_schema" in body:
            measure_schema(body["json_schema"])
    except ProgramError as err:
        return f"400 ({err.what})"
    return "passes"


# --- the child ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _child(binary: Path, model: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "2048"]
    argv += ["-np", "1", "-ngl", "0", "-t", "2", "--no-ui"]
    with tempfile.TemporaryDirectory(prefix="program-cost-") as home:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home}
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {proc.returncode}")
                time.sleep(0.1)
            yield base, proc
        finally:
            proc.kill()
            proc.wait()


@dataclass
class Result:
    status: str
    wall_s: float
    held_s: float


def _measure(base: str, body: dict[str, Any]) -> Result:
    stop = threading.Event()
    slowest = [0.0]

    def probe() -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as c:
            while not stop.is_set():
                started = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    c.get(base + "/slots")
                slowest[0] = max(slowest[0], time.monotonic() - started)
                stop.wait(PROBE_EVERY_S)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    started = time.monotonic()
    try:
        r = httpx.post(
            base + "/completion",
            json={"prompt": "Say a", "n_predict": 4, "temperature": 0, **body},
            timeout=REQUEST_TIMEOUT_S,
        )
        status = str(r.status_code)
    except httpx.HTTPError as exc:
        status = f"no answer ({type(exc).__name__})"
    wall = time.monotonic() - started
    stop.set()
    prober.join()
    return Result(status, wall, slowest[0])


def handle(args: argparse.Namespace) -> int:
    binary, model = args.binary, args.model
    if binary is None:
        from supervisor.artifacts.build import ensure_binary

        binary = ensure_binary(REPO / "llama-build.lock", progress=ConsoleProgress()).path
    if model is None:
        from supervisor.artifacts.demo_model import ensure_demo_model

        model = ensure_demo_model(progress=ConsoleProgress())
    rows = []
    with _child(binary, model) as (base, proc):
        for shape in SHAPES:
            sizes = shape.sizes[:1] if args.quick else shape.sizes
            for n in sizes:
                body = shape.make(n)
                result = _measure(base, body)
                if proc.poll() is not None:
                    result.status = f"child died ({proc.returncode})"
                rows.append((shape.name, n, result, _door(body)))
                print(
                    f"| {shape.name} | {n:,} | {result.status} | {result.wall_s:.2f} | {result.held_s:.2f} |"
                    f" {_door(body)} |",
                    flush=True,
                )
                if proc.poll() is not None:
                    return 0
    return 0


def main() -> int:
    print("| shape | N | child's status | request s | loop held s | the door |")
    print("|---|---|---|---|---|---|")
    return cli.run("program_cost", __doc__, add_arguments, handle)


if __name__ == "__main__":
    raise SystemExit(main())
