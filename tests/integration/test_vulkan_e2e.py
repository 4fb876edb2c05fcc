"""The vulkan build variant on a real Vulkan device: Mesa's lavapipe, which runs on the CPU.

The binary is the lock's ``vulkan`` variant from llamagate's cache (``llamagate build --variant vulkan``;
.ci/run builds it with its Debian packages). Without it, or without lavapipe, these tests skip naming
what to install, and fail under CI=true, where both are installed (tests/helpers/system.py's rule).
ggml-vulkan enumerates a CPU-type device only when GGML_VK_VISIBLE_DEVICES names it: the configs set
``vulkan_devices: "0"``, as an operator would on such a host.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from supervisor.artifacts.build import find_installed
from supervisor.artifacts.lock import load_lock
from tests.conftest import LOCK
from tests.helpers.system import in_ci
from tests.integration.conftest import DaemonFactory

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
ICD_FOLDER = Path("/usr/share/vulkan/icd.d")
# Every layer on lavapipe, named by index (it is Vulkan device 0 on a machine without a GPU).
VULKAN: dict[str, Any] = {
    "llama": {
        "binary": None,
        "variant": "vulkan",
        "gpu_layers": 99,
        "vulkan_devices": "0",
        "device": "Vulkan0",
    }
}
# The figure the loader prints for the demo model (SmolLM2-135M: 30 layers + the output layer).
ALL_LAYERS = re.compile(r"(\d+)/\1")


def _missing(message: str) -> None:
    if in_ci():
        pytest.fail(f"{message}; CI=true, so a missing build is a failure, not a skip", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def vulkan_binary() -> Path:
    if not any(ICD_FOLDER.glob("lvp_icd*.json")):
        _missing("no lavapipe Vulkan driver: install the Debian package 'mesa-vulkan-drivers'")
    installed = find_installed(LOCK, variant="vulkan")
    if installed is None:
        packages = " ".join(load_lock(LOCK, "vulkan").packages)
        _missing(
            f"the vulkan build is not in the cache: apt-get install {packages},"
            " then llamagate build --variant vulkan"
        )
    assert installed is not None
    return installed.path


def test_verify_names_lavapipe_and_every_layer_offloaded(vulkan_binary: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor",
            "verify",
            "--variant",
            "vulkan",
            "--vulkan-devices",
            "0",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert done.returncode == 0 and report["ok"], checks
    assert report["binary"] == str(vulkan_binary)
    assert report["receipt"]["variant"] == "vulkan"
    assert [p.split(" (sha256")[0] for p in report["receipt"]["patches"]] == [
        "ggml-vulkan: build without VK_EXT_layer_settings"
    ]
    assert re.search(
        r"Vulkan0: llvmpipe \(LLVM [^)]*\) \(\d+ MiB, \d+ MiB free\)", checks["devices"]["detail"]
    )
    assert report["devices"][0]["memory_on_host"] is True
    offloaded = re.fullmatch(r"offloaded (\S+) layers to Vulkan0", checks["offload"]["detail"])
    assert offloaded and ALL_LAYERS.fullmatch(offloaded.group(1)), checks["offload"]


def test_the_demo_model_on_lavapipe_through_the_proxy(
    daemon_factory: DaemonFactory, vulkan_binary: Path
) -> None:
    d = daemon_factory(VULKAN)  # waits for /readyz 200: the child passed its readiness gate
    status, ready = d.readyz()
    assert status == 200 and ready["ready"] is True
    identity = d.admin_identity()
    assert identity["binary"]["path"] == str(vulkan_binary)
    assert identity["llama_cpp"]["variant"] == "vulkan"
    device = identity["models"][MODEL]["device"]
    assert device["variant"] == "vulkan" and device["gpu_layers"] == 99
    assert device["device"]["name"] == "Vulkan0" and device["device"]["description"].startswith("llvmpipe")

    client = OpenAI(base_url=d.base_url + "/v1", api_key=d.inference_key, max_retries=0, timeout=120)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content
    assert chat.usage is not None and 0 < chat.usage.completion_tokens <= 8

    with httpx.Client(timeout=30, trust_env=False) as c:
        metrics = c.get(f"{d.base_url}/metrics", headers={"Authorization": f"Bearer {d.admin_key}"}).text
    predicted = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("llamacpp_tokens_predicted_total")
    ]
    assert predicted and sum(predicted) >= chat.usage.completion_tokens


def _greedy(d: Any, prompt: str, max_tokens: int) -> tuple[str, int]:
    client = OpenAI(base_url=d.base_url + "/v1", api_key=d.inference_key, max_retries=0, timeout=300)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        seed=1,
    )
    assert chat.usage is not None
    return chat.choices[0].message.content or "", chat.usage.prompt_tokens


# The same greedy request to both builds. Measured (docs/build.md, "CPU and Vulkan answers"), 16 tokens:
#   cpu     "Hello! I'shine. I'm here to help with any kind of"
#   vulkan  "Hello! How can I assist you today?"
# Equal: the prompt, token for token (one tokenizer, one template), the opening "Hello!", and each build's
# answer from one request to the next. Different: the rest, because the two backends add and round in
# another order (lavapipe's shaders against the CPU's SIMD kernels) and at temperature 0 one different
# top token changes everything after it.
PROMPT = "Hello"
OPENING = "Hello!"


def test_greedy_answers_of_the_cpu_and_vulkan_builds(
    daemon_factory: DaemonFactory, vulkan_binary: Path
) -> None:
    answers: dict[str, list[str]] = {}
    prompt_tokens: dict[str, int] = {}
    for name, overrides in (("cpu", {}), ("vulkan", VULKAN)):
        d = daemon_factory(overrides)
        runs = [_greedy(d, PROMPT, 16) for _ in range(2)]
        answers[name] = [text for text, _ in runs]
        prompt_tokens[name] = runs[0][1]
        d.stop()
    print(f"greedy answers to {PROMPT!r}: {answers}")
    assert prompt_tokens["cpu"] == prompt_tokens["vulkan"]  # the same prompt, token for token
    for name, (first, second) in answers.items():
        assert first and first == second, f"{name}: not deterministic at temperature 0: {first!r} {second!r}"
    assert answers["cpu"][0].startswith(OPENING) and answers["vulkan"][0].startswith(OPENING), answers
