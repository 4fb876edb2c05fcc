"""A child's load progress and its estimate, through the driver with the fake OS seam: the share of the
model file brought in, then the readiness gate's steps, never going back, 1.0 at READY; the previous
load of the same file gives the remaining time and the Retry-After."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from proxy.source import UpstreamSnapshot
from supervisor.child.driver import ChildSupervisor
from supervisor.child.loading import DECODE_AT, LOAD_SAMPLE_S, READ_SHARE, FileStamp, LoadProgress, LoadTimes
from supervisor.child.machine import State, Tick
from supervisor.child.osseam import ServedModel
from supervisor.child.restart import Policy
from tests.unit.test_process_driver import SPEC, FakeOs, FakeProbes, settle, start, until

SIZE = 1000  # the fake model file's size (FakeOs.files)


class SteppedProbes(FakeProbes):
    """/health says 503 until ``loaded``; then /v1/models and the one-token decode each wait to be let
    through, so a test sees every step of the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.health_status = 503
        self.models_go = asyncio.Event()
        self.decode_go = asyncio.Event()

    async def models(self, base_url: str, secret: str) -> list[ServedModel]:
        await self.models_go.wait()
        return await super().models(base_url, secret)

    async def one_token(self, base_url: str, secret: str) -> None:
        await self.decode_go.wait()
        await super().one_token(base_url, secret)


def make(
    os_: FakeOs, probes: FakeProbes, tmp_path: Path, load_times: LoadTimes | None = None
) -> ChildSupervisor:
    return ChildSupervisor(
        SPEC,
        Policy(load_timeout_s=600.0, stall_timeout_s=300.0, backoff=lambda n: 2.0, max_restarts=5),
        os=os_,
        probes=probes,
        workdir=tmp_path / "w",
        health_interval_s=1000.0,
        load_times=load_times,
    )


async def sample(sup: ChildSupervisor, os_: FakeOs, seconds: float = LOAD_SAMPLE_S) -> UpstreamSnapshot:
    os_.t += seconds
    await sup.dispatch(Tick())
    return sup.snapshot()


async def test_progress_follows_the_bytes_then_the_gate_steps_and_never_goes_back(tmp_path: Path) -> None:
    os_, probes = FakeOs(), SteppedProbes()
    sup = make(os_, probes, tmp_path)
    await start(sup)
    child = os_.children[0]
    seen = [sup.snapshot()]
    assert (seen[0].state, seen[0].progress, seen[0].load_step) == ("STARTING", 0.0, "health")
    for loaded in (100, 400, 250, 900, 3000):  # 250: pages evicted and counted again later
        child.loaded = loaded
        seen.append(await sample(sup, os_))
    shares = [s.progress for s in seen]
    assert shares == pytest.approx(
        [0.0, READ_SHARE * 0.1, READ_SHARE * 0.4, READ_SHARE * 0.4, READ_SHARE * 0.9, READ_SHARE]
    )
    probes.health_status = 200  # the model is loaded: the gate checks /v1/models
    await until(sup, lambda: sup.snapshot().load_step == "models", "the models step")
    assert sup.snapshot().progress == READ_SHARE
    probes.models_go.set()
    await until(sup, lambda: sup.snapshot().load_step == "decode", "the decode step")
    assert sup.snapshot().progress == DECODE_AT and sup.state is State.STARTING
    probes.decode_go.set()
    await until(sup, lambda: sup.state is State.READY, "READY")
    ready = sup.snapshot()
    assert (ready.progress, ready.load_step, ready.load_eta_s) == (1.0, None, None)


async def test_the_model_counts_as_read_once_health_answers_whatever_was_sampled(tmp_path: Path) -> None:
    os_, probes = FakeOs(), SteppedProbes()
    sup = make(os_, probes, tmp_path)
    await start(sup)
    os_.children[0].loaded = None  # the OS could not say (no /proc): no bytes, steps only
    assert (await sample(sup, os_)).progress == 0.0
    probes.health_status = 200
    await until(sup, lambda: sup.snapshot().load_step == "models", "the models step")
    assert sup.snapshot().progress == READ_SHARE


async def test_no_progress_outside_a_load_and_full_progress_while_loaded(tmp_path: Path) -> None:
    os_, probes = FakeOs(), FakeProbes()
    sup = make(os_, probes, tmp_path)
    assert sup.snapshot().progress is None  # STOPPED
    await start(sup)
    assert sup.state is State.READY and sup.snapshot().progress == 1.0
    os_.children[0].exit(1)
    await settle(sup)
    backoff = sup.snapshot()
    assert backoff.state == "BACKOFF" and (backoff.progress, backoff.load_step) == (None, None)


async def test_the_previous_load_of_the_same_file_gives_the_remaining_time_and_retry_after(
    tmp_path: Path,
) -> None:
    os_, probes = FakeOs(), SteppedProbes()
    sup = make(os_, probes, tmp_path)
    await start(sup)
    first = sup.snapshot()
    assert first.load_eta_s is None and first.retry_after_s == 5.0  # never loaded: no estimate
    os_.t += 8.0  # this load takes 8 s
    probes.health_status = 200
    probes.models_go.set()
    probes.decode_go.set()
    await until(sup, lambda: sup.state is State.READY, "READY")
    assert sup.load_seconds == 8.0 and sup.load_estimate_s() == 8.0
    os_.children[0].exit(-9)  # a crash: BACKOFF for 2 s, then the next load of the same file
    await settle(sup)
    assert sup.state is State.BACKOFF
    assert sup.snapshot().retry_after_s == pytest.approx(2.0 + 8.0)
    probes.health_status = 503
    probes.models_go.clear()
    probes.decode_go.clear()
    os_.t += 2.0
    await sup.dispatch(Tick())
    await settle(sup)
    assert sup.state is State.STARTING and sup.machine.generation == 2
    assert (sup.snapshot().load_eta_s, sup.snapshot().retry_after_s) == (8.0, 8.0)
    os_.children[1].loaded = SIZE // 2
    half = await sample(sup, os_, 3.0)  # on time: 3 of 8 s gone, more than half of the work left
    assert half.load_eta_s == pytest.approx(5.0) and half.retry_after_s == pytest.approx(5.0)
    behind = await sample(sup, os_, 3.0)  # 6 s gone, no more bytes: the work left says more than the clock
    assert behind.load_eta_s == pytest.approx(8.0 * (1 - READ_SHARE / 2), abs=0.05)
    assert behind.retry_after_s == pytest.approx(8.0 * (1 - READ_SHARE / 2))
    # Slower than last time: what is left of the work, never 0 while it is not done.
    os_.children[1].loaded = SIZE
    late = await sample(sup, os_, 6.0)
    assert late.load_eta_s == pytest.approx(8.0 * (1 - READ_SHARE))
    assert late.retry_after_s == 1.0  # Retry-After is whole seconds, at least 1


async def test_a_changed_file_has_no_estimate(tmp_path: Path) -> None:
    os_, probes = FakeOs(), FakeProbes()
    times = LoadTimes()
    times.put(FileStamp("/m.gguf", SIZE, 1), 30.0)
    sup = make(os_, probes, tmp_path, times)
    assert sup.load_estimate_s() == 30.0
    os_.files["/m.gguf"] = (SIZE, 2)  # rewritten in place: a new mtime
    assert sup.load_estimate_s() is None
    del os_.files["/m.gguf"]
    assert sup.load_estimate_s() is None


async def test_supervisors_sharing_a_store_share_estimates(tmp_path: Path) -> None:
    # An on-demand model gets a fresh supervisor for each load: the store is what remembers.
    times = LoadTimes()
    os_, probes = FakeOs(), FakeProbes()
    first = make(os_, probes, tmp_path, times)
    await start(first)
    assert first.state is State.READY
    second = make(os_, SteppedProbes(), tmp_path, times)
    assert second.load_estimate_s() == first.load_seconds == 0.0
    await start(second)
    assert second.snapshot().load_eta_s == 0.0 and second.snapshot().retry_after_s == 1.0


def test_load_times_outlive_the_process_in_their_file(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "load_times.json"
    stamp = FileStamp("/models/a.gguf", 5, 7)
    LoadTimes(path).put(stamp, 12.3456)
    assert LoadTimes(path).get(stamp) == 12.346
    assert LoadTimes(path).get(FileStamp("/models/a.gguf", 6, 7)) is None  # another size
    assert LoadTimes(path).get(None) is None
    assert json.loads(path.read_text()) == {"/models/a.gguf": {"load_s": 12.346, "mtime_ns": 7, "size": 5}}
    assert [p.name for p in path.parent.iterdir()] == ["load_times.json"]  # no temporary file left


def test_load_times_keep_the_newest_files_only(tmp_path: Path) -> None:
    from supervisor.child import loading

    times = LoadTimes(tmp_path / "t.json")
    for i in range(loading.MAX_REMEMBERED + 3):
        times.put(FileStamp(f"/m{i}.gguf", 1, 1), float(i))
    kept = json.loads((tmp_path / "t.json").read_text())
    assert len(kept) == loading.MAX_REMEMBERED and "/m0.gguf" not in kept and "/m66.gguf" in kept


def test_an_unwritable_or_broken_file_costs_the_estimate_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert LoadTimes(broken).get(FileStamp("/m.gguf", 1, 1)) is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    times = LoadTimes(blocker / "load_times.json")  # its folder is a file: cannot be written
    stamp = FileStamp("/m.gguf", 1, 1)
    with caplog.at_level(logging.WARNING):
        times.put(stamp, 3.0)
        times.put(stamp, 4.0)
    assert times.get(stamp) == 4.0  # still remembered in memory
    assert sum("cannot remember load times" in r.getMessage() for r in caplog.records) == 1


def test_progress_steps_only_move_forward() -> None:
    load = LoadProgress(0.0, FileStamp("/m", 100, 1), None)
    load.enter("decode")
    load.enter("models")
    assert load.step == "decode" and load.fraction == DECODE_AT
    load.observe(10, 1.0)
    assert load.fraction == DECODE_AT
