"""``llamagate bench experiment kv-reuse --tokens 16,32,64,128,256``: what reusing attention state saves.

Starts llama-server from the config (the embedded default unless ``--config``) with one slot and enough
context for the largest N, runs ``kv_reuse.run``, stops it, and writes ``kv-reuse.json``,
``kv-reuse.md``, ``chart.png`` and ``provenance.json`` (binary and model sha256, host, load average at
the start and the end) into the result folder. Exit 0 when every answer was measured, 1 when the server
failed a request, 2 on bad usage, 130 when interrupted (SIGTERM too: the server is stopped first).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from supervisor.bench import experiment_charts, hostload, kv_reuse, options
from supervisor.bench.commands.run import write_provenance
from supervisor.bench.commands.sweep import parse_values
from supervisor.bench.launcher import deep_merge, read_base_config, start_llama_server
from supervisor.bench.provenance import collect
from supervisor.bench.rss import cpu_seconds
from supervisor.errors import UsageError
from supervisor.interrupts import interruptible
from supervisor.progress import ConsoleProgress

MAX_TOKENS = 2048
# Room in the context for the prompt (kv_reuse.PROMPT is ~40 tokens) and the largest answer.
PROMPT_ROOM = 128


def _context_for(largest: int) -> int:
    return max(512, -(-(largest + PROMPT_ROOM) // 256) * 256)


def _handle(args: argparse.Namespace) -> int:
    ns = [int(v) for v in parse_values(args.tokens, "--tokens", integer=True)]
    if ns[-1] > MAX_TOKENS:
        raise UsageError(f"--tokens: {ns[-1]} is more than {MAX_TOKENS} (the recomputed way costs N^2)")
    if args.repeats < 1:
        raise UsageError("--repeats must be >= 1")
    if args.request_timeout <= 0:
        raise UsageError("--request-timeout must be > 0")
    config = deep_merge(
        read_base_config(args.config), {"llama": {"slots": 1, "ctx_per_slot": _context_for(ns[-1])}}
    )
    out = options.out_dir(args, "kv-reuse")
    progress = ConsoleProgress()
    launched, _ = start_llama_server(config, out / "server", progress=progress)
    try:
        write_provenance(
            out, collect(sys.argv, {"llama-server": launched.target}, {"identity": launched.identity})
        )
        pid = launched.server_pid()
        result = kv_reuse.run(
            launched.target,
            ns,
            repeats=args.repeats,
            seed=args.seed,
            timeout_s=args.request_timeout,
            progress=progress,
            cpu=lambda: cpu_seconds(pid),
        )
    finally:
        launched.stop()
    result.launched = launched.identity
    window = hostload.record_end(out)
    result.extra["load_average"] = window
    result.notes.append(f"host: {hostload.describe(window)}")
    title = f"KV cache reused or recomputed ({hostload.describe(window)})"
    chart = experiment_charts.write(result, out, title)
    (out / "kv-reuse.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    (out / "kv-reuse.md").write_text(kv_reuse.markdown(result), encoding="utf-8")
    print(kv_reuse.markdown(result))
    print(chart, file=sys.stderr)
    print(f"results: {out}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "kv-reuse",
        help="the same answer with the KV cache reused, and recomputed every token: O(N) against O(N^2)",
        description="For each N: one request decoding N tokens (attention state reused), and N one-token "
        "requests each sending the whole text so far with cache_prompt false (state recomputed every "
        "step); greedy, fixed seed, ignore_eos. Records time per answer against N and fits "
        "a*N + b against a*N^2 + b*N + c (and a log-log slope).",
    )
    p.add_argument("--tokens", required=True, metavar="LIST", help="answer lengths N, e.g. 16,32,64,128,256")
    p.add_argument("--repeats", type=int, default=1, help="answers per way and N; the median is fitted (1)")
    p.add_argument("--config", type=Path, help="llamagate config to start from (default: embedded)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (0; greedy anyway)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline per request in s (600)")
    options.add_output_options(p)
    p.set_defaults(func=interruptible(_handle))
