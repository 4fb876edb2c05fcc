"""GPU offload around the child: the device knobs reach its argv and environment, ``--list-devices`` is
read, the budget splits host and device, and the child's log says where the layers went.

The fake llama-server behaves like the vulkan build on a machine whose only Vulkan device is lavapipe
(tests/fakes/fake_llama_server.py); the real one is in tests/integration/test_vulkan_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.artifacts.smoke import smoke_decode
from supervisor.artifacts.verify import VerifyReport, _devices_check, _offload_check
from supervisor.budget.devices import Device, Devices, list_devices, parse_list_devices
from supervisor.budget.plan import MIB, Offload, plan_budget
from supervisor.child.log import offload_fact
from supervisor.config.load import parse_config
from supervisor.config.models import served_models
from supervisor.daemon.prepare import Binary, Model, budget_for, devices_for, identity_for, launch_spec
from supervisor.errors import ConfigError
from supervisor.launch.flags import build_argv, build_env
from supervisor.launch.knobs import LlamaKnobs
from tests.fakes.fake_child import make_fake_binary
from tests.unit.test_budget import full_shape

LISTED = """Available devices:
  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)
  Vulkan1: NVIDIA GeForce RTX 4090 (24564 MiB, 23000 MiB free)
"""
GPU = Device("Vulkan1", "NVIDIA GeForce RTX 4090", 24564 * MIB, 23000 * MIB)
LAVAPIPE = Device("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", 2048 * MIB, 2048 * MIB)


def test_list_devices_output_is_parsed_with_the_memory_the_driver_reports() -> None:
    devices = parse_list_devices(LISTED)
    assert devices == (LAVAPIPE, GPU)
    assert devices[0].on_host and not devices[1].on_host  # lavapipe's "device memory" is host RAM
    assert parse_list_devices("Available devices:\n  (none)\n") == ()
    both = Devices(devices)
    assert both.chosen(None) == LAVAPIPE and both.chosen("Vulkan1,Vulkan0") == GPU
    assert both.chosen("none") is None and both.chosen("CUDA0") is None


async def test_the_knobs_reach_the_childs_argv_and_environment(tmp_path: Path) -> None:
    cfg = parse_config("llama: {variant: vulkan, gpu_layers: 99, device: Vulkan0, vulkan_devices: '0'}\n")
    spec = launch_spec(cfg, Binary(Path("/b"), "", None), Model(Path("/m"), "", 1, None))  # type: ignore[arg-type]
    argv = build_argv(spec)
    assert argv[argv.index("--device") + 1] == "Vulkan0" and argv[argv.index("-ngl") + 1] == "99"
    assert "vulkan" not in argv  # the variant chooses the binary; it is no flag
    assert build_env("s", tmp_path, spec.llama)["GGML_VK_VISIBLE_DEVICES"] == "0"
    assert "GGML_VK_VISIBLE_DEVICES" not in build_env("s", tmp_path, LlamaKnobs())


def test_a_device_for_the_cpu_build_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(
            "llama: {device: Vulkan0}\nmodels: [{name: a}, {name: b, variant: cpu, device: CUDA0}]\n"
        )
    assert "llama.device: the cpu build has no device to offload to" in str(info.value)
    assert "models[1].device: the cpu build" in str(info.value)
    ok = parse_config(
        "llama: {variant: vulkan}\nmodels: [{name: a, device: Vulkan0}, {name: b, variant: cpu}]\n"
    )
    assert [m.cfg.llama.variant for m in served_models(ok)] == ["vulkan", "cpu"]  # one build per model
    with pytest.raises(ConfigError, match=r"llama\.vulkan_devices: must be device indexes"):
        parse_config("llama: {vulkan_devices: 'all'}\n")


def test_list_devices_runs_in_the_childs_environment_and_says_what_it_missed(tmp_path: Path) -> None:
    binary = make_fake_binary(tmp_path / "bin")
    hidden = list_devices(binary, LlamaKnobs(variant="vulkan"))
    assert hidden.listed == () and hidden.note is not None
    assert "lists no device" in hidden.note and "llama.vulkan_devices" in hidden.note  # lavapipe is skipped
    named = list_devices(binary, LlamaKnobs(variant="vulkan", vulkan_devices="0"))
    assert named.listed == (LAVAPIPE,) and named.note is None
    gone = list_devices(tmp_path / "missing", LlamaKnobs())
    assert gone.note is not None and "did not run" in gone.note


def test_the_budget_splits_weights_and_kv_between_host_and_device() -> None:
    shape = full_shape(layers=4)
    args = {"weights": 500 * MIB, "slots": 2, "ctx_per_slot": 4096, "type_k": "f16", "type_v": "f16"}
    cpu = plan_budget(shape, headroom_bytes=0, available=64 << 30, **args)
    gpu = plan_budget(shape, headroom_bytes=0, available=64 << 30, offload=Offload(99, GPU), **args)
    half = plan_budget(shape, headroom_bytes=0, available=64 << 30, offload=Offload(2, GPU), **args)
    assert gpu.device is not None and half.device is not None and cpu.device is None
    # Every layer and the output layer: the whole file's share but the token embeddings' estimate.
    assert (gpu.device.layers, gpu.device.of_layers) == (5, 5)
    assert gpu.device.weights_bytes + gpu.weights_bytes == cpu.weights_bytes == 500 * MIB
    assert gpu.device.kv_bytes == cpu.kv_bytes and gpu.kv_bytes == 0
    assert half.device.weights_bytes == 500 * MIB * 2 // 5 and half.device.kv_bytes == cpu.kv_bytes // 2
    assert gpu.required_bytes < cpu.required_bytes and gpu.fits
    assert gpu.as_dict()["device"]["free_bytes"] == 23000 * MIB  # type: ignore[index]
    text = "\n".join(gpu.lines())
    assert "device Vulkan1: NVIDIA GeForce RTX 4090" in text and "free on the device" in text


def test_a_device_too_small_refuses_and_lavapipe_counts_on_the_host() -> None:
    shape = full_shape(layers=4)
    args = {"weights": 500 * MIB, "slots": 2, "ctx_per_slot": 4096, "type_k": "f16", "type_v": "f16"}
    small = Device("Vulkan1", "a small card", 512 * MIB, 300 * MIB)
    refused = plan_budget(shape, headroom_bytes=0, available=64 << 30, offload=Offload(99, small), **args)
    assert not refused.fits and refused.required_bytes <= refused.usable_bytes  # the host has room
    assert "does not fit on Vulkan1 (a small card)" in refused.refusal()
    assert "fewer llama.gpu_layers" in refused.refusal()
    cpu = plan_budget(shape, headroom_bytes=0, available=64 << 30, **args)
    on_host = plan_budget(shape, headroom_bytes=0, available=64 << 30, offload=Offload(99, LAVAPIPE), **args)
    assert on_host.device is not None and on_host.device.fits  # no memory of its own to run out of
    assert on_host.required_bytes == on_host.weights_bytes + on_host.kv_bytes + on_host.runtime_bytes + (
        on_host.prompt_cache_bytes + on_host.checkpoint_bytes + on_host.device.required_bytes
    )
    assert on_host.required_bytes > cpu.required_bytes  # the device's compute buffer, in host RAM
    unknown = plan_budget(
        shape, headroom_bytes=0, available=64 << 30, offload=Offload(99, None, "no device listed"), **args
    )
    assert unknown.fits and "not read: no device listed; not checked" in "\n".join(unknown.lines())
    # Not knowing the device, the host is budgeted as if nothing were offloaded.
    assert (unknown.weights_bytes, unknown.kv_bytes) == (cpu.weights_bytes, cpu.kv_bytes)


def test_prepare_lists_devices_only_when_layers_are_offloaded(tmp_path: Path) -> None:
    binary = make_fake_binary(tmp_path / "bin")
    cpu = parse_config("llama: {gpu_layers: 99}\n")  # the cpu build: nothing to list
    assert devices_for(cpu, binary) is None
    cfg = parse_config("llama: {variant: vulkan, gpu_layers: 99, vulkan_devices: '0'}\n")
    assert devices_for(cfg, None) == Devices(
        (), "the binary is not built yet (llamagate build --variant vulkan)"
    )
    devices = devices_for(cfg, binary)
    assert devices is not None and devices.listed == (LAVAPIPE,)
    model = Model(tmp_path / "m.gguf", "", 200 * MIB, full_shape(layers=4))
    budget = budget_for(cfg, model, available=64 << 30, devices=devices)
    assert budget.device is not None and budget.device.device == LAVAPIPE
    spec = launch_spec(cfg, Binary(binary, "", None), model)
    record = identity_for(spec, Binary(binary, "", None), model, devices)["device"]
    assert record == {
        "variant": "vulkan",
        "gpu_layers": 99,
        "device": LAVAPIPE.as_dict(),
        "listed": [LAVAPIPE.as_dict()],
        "note": None,
    }


def test_the_loaders_lines_say_where_the_layers_went() -> None:
    assert offload_fact("0.01.000.000 I load_tensors: offloaded 31/31 layers to GPU") == ("layers", "31/31")
    assert offload_fact("load_tensors:      Vulkan0 model buffer size =    76.23 MiB") == (
        "device",
        "Vulkan0",
    )
    assert offload_fact("load_tensors:   CPU_Mapped model buffer size =    28.62 MiB") is None
    assert offload_fact("load_tensors: loading model tensors, this can take a while...") is None


async def test_verify_checks_the_device_and_that_every_layer_was_offloaded(tmp_path: Path) -> None:
    binary = make_fake_binary(tmp_path / "bin")
    report = VerifyReport(tmp_path / "lock", "d")
    missing = _devices_check(report, binary, LlamaKnobs(variant="vulkan"))
    assert not missing.ok and "llama.vulkan_devices" in missing.detail
    knobs = LlamaKnobs(variant="vulkan", vulkan_devices="0")
    found = _devices_check(report, binary, knobs)
    assert found.ok and "Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)" in found.detail
    result = await smoke_decode(binary, tmp_path / "m.gguf", alias="fake", gpu_layers=99, knobs=knobs)
    assert (result.offloaded, result.devices) == ("31/31", ("Vulkan0",))
    assert _offload_check(result.offloaded, result.devices).ok
    # A build that loads on the CPU although asked to offload fails the check, naming what it saw.
    fallback = make_fake_binary(tmp_path / "fallback", "--cpu-fallback")
    result = await smoke_decode(fallback, tmp_path / "m.gguf", alias="fake", gpu_layers=99, knobs=knobs)
    check = _offload_check(result.offloaded, result.devices)
    assert not check.ok and "only 0/31 layers offloaded (no device buffer)" in check.detail
    assert not _offload_check(None, ()).ok  # a CPU build prints no such line at all
