"""``python -m tests.benchmarks.loop_gap``: how long llama-server's server loop keeps the watchdog's probe
waiting during an honest long prefill, the figure ``supervision.loop_deadline_s`` must clear with margin.

Bare llama-server on llamagate's own argv (``build_argv``: the same slots, prompt cache and flags as a
supervised child), then for each run: one prompt of about ``--tokens`` tokens (a new one each run, so no
cache reuse) sent as ``POST /completion`` with one token to generate, while ``GET /slots`` (the
watchdog's probe: a task through the queue) is asked back to back. Reports the longest wait of one probe
and the longest gap between two answers, with the prefill's own time from the answer's ``timings``.
Prints one JSON object; nothing is asserted here (durations belong in benchmarks, not tests).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from supervisor.child.gate import HttpProbes, wait_health_200
from supervisor.child.spawn import RealOs, free_port
from supervisor.errors import UsageError
from supervisor.launch.flags import LaunchSpec, build_argv, build_env, new_secret
from supervisor.launch.knobs import LlamaKnobs
from tests.benchmarks import cli

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box"


async def _prompt(client: httpx.AsyncClient, url: str, auth: dict[str, str], tokens: int, run: int) -> str:
    """A prompt of about ``tokens`` tokens (counted by the child's own /tokenize), unique to ``run``."""
    words = WORDS.split()
    text = f"run {run}: " + " ".join(f"{words[i % len(words)]}{i % 97}" for i in range(tokens))
    while True:
        r = await client.post(f"{url}/tokenize", json={"content": text}, headers=auth, timeout=60)
        n = len(r.json()["tokens"])
        if n <= tokens:
            return text
        text = text[: int(len(text) * tokens / n * 0.98)]


async def _one_run(client: httpx.AsyncClient, url: str, auth: dict[str, str], prompt: str) -> dict[str, Any]:
    waits: list[float] = []
    answers: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            sent = time.monotonic()
            r = await client.get(f"{url}/slots", headers=auth, timeout=300)
            r.raise_for_status()
            now = time.monotonic()
            waits.append(now - sent)
            answers.append(now)
            await asyncio.sleep(0.01)

    prober = asyncio.create_task(probe())
    started = time.monotonic()
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0}
    r = await client.post(f"{url}/completion", json=body, headers=auth, timeout=3600)
    elapsed = time.monotonic() - started
    done.set()
    await prober
    timings = r.json().get("timings", {})
    gaps = [b - a for a, b in itertools.pairwise(answers)]
    return {
        "prompt_tokens": timings.get("prompt_n"),
        "prompt_ms": timings.get("prompt_ms"),
        "request_s": round(elapsed, 3),
        "probes": len(waits),
        "probe_wait_max_s": round(max(waits), 4),
        "answer_gap_max_s": round(max(gaps), 4) if gaps else None,
    }


async def measure(
    binary: Path, model: Path, threads: int, tokens: int, ctx: int, runs: int
) -> dict[str, Any]:
    port, secret = free_port(), new_secret()
    knobs = LlamaKnobs(threads=threads, threads_batch=threads, slots=2, ctx_per_slot=ctx)
    spec = LaunchSpec(binary, model, "bench", port, knobs)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {secret}"}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "config").mkdir()
        handle = await RealOs().spawn(build_argv(spec), build_env(secret, workdir, knobs), workdir)
        drain = asyncio.create_task(_drain(handle))
        probes = HttpProbes()
        try:
            await asyncio.wait_for(wait_health_200(probes, url), 300)
            async with httpx.AsyncClient(trust_env=False) as client:
                results = []
                for run in range(runs):
                    prompt = await _prompt(client, url, auth, tokens, run)
                    results.append(await _one_run(client, url, auth, prompt))
        finally:
            handle.send_signal(9)
            await handle.wait()
            drain.cancel()
            await probes.aclose()
    return {
        "model": model.name,
        "threads": threads,
        "ctx_per_slot": ctx,
        "runs": results,
        "probe_wait_max_s": max(r["probe_wait_max_s"] for r in results),
        "answer_gap_max_s": max((r["answer_gap_max_s"] or 0.0) for r in results),
    }


async def _drain(handle: Any) -> None:
    async for _ in handle.output():
        pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--binary", type=Path, required=True, help="the llama-server to measure")
    parser.add_argument("--model", type=Path, required=True, help="the GGUF file it serves")
    parser.add_argument("--threads", type=int, default=1, help="threads and prompt threads (1, as in tests)")
    parser.add_argument("--tokens", type=int, default=4000, help="prompt tokens per run (4000)")
    parser.add_argument("--ctx", type=int, default=8192, help="context per slot (8192)")
    parser.add_argument("--runs", type=int, default=3, help="prompts, one after the other (3)")


def handle(args: argparse.Namespace) -> int:
    if args.runs < 1 or args.tokens < 1:
        raise UsageError("--runs and --tokens must be >= 1")
    out = asyncio.run(measure(args.binary, args.model, args.threads, args.tokens, args.ctx, args.runs))
    print(json.dumps(out, indent=2))
    return 0


def main() -> int:
    return cli.run("loop_gap", __doc__, add_arguments, handle)


if __name__ == "__main__":
    sys.exit(main())
