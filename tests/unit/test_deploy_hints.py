"""Service limits from a memory budget (the numbers behind `llamagate plan --systemd/--kubernetes`)."""

from __future__ import annotations

import configparser

import yaml

from supervisor.budget.plan import MIB, Budget
from supervisor.daemon.deploy_hints import DAEMON_BYTES, ServiceLimits


def budget(weights_mib: int, kv_mib: int, runtime_mib: int) -> Budget:
    return Budget(
        weights_bytes=weights_mib * MIB,
        kv_bytes=kv_mib * MIB,
        runtime_bytes=runtime_mib * MIB,
        available_bytes=16 * 1024 * MIB,
        headroom_bytes=1024 * MIB,
        slots=2,
        ctx_per_slot=4096,
        max_ctx_per_slot=4096,
        max_slots=2,
    )


def test_high_covers_budget_and_daemon_and_max_adds_a_margin() -> None:
    b = budget(241, 54, 140)
    limits = ServiceLimits.from_budget(b, threads=4)
    assert limits.memory_high_bytes >= b.required_bytes + DAEMON_BYTES
    assert limits.memory_high_bytes - (b.required_bytes + DAEMON_BYTES) < 64 * MIB
    # Small services get the 256 MiB floor, large ones a quarter.
    assert limits.memory_max_bytes - limits.memory_high_bytes >= 256 * MIB
    big = ServiceLimits.from_budget(budget(40_000, 8_000, 2_000), threads=4)
    assert big.memory_max_bytes >= big.memory_high_bytes * 1.25
    assert limits.memory_high_bytes % (64 * MIB) == 0 and limits.memory_max_bytes % (64 * MIB) == 0
    assert limits.cpus == 5


def test_limits_grow_with_the_kv_state() -> None:
    small = ServiceLimits.from_budget(budget(241, 54, 140), threads=2)
    large = ServiceLimits.from_budget(budget(241, 54 * 16, 140), threads=2)
    assert large.memory_high_bytes > small.memory_high_bytes
    assert large.memory_max_bytes > small.memory_max_bytes


def test_systemd_dropin_is_a_service_section() -> None:
    limits = ServiceLimits(memory_high_bytes=640 * MIB, memory_max_bytes=896 * MIB, cpus=3)
    parser = configparser.ConfigParser()
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(limits.systemd_dropin())
    assert dict(parser["Service"]) == {"MemoryHigh": "640M", "MemoryMax": "896M"}


def test_kubernetes_block_is_guaranteed_qos() -> None:
    limits = ServiceLimits(memory_high_bytes=640 * MIB, memory_max_bytes=896 * MIB, cpus=3)
    parsed = yaml.safe_load(limits.kubernetes_yaml())
    assert parsed == {"resources": limits.kubernetes_resources()}
    assert parsed["resources"]["requests"] == parsed["resources"]["limits"] == {"cpu": "3", "memory": "896Mi"}
