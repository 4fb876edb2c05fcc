"""Load progress from real signals: the real llama-server loading the demo model under a real
``ChildSupervisor``. The snapshot's progress rises and never goes back, reaches 1.0 only at READY; the
signal behind it (``RealChild.loaded_bytes``) really climbs to the model's size while the child loads;
the next load of the same file has an estimate."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from proxy.source import UpstreamSnapshot
from supervisor.child.driver import ChildSupervisor
from supervisor.child.gate import HttpProbes
from supervisor.child.loading import READ_SHARE, LoadTimes
from supervisor.child.machine import State
from supervisor.child.restart import Policy
from supervisor.child.spawn import RealChild, RealOs
from supervisor.launch.flags import LaunchSpec
from supervisor.launch.knobs import LlamaKnobs

pytestmark = pytest.mark.integration


class RecordingChild(RealChild):
    """The real child; every figure the driver samples is written down."""

    def __init__(self, real: RealChild) -> None:
        super().__init__(real._proc)
        self.samples: list[int | None] = []

    def loaded_bytes(self) -> int | None:
        value = super().loaded_bytes()
        self.samples.append(value)
        return value


class RecordingOs(RealOs):
    def __init__(self) -> None:
        self.children: list[RecordingChild] = []

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> RealChild:
        child = RecordingChild(await super().spawn(argv, env, cwd))
        self.children.append(child)
        return child


class ProbesThatLook(HttpProbes):
    """The real probes; when /health first answers 200 (the model is loaded), the child's loaded bytes
    are read at that instant."""

    def __init__(self, os_: RecordingOs) -> None:
        super().__init__()
        self.os = os_
        self.at_health_200: list[int | None] = []

    async def health(self, base_url: str, timeout_s: float) -> int:
        status = await super().health(base_url, timeout_s)
        if status == 200 and len(self.at_health_200) < len(self.os.children):
            self.at_health_200.append(RealChild.loaded_bytes(self.os.children[-1]))
        return status


async def watch_one_load(sup: ChildSupervisor, generation: int) -> list[UpstreamSnapshot]:
    """Snapshots every few ms from the load of ``generation`` until it is READY (with a deadline)."""
    seen: list[UpstreamSnapshot] = []
    async with asyncio.timeout(180):
        while True:
            snap = sup.snapshot()
            if snap.generation == generation and snap.state in ("STARTING", "READY"):
                seen.append(snap)
                if snap.state == "READY":
                    return seen
            assert snap.state not in ("BACKOFF", "FAILED"), snap.reason
            await asyncio.sleep(0.005)


def check_one_load(seen: list[UpstreamSnapshot]) -> list[float]:
    loading = [s.progress for s in seen if s.state == "STARTING"]
    assert loading and all(p is not None for p in loading)
    shares = [p for p in loading if p is not None]
    assert shares == sorted(shares), shares  # never back
    assert all(0.0 <= p < 1.0 for p in shares)
    assert len(set(shares)) >= 2, shares  # it moved while the child loaded
    assert seen[-1].progress == 1.0 and seen[-1].load_step is None
    order = ["health", "models", "decode"]
    steps = [order.index(s.load_step) for s in seen if s.load_step is not None]
    assert steps == sorted(steps)
    return shares


async def test_progress_rises_to_one_before_ready_and_the_next_load_has_an_estimate(
    tmp_path: Path, llama_server_binary: Path, demo_model: Path
) -> None:
    spec = LaunchSpec(
        llama_server_binary,
        demo_model,
        "smollm2-135m-instruct",
        0,
        LlamaKnobs(threads=2, threads_batch=2, slots=2, ctx_per_slot=4096),
    )
    os_ = RecordingOs()
    probes = ProbesThatLook(os_)
    times = LoadTimes(tmp_path / "load_times.json")
    sup = ChildSupervisor(
        spec,
        Policy(load_timeout_s=180),
        os=os_,
        probes=probes,
        workdir=tmp_path / "w",
        load_times=times,
    )
    task = asyncio.create_task(sup.run())
    try:
        first = await watch_one_load(sup, 1)
        check_one_load(first)
        assert all(s.load_eta_s is None for s in first)  # this file was never loaded before
        size = os_.file_stamp(demo_model).size  # type: ignore[union-attr]
        samples = [b for b in os_.children[0].samples if b is not None]
        # The signal is real: small when the driver first looked, the whole file once /health said
        # the model is loaded (mapped pages resident, or read).
        assert samples and samples[0] < 0.5 * size, (samples[:3], size)
        loaded = probes.at_health_200[0]
        assert loaded is not None and loaded >= 0.9 * size, (loaded, size)
        load_s = sup.load_seconds
        assert load_s is not None and times.get(os_.file_stamp(demo_model)) == round(load_s, 3)

        sup.restart("a second load of the same file")
        second = await watch_one_load(sup, 2)
        check_one_load(second)
        loading = [s for s in second if s.state == "STARTING"]
        etas = [s.load_eta_s for s in loading]
        assert all(e is not None for e in etas), etas
        assert etas[0] is not None and etas[0] <= round(load_s, 1) + 0.1
        # Retry-After says the same (the snapshot shows the remaining time to a tenth of a second).
        assert [s.retry_after_s for s in loading] == pytest.approx(
            [max(1.0, e) for e in etas if e is not None], abs=0.06
        )
        # The estimate of the remaining time only goes down as the load goes on.
        assert etas == sorted(etas, reverse=True)
        assert second[-1].load_eta_s is None and second[-1].progress == 1.0
        assert min(s.progress or 0.0 for s in loading) < READ_SHARE
    finally:
        await asyncio.wait_for(sup.stop("test over"), 60)
        await task
        await probes.aclose()
    assert sup.state is State.STOPPED
