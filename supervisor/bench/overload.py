"""The overload comparison in one run: the same loads straight to llama-server and through llamagate.

Both targets are started here from ONE config (same binary, model, threads, slots, context per slot;
the bare server gets exactly the argv llamagate gives its child) and stay up for the whole sweep, which
interleaves them point by point so a shared host's drift hits both alike. Only llamagate's admission
differs: one tenant whose concurrency equals the slot count, with a short (default: no) queue, so a
request beyond the slots is turned away at once with 429 and Retry-After instead of waiting inside
llama-server where nothing is sent while it waits.

The claim checked at the highest offered load: through llamagate the admitted requests meet the latency
gates, while straight to llama-server the same load does not.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.bench.launcher import (
    Launched,
    deep_merge,
    llamagate_overrides,
    start_llama_server,
    start_llamagate,
)
from supervisor.bench.loadgen import LoadSpec
from supervisor.bench.prompts import PromptSet
from supervisor.bench.provenance import collect
from supervisor.bench.report import fmt_ms
from supervisor.bench.runner import RequestOptions
from supervisor.bench.stats import Gates
from supervisor.bench.summary import Summary
from supervisor.bench.sweep import SweepResult, SweepSpec, sweep_async
from supervisor.progress import NullProgress, Progress

GATE = "llamagate"
DIRECT = "llama-server"


@dataclass(frozen=True)
class OverloadSpec:
    base_config: Mapping[str, Any]
    loads: Sequence[LoadSpec]
    prompts: PromptSet
    options: RequestOptions
    gates: Gates
    slots: int = 4
    admit: int | None = None  # llamagate tenant max_concurrency; None: the slot count
    ctx_per_slot: int | None = None  # None: the config's
    threads: int | None = None  # None: the config's
    max_queue: int = 0
    queue_timeout_s: float = 1.0
    recovery: bool = True
    pause_s: float = 2.0


@dataclass(frozen=True)
class Claim:
    load: str
    holds: bool
    gate_admitted_ok: bool
    gate_violations: int
    direct_admitted_ok: bool
    text: str


def server_config(spec: OverloadSpec) -> dict[str, Any]:
    llama: dict[str, Any] = {"slots": spec.slots}
    if spec.ctx_per_slot is not None:
        llama["ctx_per_slot"] = spec.ctx_per_slot
    if spec.threads is not None:
        llama["threads"] = spec.threads
        llama["threads_batch"] = spec.threads
    return deep_merge(spec.base_config, {"llama": llama})


def check_claim(result: SweepResult) -> Claim | None:
    by_name = {s.name: s for s in result.series}
    gate, direct = by_name.get(GATE), by_name.get(DIRECT)
    if gate is None or direct is None or not gate.points or not direct.points:
        return None
    g_load, g, _ = max(gate.points, key=lambda p: p[0].value)
    d = next(sm for load, sm, _ in direct.points if load.label == g_load.label)
    holds = g.verdict.admitted_ok and not d.verdict.admitted_ok
    text = (
        f"At {g_load.label}: through llamagate {g.completed} of {g.submitted} requests were admitted "
        f"({g.rejected} turned away with 429/503), admitted TTFT p95 {fmt_ms(g.ttft_ms.p95)} ms, "
        f"TPOT p95 {fmt_ms(g.tpot_ms.p95)} ms, {g.admitted_violations} admitted request(s) missed a gate; "
        f"straight to llama-server all {d.completed} of {d.submitted} were served, TTFT p95 "
        f"{fmt_ms(d.ttft_ms.p95)} ms, TPOT p95 {fmt_ms(d.tpot_ms.p95)} ms, {d.admitted_violations} missed a "
        f"gate. " + ("The claim holds." if holds else "The claim does NOT hold in this run.")
    )
    return Claim(
        g_load.label, holds, g.verdict.admitted_ok, g.admitted_violations, d.verdict.admitted_ok, text
    )


def _cell(s: Summary) -> str:
    return (
        f"{s.completed}/{s.submitted} | {fmt_ms(s.ttft_ms.p95)} | {fmt_ms(s.tpot_ms.p95)} "
        f"| {s.admitted_violations} | {s.goodput} ({(s.goodput_fraction or 0) * 100:.0f}%)"
    )


def comparison_markdown(result: SweepResult, claim: Claim | None) -> str:
    by_name = {s.name: s for s in result.series}
    gate, direct = by_name[GATE], by_name[DIRECT]
    direct_by = {load.label: sm for load, sm, _ in direct.points}
    lines = [
        "| load | llamagate admitted/submitted | TTFT p95 | TPOT p95 | missed a gate | goodput "
        "| llama-server served/submitted | TTFT p95 | TPOT p95 | missed a gate | goodput |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for load, g, _ in gate.points:
        d = direct_by.get(load.label)
        lines.append(f"| {load.label} | {_cell(g)} | " + (_cell(d) if d else "- | - | - | - | -") + " |")
    if claim is not None:
        lines += ["", claim.text]
    return "\n".join(lines) + "\n"


def _launch_record(launched: Launched) -> dict[str, Any]:
    return {
        "identity": launched.identity,
        "pid": launched.proc.pid,
        "rss_bytes_after_load": launched.rss_bytes(),
    }


async def _sweep(spec: SweepSpec, out: Path, progress: Progress) -> SweepResult:
    return await sweep_async(spec, out, progress)


def run_overload(
    spec: OverloadSpec, out_dir: Path, argv: Sequence[str], progress: Progress | None = None
) -> tuple[SweepResult, Claim | None]:
    progress = progress or NullProgress()
    config = server_config(spec)
    admit = spec.admit or spec.slots
    overrides, key = llamagate_overrides(admit, spec.max_queue, spec.queue_timeout_s)
    servers = out_dir / "servers"
    launched: list[Launched] = []
    try:
        direct, _ = start_llama_server(config, servers / DIRECT, progress=progress)
        launched.append(direct)
        gate = start_llamagate(deep_merge(config, overrides), key, servers / GATE, progress=progress)
        launched.append(gate)
        targets = {GATE: gate.target, DIRECT: direct.target}
        provenance = collect(argv, targets, {GATE: _launch_record(gate), DIRECT: _launch_record(direct)})
        provenance["overload"] = {
            "slots": spec.slots,
            "tenant": {"max_concurrency": admit, "max_queue": spec.max_queue},
            "queue_timeout_s": spec.queue_timeout_s,
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "provenance.json").write_text(
            json.dumps(provenance, indent=2, default=str) + "\n", "utf-8"
        )
        sweep_spec = SweepSpec(
            targets, spec.loads, spec.prompts, spec.options, spec.gates, spec.recovery, spec.pause_s
        )
        result = asyncio.run(_sweep(sweep_spec, out_dir, progress))
        after = {name: lx.rss_bytes() for name, lx in ((GATE, gate), (DIRECT, direct))}
        (out_dir / "rss_after.json").write_text(json.dumps(after, indent=2) + "\n", "utf-8")
    finally:
        for lx in reversed(launched):
            lx.stop()
    claim = check_claim(result)
    md = "# Overload: straight to llama-server versus through llamagate\n\n" + comparison_markdown(
        result, claim
    )
    (out_dir / "overload.md").write_text(md, encoding="utf-8")
    if claim is not None:
        (out_dir / "claim.json").write_text(json.dumps(claim.__dict__, indent=2) + "\n", encoding="utf-8")
    return result, claim
