"""``llamagate serve`` with the real llama-server and the real demo model."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from supervisor.child.driver import ChildSupervisor
from supervisor.child.gate import HttpProbes
from supervisor.child.machine import State
from supervisor.child.osseam import ServedModel
from supervisor.child.restart import Policy
from supervisor.child.spawn import RealOs, free_port
from supervisor.launch.flags import LaunchSpec
from supervisor.launch.knobs import LlamaKnobs
from tests.integration.conftest import DaemonFactory, port_is_open, process_gone, wait_until

pytestmark = pytest.mark.integration


class RecordingProbes(HttpProbes):
    """The real probes, writing down what each answered and when."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, object, float]] = []

    async def health(self, base_url: str, timeout_s: float) -> int:
        try:
            status = await super().health(base_url, timeout_s)
        except Exception as exc:
            self.log.append(("health", type(exc).__name__, time.monotonic()))
            raise
        self.log.append(("health", status, time.monotonic()))
        return status

    async def models(self, base_url: str, secret: str) -> list[ServedModel]:
        served = await super().models(base_url, secret)
        self.log.append(("models", [(m.id, m.n_ctx) for m in served], time.monotonic()))
        return served

    async def one_token(self, base_url: str, secret: str) -> None:
        await super().one_token(base_url, secret)
        self.log.append(("one_token", "ok", time.monotonic()))


async def test_ready_only_after_all_three_gates(
    tmp_path: Path, llama_server_binary: Path, demo_model: Path
) -> None:
    spec = LaunchSpec(
        llama_server_binary,
        demo_model,
        "smollm2-135m-instruct",
        0,
        LlamaKnobs(threads=2, threads_batch=2, slots=2, ctx_per_slot=4096),
    )
    probes = RecordingProbes()
    sup = ChildSupervisor(
        spec, Policy(load_timeout_s=180), os=RealOs(), probes=probes, workdir=tmp_path / "w"
    )
    ready_at: list[float] = []
    states: list[State] = []
    ready = asyncio.Event()

    def observe(old: State, new: State, reason: str | None) -> None:
        states.append(new)
        if new is State.READY:
            ready_at.append(time.monotonic())
            ready.set()

    sup.observers.append(observe)
    task = asyncio.create_task(sup.run())
    try:
        await asyncio.wait_for(ready.wait(), 180)
    finally:
        await asyncio.wait_for(sup.stop("test over"), 60)
        await task
        await probes.aclose()
    steps = [name for name, _, _ in probes.log]
    first_200 = next(i for i, (name, value, _) in enumerate(probes.log) if name == "health" and value == 200)
    # The child was probed while it could not serve yet (refused or 503 "Loading model") ...
    assert all(value != 200 for _, value, _ in probes.log[:first_200])
    assert first_200 > 0
    # ... then the three gates passed, in order, and only then READY.
    assert steps[first_200 + 1 :] == ["models", "one_token"]
    assert probes.log[first_200 + 1][1] == [("smollm2-135m-instruct", 4096)]
    assert ready_at[0] >= probes.log[-1][2]
    assert states[:2] == [State.STARTING, State.READY]


def test_openai_sdk_through_the_daemon(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    client = OpenAI(base_url=f"{d.base_url}/v1", api_key=d.inference_key, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Say hi"}], max_tokens=4
    )
    assert reply.choices[0].message.content is not None
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    # The child itself refuses a caller without the per-boot secret.
    port = d.child_port
    assert port is not None
    direct = httpx.get(f"http://127.0.0.1:{port}/v1/models", trust_env=False)
    assert direct.status_code == 401
    # The identity is served to admins and names what is served.
    identity = d.admin_identity()
    assert identity["model"]["sha256"] == d.config["llama"]["model"]["sha256"]
    assert identity["serving"]["slots"] == 2 and identity["serving"]["ctx_per_slot"] == 4096
    assert len(identity["binary"]["sha256"]) == 64
    assert identity["host"]["cpu_logical"] >= 1
    # The memory budget is an upper bound of what the child really uses (the runtime allowance is
    # calibrated on this model; see supervisor/budget/plan.py).
    pid = d.child_pid
    assert pid is not None
    rss = psutil.Process(pid).memory_info().rss
    assert rss <= identity["budget"]["required_bytes"], (rss, identity["budget"])
    # Prompt text never reaches the log (the child's lines are logged at DEBUG here).
    client.completions.create(
        model="smollm2-135m-instruct", prompt="PROMPT-CANARY-7f3a the sky is", max_tokens=2
    )
    d.stop()
    assert "PROMPT-CANARY-7f3a" not in d.log_text()
    assert d.inference_key not in d.log_text() and d.admin_key not in d.log_text()


def test_request_text_that_llama_server_echoes_never_reaches_the_log(daemon_factory: DaemonFactory) -> None:
    # A bad grammar that passes the door (its reader checks structure, not the vocabulary: a named token
    # that is no single token) makes llama-server print it whole at its default verbosity. A lone
    # surrogate, which nlohmann::json refuses quoting what it last read, no longer reaches the child: the
    # proxy refuses it (400) itself. The daemon logs the child's lines at DEBUG here.
    d = daemon_factory()
    headers = {"Authorization": f"Bearer {d.inference_key}", "Content-Type": "application/json"}
    surrogate = (
        b'{"model": "smollm2-135m-instruct", '
        b'"prompt": "PROMPT-CANARY-91c2 secret \\ud800 x", "max_tokens": 2}'
    )
    grammar = (
        b'{"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 2, '
        b'"grammar": "root ::= <GRAMMAR-CANARY-5e1d>"}'
    )
    url = f"{d.base_url}/v1/completions"
    r = httpx.post(url, content=surrogate, headers=headers, trust_env=False, timeout=120)
    assert r.status_code == 400 and "surrogate" in r.text, r.text
    r = httpx.post(url, content=grammar, headers=headers, trust_env=False, timeout=120)
    assert r.status_code >= 400, r.text
    d.stop()
    log = d.log_text()
    # The child did print its grammar error, and it was captured ...
    assert "error parsing grammar" in log
    # ... without the request's text, from either body.
    assert "CANARY" not in log


def test_memory_stays_within_the_budget_across_distinct_prompts(
    daemon_factory: DaemonFactory, gemma_model: Path
) -> None:
    # llama-server keeps the state of every prompt it moves out of a slot, up to 8 GiB by default: seen,
    # ~21 MiB more RSS per distinct ~780-token prompt with Gemma 3 270M, past the old budget (435 MiB)
    # after 3 of them. The supervisor bounds that cache and the checkpoints (a sliding-window model's:
    # Gemma's), and budgets both.
    import random

    from supervisor.artifacts.demo_model import GEMMA

    gemma = {"path": str(gemma_model), "sha256": GEMMA.sha256, "alias": "gemma-3-270m"}
    # The disk tier off: with it on, a sliding-window model gets --swa-full and keeps no checkpoints
    # (budget/window.py); this test is about the RAM cache and the checkpoints.
    llama = {"model": gemma, "prompt_cache_mib": 32, "ctx_checkpoints": 2, "state_disk_mib": 0}
    d = daemon_factory({"llama": llama})
    budget = d.admin_identity()["budget"]
    assert budget["prompt_cache_bytes"] == 32 * 2**20 and budget["checkpoint_bytes"] > 0
    pid = d.child_pid
    assert pid is not None
    client = OpenAI(base_url=f"{d.base_url}/v1", api_key=d.inference_key, max_retries=0, timeout=300)
    words = [f"w{i}" for i in range(40)]
    rnd = random.Random(7)
    for i in range(4):  # the cache (32 MiB) holds one such state: past it from the second one
        prompt = f"document {i}: " + " ".join(rnd.choice(words) for _ in range(500))
        client.completions.create(model="gemma-3-270m", prompt=prompt, max_tokens=1)
    assert d.child_pid == pid  # no restart in between
    rss = psutil.Process(pid).memory_info().rss
    assert rss <= budget["required_bytes"], (rss, budget)


def test_kill_9_of_the_child_comes_back_ready(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"supervision": {"stable_after_s": 1}})
    pid = d.child_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    body = d.wait_for(lambda code, b: code == 200 and b["generation"] == 2, "READY with a new child")
    assert body["restarts"] == 1
    assert body["last_failure"] == "killed by SIGKILL from outside (out of memory?)"
    assert d.child_pid not in (None, pid)


def test_sigterm_leaves_no_child_and_a_closed_port(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    pid, port = d.child_pid, d.child_port
    assert pid is not None and port is not None and port_is_open(port)
    d.signal(signal.SIGTERM)
    assert d.wait_exit() == 0
    assert process_gone(pid)
    assert not port_is_open(port)
    assert not port_is_open(d.port)
    messages = [r.get("msg") for r in d.log_records()]
    assert "llama-server stopped; its port is closed" in messages


def test_sigkill_of_the_daemon_leaves_no_child(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    pid = d.child_pid
    assert pid is not None
    d.signal(signal.SIGKILL)
    d.wait_exit()
    wait_until(lambda: process_gone(pid), "the child to die with the daemon (PR_SET_PDEATHSIG)")


def test_ctrl_c_reaches_only_the_daemon_which_stops_the_child_itself(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(new_session=True)
    pid = d.child_pid
    assert pid is not None
    assert os.getpgid(pid) != os.getpgid(d.pid)  # the child has its own process group
    os.killpg(os.getpgid(d.pid), signal.SIGINT)  # what a terminal's Ctrl-C does to the foreground group
    assert d.wait_exit() == 130  # a clean stop, reported as an interrupted command (docs/operations.md)
    assert process_gone(pid)
    exits = [r for r in d.log_records() if r.get("pid") == pid and "returncode" in r]
    # The daemon decided: it sent SIGTERM after draining, and the child exited on it (not SIGINT).
    assert exits and exits[-1]["returncode"] == 0


def test_in_flight_stream_finishes_during_a_graceful_stop(daemon_factory: DaemonFactory) -> None:
    # A generous drain deadline: on a busy 2-core machine 24 tokens can take many seconds.
    d = daemon_factory({"proxy": {"drain_timeout_s": 120}})
    client = OpenAI(base_url=f"{d.base_url}/v1", api_key=d.inference_key, max_retries=0)
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Count from one to fifty in words."}],
        max_tokens=24,
        stream=True,
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices
    d.signal(signal.SIGTERM)
    # Readiness goes false at once, while the stream is still running.
    d.wait_for(lambda code, b: code == 503 and b["ready"] is False, "readiness off", timeout=10)
    rest = list(chunks)
    assert rest and rest[-1].choices[0].finish_reason in ("length", "stop")
    assert d.wait_exit() == 0


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_a_budget_that_does_not_fit_is_refused_with_numbers(daemon_factory: DaemonFactory) -> None:
    # 64 slots x 131072 tokens: the global layers alone need ~24 GiB of KV.
    d = daemon_factory({"llama": {"slots": 64, "ctx_per_slot": 131072}}, wait_ready=False)
    assert d.wait_exit() == 2  # a configuration mistake: systemd's RestartPreventExitStatus=2
    err = d.log_text()
    assert "memory budget does not fit: needs" in err
    weights_mib = Path(d.config["llama"]["model"]["path"]).stat().st_size / 2**20
    assert f"(weights {weights_mib:,.0f} MiB + KV " in err and " available - " in err
    assert "llama.ctx_per_slot <= " in err and "llama.slots <= " in err
    assert "starting llama-server" not in err  # refused before launch
    plan = run_cli("plan", "--config", str(d.config_path))
    assert plan.returncode == 1
    assert "memory budget does not fit" in plan.stdout


def test_a_wrong_model_sha256_is_refused_before_launch(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"llama": {"model": {"sha256": "0" * 64}}}, wait_ready=False)
    assert d.wait_exit() == 2
    err = d.log_text()
    assert "sha256 mismatch: expected " + "0" * 64 in err
    assert "starting llama-server" not in err


def test_status_command_exit_codes(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    ok = run_cli("status", "--url", d.base_url, "--key", d.admin_key, timeout=30)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "READY" in ok.stdout
    assert d.config["llama"]["model"]["sha256"] in ok.stdout  # the identity, with an admin key
    assert "uptime" in ok.stdout and "restarts     0" in ok.stdout
    d.stop()
    gone = run_cli("status", "--url", d.base_url, timeout=30)
    assert gone.returncode == 2 and "unreachable" in gone.stdout


def test_sighup_reloads_keys_without_restart_and_restarts_on_llama_change(
    daemon_factory: DaemonFactory,
) -> None:
    from supervisor.config.keys import new_key_config

    d = daemon_factory()
    new_plain, entry = new_key_config("default")
    keys = [*d.config["keys"], entry]
    headers = {"Authorization": f"Bearer {new_plain}"}
    assert httpx.get(f"{d.base_url}/v1/models", headers=headers, trust_env=False).status_code == 401
    d.write_config({"keys": keys})
    d.signal(signal.SIGHUP)
    wait_until(
        lambda: httpx.get(f"{d.base_url}/v1/models", headers=headers, trust_env=False).status_code == 200,
        "the new key to work",
    )
    assert d.readyz()[1]["generation"] == 1  # the child was not restarted

    d.write_config({"llama": {"slots": 3}})
    d.signal(signal.SIGHUP)
    body = d.wait_for(lambda code, b: code == 200 and b["generation"] == 2, "READY with 3 slots")
    assert body["slots"] == 3 and body["restarts"] == 1
    assert any("restarting llama-server: llama.slots: 2 -> 3" in str(r.get("msg")) for r in d.log_records())


def test_a_bad_config_on_sighup_keeps_the_old_one(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    d.config_path.write_text("llama:\n  slots: 0\n")
    d.signal(signal.SIGHUP)
    wait_until(lambda: "config not reloaded" in d.log_text(), "the reload to be refused")
    assert "llama.slots: must be >= 1" in d.log_text()
    code, body = d.readyz()
    assert code == 200 and body["generation"] == 1
    # Valid YAML, but the new model does not verify: nothing of it is applied, the child keeps serving.
    d.write_config(
        {"llama": {"model": {"sha256": "1" * 64}}, "tenants": [{"name": "default", "max_queue": 1}]}
    )
    d.signal(signal.SIGHUP)
    wait_until(
        lambda: "reload failed, still serving the previous settings" in d.log_text(), "the reload to fail"
    )
    code, body = d.readyz()
    assert code == 200 and body["generation"] == 1


def test_quick_start_prints_a_key_once_when_none_is_configured(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"keys": []})
    out = d.stdout_path.read_text()
    key = next(word for word in out.split() if word.startswith("lg_"))
    client = OpenAI(base_url=f"{d.base_url}/v1", api_key=key, max_retries=0)
    assert client.models.list().data[0].id == "smollm2-135m-instruct"
    assert out.count(key) >= 1 and key not in d.log_text()


def test_plan_prints_the_budget_and_the_argv(
    tmp_path: Path, llama_server_binary: Path, demo_model: Path, demo_model_sha256: str
) -> None:
    config = tmp_path / "llamagate.yaml"
    config.write_text(
        f"llama:\n  binary: {llama_server_binary}\n  slots: 3\n"
        f"  model: {{path: {demo_model}, sha256: '{demo_model_sha256}'}}\n"
    )
    plan = run_cli("plan", "--config", str(config))
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "-np 3 -c 12288" in plan.stdout and "--port <free port>" in plan.stdout
    assert "KV state (3 x 4096 tokens)" in plan.stdout
    # The memory verdict ends its block; the disk tier's room for conversations' states follows it.
    assert any(line.rstrip().endswith("fits") for line in plan.stdout.splitlines()), plan.stdout
    assert "LLAMA_API_KEY" not in plan.stdout


def test_serve_without_a_config_prints_a_key_and_a_call_that_works(
    llama_server_binary: Path, demo_model: Path, tmp_path: Path
) -> None:
    """The README's first command: no config at all. The embedded default comes up, prints a fresh key
    once on stdout (never in the log on stderr) and a curl line whose request, sent as printed, answers
    within its max_tokens."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "LLAMAGATE_CONFIG"}
    with (tmp_path / "log.txt").open("wb") as log_fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "serve", "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=log_fh,
            env=env,
            cwd=tmp_path,
        )
    lines: queue.Queue[bytes] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    reader = threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True)
    reader.start()
    try:
        printed: list[str] = []
        deadline = time.monotonic() + 300
        while not any("print(reply" in line for line in printed):
            try:
                printed.append(lines.get(timeout=max(0.0, deadline - time.monotonic())).decode())
            except queue.Empty:
                pytest.fail(f"no banner within 300 s; stdout so far: {printed}")
        banner = "".join(printed)
        keys = set(re.findall(r"\blg_[0-9a-f]{12}_[A-Za-z0-9_-]+", banner))
        assert len(keys) == 1, banner
        key = keys.pop()
        body = json.loads(re.search(r"-d '(\{.*?\})'", banner, re.S).group(1))  # type: ignore[union-attr]
        assert f"http://127.0.0.1:{port}/v1/chat/completions" in banner

        base = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: httpx.get(f"{base}/readyz", trust_env=False).status_code == 200, "READY", timeout=300
        )
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
            trust_env=False,
        )
        assert r.status_code == 200, r.text
        assert 0 < r.json()["usage"]["completion_tokens"] <= body["max_tokens"]
        # The printed request is repeatable (temperature 0) and the instruct model ends its answer itself.
        assert body["temperature"] == 0 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
        # The demo model answers in its own chat format, not in ChatML debris (llama.chat_template).
        content = r.json()["choices"][0]["message"]["content"]
        debris = ("<|im_end|>", "<|im_start|>", "<start_of_turn>", "<end_of_turn>")
        assert not [t for t in debris if t in content], content
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        reader.join(10)  # the pipe reaches EOF once the daemon has exited
        stdout.close()
    log = (tmp_path / "log.txt").read_text()
    assert "llamagate stopped" in log and key not in log
