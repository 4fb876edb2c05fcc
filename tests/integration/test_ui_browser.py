"""The page in a real headless Chromium, against the daemon with the real llama-server and demo model.

One daemon, one browser, the whole tour: the redirect, a wrong key, an admin key (status READY, slots,
identity, per-tenant load), the playground (streamed text, time to first token, token counts), stop
during a long answer (the slot is freed), a 429 with its Retry-After, and at the end: every request the
page made went to the daemon's own origin, no Content-Security-Policy violation or script error was
logged, and status polls never overlapped. Then a daemon serving two models (one loaded, one on_demand
and unloaded): a row per model, the page never loading the unloaded one, the playground's model select.

Needs Debian's ``chromium`` and ``chromium-driver`` (the ``needs_tool`` marker: without them the tests
are skipped, except under ``CI=true``, where they fail: CI must run them) and ``selenium`` (test extra).

A screenshot of each view goes to ``$LLAMAGATE_SCREENSHOTS`` (default: the test's tmp folder, printed).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import ASGIApp

from proxy.app import create_app
from proxy.auth import new_key
from proxy.models.lane import ModelEntry
from proxy.settings import ProxySettings, TenantSettings
from tests.fakes.fake_requests import RequestsApi
from tests.fakes.fake_upstream import StaticSource, one_model, snapshot_for
from tests.helpers.system import require_tool
from tests.integration.conftest import Daemon, DaemonFactory, process_gone, wait_until
from tests.integration.test_multi_model_e2e import child_pid, model, two_models

pytestmark = [pytest.mark.integration, pytest.mark.needs_tool("chromium", "chromedriver")]

MODEL = "smollm2-135m-instruct"
WRONG_KEY = "lg_0123456789ab_" + "A" * 43
# What the browser does when a tab goes to the background or comes back.
HIDE_TAB = """
Object.defineProperty(document, "hidden", {configurable: true, get: () => arguments[0]});
document.dispatchEvent(new Event("visibilitychange"));
"""
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # tests run as root in CI containers
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1100",
)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = require_tool("chromium")
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    # Every network request of the page (CDP Network.* events), and its console (CSP reports, errors).
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    # An explicit driver path: Selenium Manager would otherwise try to download one.
    service = Service(executable_path=require_tool("chromedriver"), log_output=str(tmp_path / "driver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("LLAMAGATE_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"screenshots: {folder}")
    return folder


class Page:
    """The page as a person sees it, plus the browser's logs collected as the test goes."""

    def __init__(self, driver: Any, daemon: Daemon | None, shots: Path) -> None:
        self.driver = driver
        self.daemon = daemon
        self.shots = shots
        self.network: list[dict[str, Any]] = []
        self.console: list[dict[str, Any]] = []

    def collect_logs(self) -> None:
        for entry in self.driver.get_log("performance"):
            self.network.append(json.loads(entry["message"])["message"])
        self.console.extend(self.driver.get_log("browser"))

    def el(self, element_id: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.ID, element_id)

    def text(self, element_id: str) -> str:
        return str(self.el(element_id).get_attribute("textContent") or "")

    def wait(self, pred: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        from selenium.webdriver.support.wait import WebDriverWait

        try:
            WebDriverWait(self.driver, timeout, poll_frequency=0.1).until(lambda _: pred())
        except Exception:
            state = {
                i: self.text(i)
                for i in (
                    "key-status",
                    "status-message",
                    "st-state",
                    "st-slots",
                    "pg-state",
                    "pg-message",
                    "pg-ttft",
                )
            }
            self.collect_logs()
            pytest.fail(f"timed out waiting for {what}; page: {state}; console: {self.console[-5:]}")

    def enter_key(self, key: str) -> None:
        field = self.el("key")
        field.clear()
        field.send_keys(key)
        self.el("key-use").click()

    def type_into(self, element_id: str, value: str) -> None:
        field = self.el(element_id)
        field.clear()
        field.send_keys(value)

    def ask(self, prompt: str, max_tokens: int) -> None:
        """Send a prompt from the playground and wait for the whole answer, streamed, with its TTFT."""
        self.type_into("pg-prompt", prompt)
        self.type_into("pg-max-tokens", str(max_tokens))
        self.el("pg-send").click()
        self.wait(lambda: self.text("pg-state") == "done", "the answer to finish", timeout=180)
        assert self.text("pg-output").strip()
        assert re.fullmatch(r"\d+ ms", self.text("pg-ttft")), self.text("pg-ttft")

    def chat_bodies(self) -> list[dict[str, Any]]:
        """Every chat request the page sent so far, as the browser sent it (its DevTools record)."""
        self.collect_logs()
        return [
            json.loads(m["params"]["request"]["postData"])
            for m in self.network
            if m["method"] == "Network.requestWillBeSent"
            and m["params"]["request"]["url"].endswith("/v1/chat/completions")
            and m["params"]["request"]["method"] == "POST"
        ]

    def turns(self) -> int:
        from selenium.webdriver.common.by import By

        return len(self.driver.find_elements(By.CSS_SELECTOR, "#pg-conversation .turn"))

    def rows(self, tbody_id: str) -> list[list[str]]:
        script = (
            "return [...document.getElementById(arguments[0]).rows]"
            ".map(r => [...r.cells].map(c => c.textContent))"
        )
        return list(self.driver.execute_script(script, tbody_id))

    def dataset(self, name: str) -> str:
        return str(self.driver.execute_script("return document.body.dataset[arguments[0]]", name))

    def shot(self, name: str) -> None:
        self.driver.save_screenshot(str(self.shots / name))

    def slots_busy(self) -> list[bool]:
        assert self.daemon is not None
        r = httpx.get(
            f"{self.daemon.base_url}/slots",
            headers={"Authorization": f"Bearer {self.daemon.admin_key}"},
            timeout=10,
            trust_env=False,
        )
        r.raise_for_status()
        return [bool(s["is_processing"]) for s in r.json()]


def test_status_and_playground_in_chromium(
    daemon_factory: DaemonFactory, browser: Any, screenshots: Path
) -> None:
    # One request at a time for the tenant and no queue: a second request is refused with 429 at once.
    # The child ignores end-of-generation: the long answers below (one stopped from the page, one holding
    # the permit) must still be running when the test acts, and SmolLM2 may end "a long story" early.
    d = daemon_factory(
        {
            "tenants": [{"name": "default", "max_concurrency": 1, "max_queue": 0}],
            "llama": {"extra_args": ["--ignore-eos"]},
        }
    )
    page = Page(browser, d, screenshots)
    origin = d.base_url

    # / redirects to the page; without a key the public readiness shows.
    browser.get(origin + "/")
    assert browser.current_url == origin + "/ui/"
    page.wait(lambda: page.text("st-state") == "READY", "READY without a key")
    assert page.el("tenants-note").is_displayed() and "admin key" in page.text("tenants-note")

    # A wrong key: said so plainly, in the key line and in the status view.
    page.enter_key(WRONG_KEY)
    page.wait(lambda: "refused" in page.text("key-status"), "the wrong key to be refused")
    page.wait(lambda: page.el("status-message").is_displayed(), "the status message")
    assert "401" in page.text("status-message") and "refused" in page.text("status-message")
    page.shot("status-wrong-key.png")

    # The admin key: READY, the slot count, identity and per-tenant load.
    page.enter_key(d.admin_key)
    page.wait(lambda: "admin scope" in page.text("key-status"), "the admin key to be accepted")
    page.wait(lambda: page.text("st-slots") == "0 / 2", "slots 0 / 2")
    assert page.text("st-state") == "READY"
    assert not page.el("status-message").is_displayed()
    page.wait(lambda: page.text("id-model-sha") == d.config["llama"]["model"]["sha256"], "the model sha256")
    identity = d.admin_identity()
    assert page.text("id-binary-sha") == identity["binary"]["sha256"]
    assert page.text("id-commit") == identity["llama_cpp"]["commit"]
    assert "version" in page.text("id-version")
    assert page.text("id-slots") == "2"
    page.wait(lambda: page.rows("tenants-body") == [["default", "0 / 1", "0 / 0"]], "the tenant table")
    # The key stays in the tab's sessionStorage: not in the URL, not in a cookie.
    assert d.admin_key not in browser.current_url and browser.get_cookies() == []
    assert browser.execute_script("return sessionStorage.getItem('llamagate.key')") == d.admin_key
    page.shot("status.png")

    # The playground: a short answer streams in, with its figures.
    page.el("tab-playground").click()
    page.wait(lambda: page.el("pg-model").get_attribute("value") == MODEL, "the model list")
    page.type_into("pg-system", "You are terse.")
    page.ask("Once upon a time", 24)
    assert 0 < int(page.text("pg-completion-tokens")) <= 24
    assert int(page.text("pg-prompt-tokens")) > 0
    assert re.fullmatch(r"\d+\.\d", page.text("pg-rate")), page.text("pg-rate")
    # A conversation: two more turns, each request carrying the system prompt and every earlier turn.
    page.ask("And then what happened?", 16)
    page.ask("Give the story a title.", 16)
    assert page.turns() == 3
    assert re.fullmatch(r"\d+", page.text("pg-cached-tokens")), page.text("pg-cached-tokens")  # admin key
    bodies = page.chat_bodies()
    assert [len(b["messages"]) for b in bodies] == [2, 4, 6]
    second = bodies[1]["messages"]
    assert second[0] == {"role": "system", "content": "You are terse."}
    assert second[1] == {"role": "user", "content": "Once upon a time"}
    assert second[2]["role"] == "assistant" and second[2]["content"].strip()
    assert second[3] == {"role": "user", "content": "And then what happened?"}
    assert bodies[2]["messages"][:4] == second and bodies[2]["messages"][4]["role"] == "assistant"
    page.shot("playground.png")

    # A long answer: text grows while it is generated (streamed), then Stop frees the slot.
    page.type_into("pg-prompt", "Tell a long story about the sea.")
    page.type_into("pg-max-tokens", "3000")
    page.el("pg-send").click()
    page.wait(
        lambda: len(page.text("pg-output")) > 0 and page.text("pg-state") == "generating…", "first text"
    )
    first = len(page.text("pg-output"))
    page.wait(lambda: len(page.text("pg-output")) > first, "more text while generating", timeout=120)
    assert page.text("pg-state") == "generating…"
    wait_until(lambda: any(page.slots_busy()), "a busy slot in /slots", timeout=30)
    page.el("pg-stop").click()
    page.wait(lambda: page.text("pg-state") == "stopped", "the stopped state")
    assert page.el("pg-send").is_enabled() and not page.el("pg-stop").is_enabled()
    # The stopped answer stays in the conversation, marked; Clear empties it.
    assert page.turns() == 4 and "stopped" in str(
        page.el("pg-output").find_element("xpath", "..").get_attribute("class")
    )
    page.el("pg-clear").click()
    assert page.turns() == 0
    wait_until(lambda: not any(page.slots_busy()), "every slot free in /slots after Stop", timeout=60)
    page.el("tab-status").click()
    page.wait(lambda: page.text("st-slots") == "0 / 2", "the status view to show the slot freed")
    page.wait(
        lambda: page.rows("tenants-body") == [["default", "0 / 1", "0 / 0"]], "the tenant's permit back"
    )

    # 429: another client holds the tenant's only permit; the page shows the message and Retry-After.
    page.el("tab-playground").click()
    release = threading.Event()
    holding = threading.Event()

    def hold_the_permit() -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell a long story"}],
            "max_tokens": 3000,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {d.inference_key}"}
        with (
            httpx.Client(timeout=120, trust_env=False) as client,
            client.stream("POST", f"{origin}/v1/chat/completions", json=body, headers=headers) as r,
        ):
            for _ in r.iter_lines():
                holding.set()
                if release.is_set():
                    return

    holder = threading.Thread(target=hold_the_permit, daemon=True)
    holder.start()
    try:
        assert holding.wait(120), "the other client's stream did not start"
        page.type_into("pg-prompt", "hello")
        page.type_into("pg-max-tokens", "8")
        page.el("pg-send").click()
        page.wait(lambda: page.text("pg-state") == "refused (429)", "the 429")
        message = page.text("pg-message")
        assert message.startswith("429: ") and re.search(r"retry after \d+ s$", message), message
        page.shot("playground-429.png")
    finally:
        release.set()
        holder.join(60)
    assert not holder.is_alive()
    wait_until(lambda: not any(page.slots_busy()), "every slot free at the end", timeout=60)

    page.collect_logs()
    sent = [m["params"] for m in page.network if m["method"] == "Network.requestWillBeSent"]
    # The browser's own pages (the new-tab page it starts on) log here too; they are not the page's.
    browser_own = [r for r in sent if not r["documentURL"].startswith(origin + "/")]
    # Chromium's own documents. Its new-tab page also loads parts under chrome-untrusted:// and
    # chrome-search://; a CI run failed on a document outside chrome://, about: and data: that the
    # truncated message did not name, so the message now lists only the documents that are not its own.
    own_schemes = ("chrome://", "chrome-untrusted://", "chrome-search://", "devtools://", "about:", "data:")
    foreign = [
        (r["documentURL"], r["request"]["url"])
        for r in browser_own
        if not r["documentURL"].startswith(own_schemes)
    ]
    assert foreign == [], foreign
    requests = [r for r in sent if r["documentURL"].startswith(origin + "/")]
    urls = [r["request"]["url"] for r in requests]
    assert any(u.endswith("/ui/app.js") for u in urls) and any(u.endswith("/admin/load") for u in urls)
    off_origin = [u for u in urls if not u.startswith(origin + "/")]
    assert off_origin == [], f"the page requested something off its origin: {off_origin}"
    assert not any(
        "Authorization" in r["request"].get("headers", {}) and "/ui/" in r["request"]["url"] for r in requests
    ), "a static file was requested with the key"

    problems = [
        e["message"]
        for e in page.console
        if re.search(r"Content Security Policy|Refused to|TrustedHTML|Uncaught", e["message"])
    ]
    assert problems == [], problems

    # The keys the page sent never reached the daemon's log (its access log names the key id only).
    log = d.log_text()
    assert "/admin/load" in log and d.admin_key not in log and WRONG_KEY not in log

    # Status polls never overlap: each /readyz starts after the previous one ended.
    ended = {
        m["params"]["requestId"]: m["params"]["timestamp"]
        for m in page.network
        if m["method"] in ("Network.loadingFinished", "Network.loadingFailed")
    }
    polls = sorted(
        (r["timestamp"], ended.get(r["requestId"]))
        for r in requests
        if r["request"]["url"].endswith("/readyz")
    )
    assert len(polls) >= 3
    for (_, previous_end), (start, _) in itertools.pairwise(polls):
        assert previous_end is not None and start >= previous_end, polls


def test_the_status_view_shows_each_tenants_tokens_today_from_the_ledger(
    daemon_factory: DaemonFactory, browser: Any, screenshots: Path, tmp_path: Path
) -> None:
    d = daemon_factory({"store": {"path": str(tmp_path / "state" / "llamagate.db")}})
    answer = httpx.post(
        f"{d.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {d.inference_key}"},
        timeout=120,
        trust_env=False,
    )
    answer.raise_for_status()
    tokens = answer.json()["usage"]["total_tokens"]
    page = Page(browser, d, screenshots)
    browser.get(d.base_url + "/ui/")
    page.enter_key(d.admin_key)
    # The ledger writes within a second, the page polls every 3 s: the tenant's tokens today appear.
    page.wait(
        lambda: page.rows("tenants-body") == [["default", "0 / 2", "0 / 8", str(tokens)]],
        "the tenant's tokens today",
    )
    assert page.el("tenants-tokens").is_displayed() and page.text("tenants-tokens") == "tokens today"
    page.shot("status-tokens-today.png")


def test_each_model_of_a_several_model_daemon_in_chromium(
    daemon_factory: DaemonFactory, browser: Any, screenshots: Path
) -> None:
    # "chat" loaded (always); "embed" on_demand and unloaded, with an idle time far beyond the test: only
    # a request could load it, and the page must never send one. "embed" comes first in the config, so
    # the playground must pick the loaded model, not the first one.
    config = two_models(daemon_factory, residency="on_demand", idle_unload_s=3600)
    config["models"].reverse()
    # The long answer below must still be running when the page's next refresh looks (every 3 s):
    # SmolLM2 may end "a long story" in a few seconds, so "chat" ignores end-of-generation and has the
    # room to run on until Stop.
    chat_model = next(m for m in config["models"] if m["name"] == "chat")
    chat_model.update(ctx_per_slot=4096, extra_args=["--ignore-eos"])
    d = daemon_factory(config)
    page = Page(browser, d, screenshots)
    origin = d.base_url

    def models() -> dict[str, list[str]]:
        # model name (before " (also ...)") -> its row's cells
        return {cells[0].split(" ")[0]: cells for cells in page.rows("models-body")}

    def row(name: str) -> list[str]:
        return models().get(name, [])

    def embed_unloaded() -> bool:
        code, body = d.readyz()
        unloaded = code == 200 and body["models"]["embed"]["state"] == "UNLOADED"
        return unloaded and child_pid(d, "embed") is None

    # Without a key: each model from /readyz, its state, residency and slots.
    browser.get(origin + "/ui/")
    page.wait(lambda: set(models()) == {"chat", "embed"}, "a row per model without a key")
    assert page.el("models").is_displayed()
    chat, embed = row("chat"), row("embed")
    assert chat[:6] == ["chat (also chat-alias)", "loaded (READY)", "always", "0 / 1", "0", "0"], chat
    assert chat[7] == "\u2013", chat  # no reason while ready: the page's dash
    assert embed[:5] == ["embed", "unloaded (UNLOADED)", "on_demand", "0 / 1", "0"], embed
    assert embed[7].startswith("not loaded: on_demand"), embed
    assert page.text("st-slots") == "0 / 2 (every model)"
    assert page.text("child-title") == "Daemon (every model)"

    # The admin key: each model's gate from /admin/load; the unloaded model stays unloaded while the
    # page polls round after round.
    page.enter_key(d.admin_key)
    page.wait(lambda: "admin scope" in page.text("key-status"), "the admin key to be accepted")
    rounds = int(page.dataset("pollRounds"))
    page.wait(lambda: int(page.dataset("pollRounds")) >= rounds + 3, "three admin rounds", timeout=90)
    assert row("embed")[1:4] == ["unloaded (UNLOADED)", "on_demand", "0 / 1"], row("embed")
    assert page.text("st-slots") == "0 / 2 (every model)"
    assert page.text("identity-title") == "Identity (default model)"
    assert page.text("id-slots") == "1"  # the default model's own, "chat"
    assert embed_unloaded(), "the page loaded the on_demand model"
    page.shot("status-models.png")

    # The playground: both models offered, the loaded chat model chosen; its answer streams in.
    page.el("tab-playground").click()
    options = "return [...document.getElementById('pg-model').options].map(o => [o.value, o.textContent])"
    page.wait(lambda: len(browser.execute_script(options)) == 2, "the model select")
    assert browser.execute_script(options) == [
        ["embed", "embed (embeddings, unloaded)"],
        ["chat", "chat (loaded)"],
    ]
    assert page.el("pg-model").get_attribute("value") == "chat"
    page.ask("Once upon a time", 24)
    page.shot("playground-models.png")

    # A long answer holds the chat model's slot: its row says so, and Stop gives it back.
    page.type_into("pg-prompt", "Tell a long story about the sea.")
    page.type_into("pg-max-tokens", "3000")
    page.el("pg-send").click()
    page.wait(lambda: page.text("pg-state") == "generating…", "generating")
    page.wait(lambda: row("chat")[3] == "1 / 1", "the chat model's slot busy in its row")
    assert row("embed")[3] == "0 / 1"
    page.el("pg-stop").click()
    page.wait(lambda: page.text("pg-state") == "stopped", "the stopped state")
    page.wait(lambda: row("chat")[3] == "0 / 1", "the chat model's slot free again in its row")
    assert embed_unloaded(), "the on_demand model was loaded"

    page.collect_logs()
    sent = [m["params"] for m in page.network if m["method"] == "Network.requestWillBeSent"]
    requests = [r["request"] for r in sent if r["documentURL"].startswith(origin + "/")]
    urls = [r["url"] for r in requests]
    assert any(u.endswith("/admin/load") for u in urls)
    assert [u for u in urls if not u.startswith(origin + "/")] == []
    # No /slots?model= (an unloaded model's answers 503); the page's only POSTs are the two chats, to "chat".
    assert not any("/slots?" in u for u in urls), urls
    posts = [r for r in requests if r["method"] != "GET"]
    assert [r["url"] for r in posts] == [origin + "/v1/chat/completions"] * 2, posts
    assert all(json.loads(r["postData"])["model"] == "chat" for r in posts)
    problems = [
        e["message"]
        for e in page.console
        if re.search(r"Content Security Policy|Refused to|TrustedHTML|Uncaught", e["message"])
    ]
    assert problems == [], problems


@contextmanager
def proxy_in_thread(
    settings: ProxySettings,
    source: StaticSource,
    models: Sequence[ModelEntry] = (),
    wrap: Callable[[ASGIApp], ASGIApp] | None = None,
) -> Iterator[str]:
    """The proxy app on a real port in a thread of its own (the browser test itself is synchronous);
    with ``models``, a several-model proxy routing to them, as the daemon sets it up; ``wrap``: a fake
    put in front of the app (a stand-in whose answers the test scripts)."""
    app: ASGIApp = create_app(settings, source, models or one_model(source))
    if wrap is not None:
        app = wrap(app)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="proxy", daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "the proxy to listen", timeout=30)
    assert server.started
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive()


def test_messages_for_each_daemon_state_and_key_scope(browser: Any, screenshots: Path) -> None:
    """The fault paths, with a fake upstream source: FAILED, draining, not ready, a key without the
    admin scope, one without the inference scope, a 503 in the playground, and the daemon gone."""
    keys, entries = {}, []
    for name, scopes in (("inference", {"inference"}), ("admin_only", {"admin"})):
        keys[name], entry = new_key("default", frozenset(scopes))  # type: ignore[arg-type]
        entries.append(entry)
    settings = ProxySettings(tenants=(TenantSettings("default"),), keys=tuple(entries))
    source = StaticSource(snapshot_for(None, None, slots=4))
    with proxy_in_thread(settings, source) as origin:
        page = Page(browser, None, screenshots)
        source.update(state="FAILED", ready=False, reason="5 restarts within 300 s; last: exited with code 1")
        browser.get(origin + "/ui/")
        page.wait(lambda: page.text("st-state") == "FAILED", "FAILED")
        assert "bad" in str(page.el("st-state").get_attribute("class"))
        message = page.text("status-message")
        assert "FAILED" in message and "5 restarts within 300 s" in message, message
        page.shot("status-failed.png")

        source.update(state="READY", ready=False, reason="draining: the daemon is stopping")
        page.wait(lambda: "draining" in page.text("status-message"), "the draining message")

        source.update(state="BACKOFF", ready=False, reason="exited with signal 9", retry_after_s=3.2)
        page.wait(lambda: page.text("st-state") == "BACKOFF", "BACKOFF")
        message = page.text("status-message")
        assert "exited with signal 9" in message and "retry after 4 s" in message, message

        # An inference key: the public figures, and a plain note where admin data would be.
        page.enter_key(keys["inference"])
        page.wait(lambda: "no admin scope" in page.text("key-status"), "the no-admin note")
        assert "admin scope" in page.text("tenants-note") and page.el("tenants-note").is_displayed()
        assert page.text("st-slots") == "0 / 4"

        # The playground while the child is not ready: 503 with its Retry-After.
        source.update(
            state="STARTING",
            ready=False,
            reason="loading model",
            retry_after_s=7,
            progress=0.4,
            load_eta_s=3.0,
        )
        # The one model's load: its bar and time left in the child's card.
        page.wait(
            lambda: page.text("st-load") == "loading: 40 % \u00b7 about 3.0 s left", "the load progress"
        )
        assert page.el("st-load-bar").is_displayed() and page.el("st-load-bar").get_attribute("value") == "40"
        page.el("tab-playground").click()
        page.type_into("pg-prompt", "hello")
        page.el("pg-send").click()
        page.wait(lambda: page.text("pg-state") == "refused (503)", "the 503")
        message = page.text("pg-message")
        assert message.startswith("503: ") and "loading model" in message, message
        assert message.endswith("retry after 7 s"), message
        page.shot("playground-503.png")

        # An admin-only key cannot use the playground, and is told so.
        page.enter_key(keys["admin_only"])
        page.wait(lambda: "no inference scope" in page.text("pg-message"), "the no-inference message")
        page.el("tab-status").click()
        page.wait(lambda: "admin scope" in page.text("key-status"), "the admin-only key accepted for status")

        # Forget key: gone from the tab's storage, and the page says so.
        page.el("key-forget").click()
        page.wait(lambda: page.text("key-status").startswith("No key entered"), "the key forgotten")
        assert browser.execute_script("return sessionStorage.length") == 0

        # A hidden tab polls nothing; shown again, it polls at once.
        page.wait(lambda: page.dataset("pollDelayMs") == "3000", "the normal pace")
        browser.execute_script(HIDE_TAB, True)
        page.wait(lambda: page.dataset("polling") == "paused", "polling paused")
        rounds = page.dataset("pollRounds")
        time.sleep(7)  # two and more polling intervals: proving an absence takes waiting
        assert page.dataset("pollRounds") == rounds
        browser.execute_script(HIDE_TAB, False)
        page.wait(lambda: page.dataset("pollRounds") != rounds, "a poll as soon as the tab shows again")

    # The daemon is gone: said so, and the page keeps trying, less and less often.
    page.wait(lambda: page.text("st-state") == "unreachable", "unreachable")
    assert "does not answer" in page.text("status-message")
    page.wait(lambda: int(page.dataset("pollDelayMs")) >= 6000, "the polls to back off")
    page.collect_logs()
    problems = [
        e["message"]
        for e in page.console
        if re.search(r"Content Security Policy|Refused to|Uncaught", e["message"])
    ]
    assert problems == [], problems


def test_each_models_failure_and_load_with_a_fake_several_model_proxy(
    browser: Any, screenshots: Path
) -> None:
    """The states a real daemon cannot be asked to show on cue: one of two models FAILED, then loading."""
    settings = ProxySettings(tenants=(TenantSettings("default"),))
    chat = StaticSource(snapshot_for(None, None, slots=1, model_alias="chat"))
    embed = StaticSource(snapshot_for(None, None, slots=1, model_alias="embed"))
    daemon = StaticSource(snapshot_for(None, None, slots=1, model_alias="chat"))
    models = [ModelEntry("chat", ("chat",), chat), ModelEntry("embed", ("embed",), embed)]
    with proxy_in_thread(settings, daemon, models) as origin:
        page = Page(browser, None, screenshots)

        def row(name: str) -> list[str]:
            return next((cells for cells in page.rows("models-body") if cells[0] == name), [])

        def state_class(name: str) -> str:
            script = (
                "return document.querySelector(`#models-body tr[data-model='${arguments[0]}']`)"
                ".cells[1].className"
            )
            return str(browser.execute_script(script, name))

        failure = "5 restarts within 300 s; last: exited with code 1"
        embed.update(state="FAILED", ready=False, reason=failure)
        daemon.update(state="FAILED", ready=False, reason=f"not ready: 'embed' (FAILED: {failure})")
        browser.get(origin + "/ui/")
        page.wait(lambda: row("embed")[1:2] == ["failed (FAILED)"], "the failed model's row")
        assert row("embed")[7] == failure and "bad" in state_class("embed")
        assert row("chat")[1] == "loaded (READY)" and "ok" in state_class("chat")
        assert "'embed'" in page.text("status-message") and "FAILED" in page.text("status-message")
        page.shot("status-models-failed.png")

        embed.update(state="STARTING", ready=False, reason="loading model")
        page.wait(lambda: row("embed")[1:2] == ["loading (STARTING)"], "the loading model's row")
        assert row("embed")[7] == "loading model" and "warn" in state_class("embed")


# Records every change of a models-table row (its state and its load bar) in the page, as it happens:
# the test reads the list afterwards, so no change between two of its polls is missed.
WATCH_ROW = """
const tr = document.querySelector(`#models-body tr[data-model='${arguments[0]}']`);
window.rowLog = [];
const note = () => {
  const bar = tr.cells[8].querySelector("progress");
  const entry = [tr.cells[1].textContent, bar.hidden ? null : bar.value, tr.cells[8].textContent];
  const last = window.rowLog[window.rowLog.length - 1];
  if (!last || last.join("|") !== entry.join("|")) window.rowLog.push(entry);
};
note();
const changes = {subtree: true, childList: true, characterData: true, attributes: true};
new MutationObserver(note).observe(tr, changes);
"""


def console_problems(page: Page) -> list[str]:
    page.collect_logs()
    return [
        e["message"]
        for e in page.console
        if re.search(r"Content Security Policy|Refused to|TrustedHTML|Uncaught", e["message"])
    ]


def page_actions(page: Page, origin: str) -> list[tuple[str, str]]:
    """Every request the page made that is not a GET: (method, path)."""
    page.collect_logs()
    sent = [m["params"] for m in page.network if m["method"] == "Network.requestWillBeSent"]
    requests = [r["request"] for r in sent if r["documentURL"].startswith(origin + "/")]
    return [
        (r["method"], r["url"].removeprefix(origin))
        for r in requests
        if r["method"] not in ("GET", "OPTIONS")
    ]


def test_load_progress_buttons_refusals_and_requests_with_a_fake_several_model_proxy(
    browser: Any, screenshots: Path
) -> None:
    """The model buttons, the load bar on cue (every step, with and without an estimate), a refusal
    shown with its reason, and the requests table with Cancel against a stand-in of GET/DELETE
    /admin/requests that lists rows on cue (the real routes are driven by the test against the real
    daemon below)."""
    admin_key, entry = new_key("default", frozenset({"admin", "inference"}))
    settings = ProxySettings(tenants=(TenantSettings("default"),), keys=(entry,))
    chat = StaticSource(snapshot_for(None, None, slots=1, model_alias="chat"))
    embed = StaticSource(snapshot_for(None, None, slots=1, model_alias="embed"))
    daemon = StaticSource(snapshot_for(None, None, slots=1, model_alias="chat"))
    models = [
        ModelEntry("chat", ("chat",), chat),
        ModelEntry("embed", ("embed",), embed, residency="on_demand"),
    ]
    listed = [
        {
            "id": "req-run",
            "tenant": "default",
            "key_id": "0123456789ab",
            "model": "chat",
            "route": "/v1/chat/completions",
            "state": "running",
            "waited_s": 0.2,
            "running_s": 12.5,
            "tokens": 431,
        },
        {
            "id": "req-queued",
            "tenant": "batch",
            "key_id": "ba7c0123ab45",
            "model": "chat",
            "route": "/v1/completions",
            "state": "queued",
            "waited_s": 3.1,
            "running_s": None,
            "tokens": 0,
        },
    ]
    fake: list[RequestsApi] = []

    def wrap(app: ASGIApp) -> ASGIApp:
        fake.append(RequestsApi(app, admin_key, listed))
        return fake[0]

    embed.update(state="UNLOADED", ready=False, reason="not loaded: on_demand", progress=None)
    with proxy_in_thread(settings, daemon, models, wrap) as origin:
        page = Page(browser, None, screenshots)

        def row(name: str) -> list[str]:
            return next((cells for cells in page.rows("models-body") if cells[0] == name), [])

        def button(name: str, action: str) -> Any:
            from selenium.webdriver.common.by import By

            css = f"#models-body tr[data-model='{name}'] button[data-action='{action}']"
            return browser.find_element(By.CSS_SELECTOR, css)

        def bar(name: str) -> tuple[bool, int]:
            script = (
                "const b = document.querySelector(`#models-body tr[data-model='${arguments[0]}'] progress`);"
                "return [b.hidden, b.value];"
            )
            hidden, value = browser.execute_script(script, name)
            return bool(hidden), int(value)

        browser.get(origin + "/ui/")
        # Without a key: no buttons, and the requests and charts need an admin key.
        page.wait(lambda: row("embed")[1:2] == ["unloaded (UNLOADED)"], "the unloaded model's row")
        assert not button("embed", "load").is_displayed() and not button("embed", "unload").is_displayed()
        assert page.text("requests-note") == "Needs an admin key." and not page.el("charts").is_displayed()

        page.enter_key(admin_key)
        page.wait(lambda: "admin scope" in page.text("key-status"), "the admin key to be accepted")
        page.wait(lambda: button("embed", "load").is_displayed(), "the Load button")
        # The always model: no Load, an Unload that is disabled and says why.
        assert not button("chat", "load").is_displayed()
        unload_chat = button("chat", "unload")
        assert unload_chat.is_displayed() and not unload_chat.is_enabled()
        assert "residency 'always'" in str(unload_chat.get_attribute("title"))
        assert "always loaded" in row("chat")[9]
        assert button("embed", "load").is_enabled() and not button("embed", "unload").is_enabled()
        assert bar("embed")[0] and row("embed")[8].startswith("\u2013")

        # A load on cue: the bar follows /admin/models, with its estimate, its step, then 100 % at READY.
        browser.execute_script(WATCH_ROW, "embed")
        embed.update(
            state="STARTING", reason="loading model", progress=0.2, load_step="health", load_eta_s=None
        )
        page.wait(lambda: bar("embed") == (False, 20), "the bar at 20 %")
        assert "20 % \u00b7 no estimate yet (first load of this file)" in row("embed")[8], row("embed")
        assert not button("embed", "load").is_enabled()
        embed.update(progress=0.55, load_eta_s=2.5)
        page.wait(lambda: bar("embed") == (False, 55), "the bar at 55 %")
        assert "55 % \u00b7 about 2.5 s left" in row("embed")[8], row("embed")
        embed.update(progress=0.95, load_step="decode", load_eta_s=0.1)
        page.wait(lambda: bar("embed") == (False, 95), "the bar at 95 %")
        assert "(decode check)" in row("embed")[8], row("embed")
        page.shot("status-models-loading.png")
        embed.update(state="READY", ready=True, reason="ready", progress=1.0, load_step=None, load_eta_s=None)
        page.wait(lambda: row("embed")[1] == "loaded (READY)", "READY")
        assert bar("embed") == (False, 100) and "100 % \u00b7 loaded" in row("embed")[8]
        log = browser.execute_script("return window.rowLog")
        shown = [value for _, value, _ in log if value is not None]
        assert shown == sorted(shown) and shown[-1] == 100 and {20, 55, 95} <= set(shown), log
        # Then the bar goes away; Unload is offered, Load is not.
        page.wait(lambda: bar("embed")[0], "the bar to hide after the load", timeout=30)
        assert button("embed", "unload").is_enabled() and not button("embed", "load").is_enabled()

        # A refusal, with the API's reason: this fake's models cannot be loaded by an operator (409).
        embed.update(state="UNLOADED", ready=False, reason="not loaded: on_demand", progress=None)
        page.wait(lambda: button("embed", "load").is_enabled(), "Load offered again")
        button("embed", "load").click()
        page.wait(lambda: page.el("models-message").is_displayed(), "the refusal")
        message = page.text("models-message")
        assert message.startswith("Load of 'embed' refused (409: ") and "cannot be loaded" in message, message
        assert "bad" in str(page.el("models-message").get_attribute("class"))

        # The requests, each with Cancel: the queued one is cancelled; one that finished meanwhile is a 404.
        page.wait(lambda: len(page.rows("requests-body")) == 2, "the requests table")
        rows = page.rows("requests-body")
        assert rows[0][:9] == [
            "req-run",
            "default",
            "0123456789ab",
            "chat",
            "/v1/chat/completions",
            "running",
            "0.2 s",
            "12.5 s",
            "431",
        ], rows
        assert rows[1][:9] == [
            "req-queued",
            "batch",
            "ba7c0123ab45",
            "chat",
            "/v1/completions",
            "queued",
            "3.1 s",
            "\u2013",
            "0",
        ], rows
        from selenium.webdriver.common.by import By

        def cancel(request_id: str) -> None:
            css = f"#requests-body tr[data-request='{request_id}'] button"
            browser.find_element(By.CSS_SELECTOR, css).click()

        cancel("req-queued")
        page.wait(lambda: fake[0].cancelled == ["req-queued"], "the DELETE")
        page.wait(lambda: [r[0] for r in page.rows("requests-body")] == ["req-run"], "the cancelled row gone")
        assert (
            page.text("requests-message")
            == "Request req-queued cancelled: its client gets an error saying so."
        )
        page.shot("status-requests.png")
        fake[0].finished.add("req-run")
        cancel("req-run")
        page.wait(lambda: "already finished" in page.text("requests-message"), "the 404 said plainly")
        assert "404: no queued or running request has the id 'req-run'" in page.text("requests-message")
        page.wait(lambda: page.text("requests-note") == "No request is queued or running.", "an empty list")
        assert not page.el("requests").is_displayed()

        # The page's only actions were the person's clicks.
        assert page_actions(page, origin) == [
            ("POST", "/admin/models/embed/load"),
            ("DELETE", "/admin/requests/req-queued"),
            ("DELETE", "/admin/requests/req-run"),
        ]
        assert console_problems(page) == []


# The chart's baseline in the SVG's coordinates (charts.js: H - 2): a point above it is a value above 0.
CHART_BASE = 118.0


def chart_values(page: Page, chart_id: str, model: str, series: str) -> list[float]:
    """The heights above 0 of one model's line in a chart, read from its SVG path (empty: nothing drawn)."""
    script = (
        "const p = [...document.querySelectorAll(`#${arguments[0]} path[data-model]`)]"
        ".find(e => e.dataset.model === arguments[1] && e.dataset.series === arguments[2]);"
        "return p ? p.getAttribute('d') : '';"
    )
    d = str(page.driver.execute_script(script, chart_id, model, series) or "")
    ys = [float(y) for y in re.findall(r"[ML][\d.]+ ([\d.]+)", d)]
    return [round(CHART_BASE - y, 1) for y in ys]


def drawn(page: Page, chart_id: str, series: str, model: str = "chat") -> bool:
    return max(chart_values(page, chart_id, model, series), default=0) > 0


# Every chart's lines of the history (charts.js): chart, series.
HISTORY_LINES = (
    ("ch-tps", "tokens"),
    ("ch-rps", "requests"),
    ("ch-ttft", "p50"),
    ("ch-ttft", "p95"),
    ("ch-tpot", "tpot"),
)


def chat_traffic(d: Daemon, stop: threading.Event, errors: list[BaseException]) -> None:
    """One client sending streamed chat requests to "chat" until ``stop``: real traffic for the charts."""
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": "Tell me about llamas."}],
        "max_tokens": 48,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {d.inference_key}"}
    try:
        with httpx.Client(timeout=180, trust_env=False) as client:
            while not stop.is_set():
                with client.stream(
                    "POST", f"{d.base_url}/v1/chat/completions", json=body, headers=headers
                ) as r:
                    assert r.status_code == 200, r.read()
                    for _ in r.iter_lines():
                        pass
    except BaseException as exc:
        errors.append(exc)


def test_unload_load_with_progress_and_charts_from_real_traffic_in_chromium(
    daemon_factory: DaemonFactory, browser: Any, screenshots: Path
) -> None:
    """Against the real two-model daemon: Unload then Load of the on_demand model from its buttons, the
    load bar seen rising to 100 % before the row says READY (from the real progress the daemon reads from
    the child), with an estimate (the preload was the first load of the file); then real chat traffic
    and the history's charts drawn from it (tokens and requests per second, TTFT p50/p95, TPOT, running and
    queued), also in a page opened after the traffic; a screenshot of it all (docs/img/ui-status.png
    comes from it)."""
    d = daemon_factory(
        {
            "llama": {"prompt_cache_mib": 0, "ctx_checkpoints": 0},
            "tenants": [{"name": "default", "max_concurrency": 4, "max_queue": 8}],
            "models": [
                model(daemon_factory, "chat", aliases=["chat-alias"]),
                model(
                    daemon_factory,
                    "embed",
                    embeddings=True,
                    extra_args=["--pooling", "mean"],
                    residency="on_demand",
                    preload=True,
                    idle_unload_s=3600,
                ),
            ],
        }
    )
    d.wait_for(lambda code, b: b["models"]["embed"]["state"] == "READY", "the preloaded model")
    pid = child_pid(d, "embed")
    assert pid is not None
    page = Page(browser, d, screenshots)
    origin = d.base_url

    def row(name: str) -> list[str]:
        return next((cells for cells in page.rows("models-body") if cells[0].split(" ")[0] == name), [])

    def button(name: str, action: str) -> Any:
        from selenium.webdriver.common.by import By

        css = f"#models-body tr[data-model='{name}'] button[data-action='{action}']"
        return browser.find_element(By.CSS_SELECTOR, css)

    browser.get(origin + "/ui/")
    page.enter_key(d.admin_key)
    page.wait(lambda: "admin scope" in page.text("key-status"), "the admin key to be accepted")
    page.wait(lambda: row("embed")[1:2] == ["loaded (READY)"], "the preloaded model's row")
    page.wait(lambda: button("embed", "unload").is_enabled(), "Unload offered")
    assert not button("chat", "unload").is_enabled()
    assert "residency 'always'" in str(button("chat", "unload").get_attribute("title"))

    # Unload: the child stops, the row says so.
    button("embed", "unload").click()
    page.wait(lambda: row("embed")[1:2] == ["unloaded (UNLOADED)"], "the unloaded row", timeout=90)
    page.wait(lambda: page.text("models-message").startswith("Unload of 'embed': done"), "the unload done")
    wait_until(lambda: process_gone(pid), "the unloaded model's child to exit", timeout=60)
    assert child_pid(d, "embed") is None

    # Load: every change of the row is recorded in the page as it happens, then read back.
    page.wait(lambda: button("embed", "load").is_enabled(), "Load offered")
    browser.execute_script(WATCH_ROW, "embed")
    button("embed", "load").click()
    page.wait(lambda: row("embed")[1:2] == ["loaded (READY)"], "READY after the load", timeout=180)
    page.wait(lambda: page.text("models-message").startswith("Load of 'embed': done"), "the load done")
    log = browser.execute_script("return window.rowLog")
    loading = [e for e in log if e[0] == "loading (STARTING)"]
    assert loading, log  # the page saw the load in progress
    shown = [value for _, value, _ in log if value is not None]
    assert shown == sorted(shown), log  # the bar never went back
    assert any(value < 100 for _, value, _ in loading if value is not None), log
    ready_at = next(i for i, e in enumerate(log) if e[0] == "loaded (READY)")
    assert log[ready_at][1] == 100 and "100 % \u00b7 loaded" in log[ready_at][2], log
    assert all(e[1] is None or e[1] < 100 for e in log[:ready_at]), log
    # The preload was the first load of this file: this one has an estimate.
    assert any("left" in text for _, _, text in loading), log
    assert child_pid(d, "embed") is not None

    # Real traffic: three clients streaming to "chat" (one slot: some wait in its queue).
    stop = threading.Event()
    errors: list[BaseException] = []
    clients = [threading.Thread(target=chat_traffic, args=(d, stop, errors), daemon=True) for _ in range(3)]
    for t in clients:
        t.start()
    try:
        for chart, series in HISTORY_LINES:
            page.wait(lambda c=chart, s=series: drawn(page, c, s), f"{chart} {series} drawn", 180)
        page.wait(lambda: drawn(page, "ch-load", "running"), "running drawn", 120)
        page.wait(lambda: drawn(page, "ch-load", "queued"), "queued drawn", 120)
        legend = browser.execute_script(
            "return [...document.querySelectorAll('#charts-legend .key')].map(e => e.textContent)"
        )
        assert legend == ["chat", "embed"], legend
        page.wait(lambda: row("chat")[3] == "1 / 1", "the chat slot busy in its row", 60)
        # Half a minute of history for the picture (docs/img/ui-status.png), the whole page in view.
        page.wait(lambda: int(page.el("ch-ttft").get_attribute("data-points")) >= 4, "more history", 120)
        browser.set_window_size(1280, 1560)
        page.shot("status-traffic.png")
    finally:
        stop.set()
        for t in clients:
            t.join(180)
    assert errors == [] and not any(t.is_alive() for t in clients), errors
    assert int(page.el("ch-tps").get_attribute("data-points")) >= 2

    # The page's only actions were the two clicks; nothing it did loaded a model by itself.
    assert page_actions(page, origin) == [
        ("POST", "/admin/models/embed/unload"),
        ("POST", "/admin/models/embed/load"),
    ]
    assert console_problems(page) == []

    # A page opened after the traffic, in a new tab (no key, nothing sampled yet): it draws the same
    # traffic from the proxy's history, with nothing running now.
    browser.switch_to.new_window("tab")
    later = Page(browser, d, screenshots)
    browser.get(origin + "/ui/")
    later.enter_key(d.admin_key)
    later.wait(lambda: "admin scope" in later.text("key-status"), "the admin key in the new tab")
    for chart, series in HISTORY_LINES:
        later.wait(lambda c=chart, s=series: drawn(later, c, s), f"{chart} {series} drawn from the history")
    assert drawn(later, "ch-load", "running")
    admin = {"Authorization": f"Bearer {d.admin_key}"}
    load = httpx.get(f"{origin}/admin/load", headers=admin, timeout=10, trust_env=False)
    assert load.json()["in_flight"] == 0
    later.shot("status-traffic-later.png")
    assert console_problems(later) == []


def test_cancel_a_running_request_from_the_page_against_the_real_daemon(
    daemon_factory: DaemonFactory, browser: Any, screenshots: Path
) -> None:
    """The real GET/DELETE /admin/requests (issue 26, item 1; without them this test fails at its
    first assertion, naming the missing route). A long streamed answer shows in the
    requests table as running; its Cancel button stops it: the client's stream ends with an error event
    saying it was cancelled (no [DONE]), its slot is free again on /slots, and its row goes away."""
    d = daemon_factory({})
    admin = {"Authorization": f"Bearer {d.admin_key}"}
    listing = httpx.get(f"{d.base_url}/admin/requests", headers=admin, timeout=10, trust_env=False)
    assert listing.status_code == 200, (
        f"GET /admin/requests answered {listing.status_code}: the requests API (issue 26 item 1) is not here"
    )
    page = Page(browser, d, screenshots)
    browser.get(d.base_url + "/ui/")
    page.enter_key(d.admin_key)
    page.wait(lambda: page.text("requests-note") == "No request is queued or running.", "an empty list")

    lines: list[str] = []
    started = threading.Event()

    def long_answer() -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell a very long story"}],
            "max_tokens": 2000,
            # Running until cancelled, whatever the model's own idea of a long story: SmolLM2 may end
            # one in a few seconds, before the page's next refresh shows it running.
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {d.inference_key}"}
        with (
            httpx.Client(timeout=300, trust_env=False) as client,
            client.stream("POST", f"{d.base_url}/v1/chat/completions", json=body, headers=headers) as r,
        ):
            for line in r.iter_lines():
                started.set()
                lines.append(line)

    client = threading.Thread(target=long_answer, daemon=True)
    client.start()
    assert started.wait(120), "the stream did not start"
    page.wait(
        lambda: any(r[5] == "running" and r[4] == "/v1/chat/completions" for r in page.rows("requests-body")),
        "the running request in the table",
    )
    page.shot("status-request-running.png")
    from selenium.webdriver.common.by import By

    browser.find_element(By.CSS_SELECTOR, "#requests-body tr button").click()
    client.join(60)
    assert not client.is_alive(), "the stream did not end after Cancel"
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert "[DONE]" not in events, events[-3:]
    assert "error" in events[-1] and "cancel" in events[-1].lower(), events[-3:]
    page.wait(lambda: "cancelled" in page.text("requests-message"), "the page saying it cancelled")
    wait_until(lambda: not any(page.slots_busy()), "every slot free in /slots after Cancel", timeout=30)
    page.wait(lambda: page.text("requests-note") == "No request is queued or running.", "the row gone")
    assert page_actions(page, d.base_url)[0][0] == "DELETE"
    assert console_problems(page) == []


# An answer a page must never run or mark up: HTML, a script in a code block, markdown to format.
HOSTILE = (
    'Hello <img src=x onerror="window.__pwned=1"> and **bold** with `<b>inline</b>`\n\n'
    "```html\n<script>window.__pwned=2</script>\n```\n"
    "- first <i>item</i>\n- second"
)


def test_model_text_is_formatted_from_text_nodes_and_never_run_as_html(
    browser: Any, screenshots: Path
) -> None:
    """A fake child answers every chat with ``HOSTILE``: the page shows it formatted (paragraphs, a code
    block, a list, bold), builds every element itself, and the next turn sends the raw text back."""
    from selenium.webdriver.common.by import By

    from supervisor.child.spawn import popen_tied, stop_popen
    from tests.benchmarks.cli import python_env

    fake = popen_tied(
        [sys.executable, "-m", "tests.fakes.fake_llama", "--secret=s3cret", "--answer", HOSTILE],
        stdout=subprocess.PIPE,
        text=True,
        env=python_env(None),
    )
    try:
        assert fake.stdout is not None
        fake_url = fake.stdout.readline().split()[-1]
        key, entry = new_key("default", frozenset({"inference"}))
        settings = ProxySettings(tenants=(TenantSettings("default"),), keys=(entry,))
        with proxy_in_thread(settings, StaticSource(snapshot_for(fake_url, "s3cret"))) as origin:
            page = Page(browser, None, screenshots)
            browser.get(origin + "/ui/")
            page.enter_key(key)
            page.el("tab-playground").click()
            page.wait(lambda: bool(page.el("pg-model").get_attribute("value")), "the model list")
            page.ask("hello", 64)
            out = page.el("pg-output")
            assert browser.execute_script("return window.__pwned") is None
            assert out.find_elements(By.CSS_SELECTOR, "img, script, b, i") == []
            assert "<img src=x" in page.text("pg-output")  # shown as the characters it is
            assert [e.text for e in out.find_elements(By.CSS_SELECTOR, "strong")] == ["bold"]
            assert [
                e.get_attribute("textContent") for e in out.find_elements(By.CSS_SELECTOR, "p > code")
            ] == ["<b>inline</b>"]
            (code,) = out.find_elements(By.CSS_SELECTOR, "pre > code")
            assert code.get_attribute("textContent") == "<script>window.__pwned=2</script>"
            assert [
                li.get_attribute("textContent") for li in out.find_elements(By.CSS_SELECTOR, "ul > li")
            ] == [
                "first <i>item</i>",
                "second",
            ]
            page.shot("playground-formatting.png")
            page.ask("again", 64)
            second = page.chat_bodies()[1]["messages"]
            assert second == [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": HOSTILE},  # the model's raw text, as it came
                {"role": "user", "content": "again"},
            ]
            assert page.turns() == 2
            page.collect_logs()
            violations = [c for c in page.console if "Content Security Policy" in str(c.get("message"))]
            assert violations == []
    finally:
        stop_popen(fake, 5)
        if fake.stdout is not None:
            fake.stdout.close()
