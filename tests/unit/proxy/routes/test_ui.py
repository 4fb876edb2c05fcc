"""The page's static files: security headers on every answer, `proxy.ui: false`, nothing served from
outside the static folder, no inline code, and /admin/load. Through a real uvicorn port."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from proxy.routes.ui import CONTENT_SECURITY_POLICY, STATIC_DIR, static_files
from supervisor.config.load import load_config
from supervisor.config.proxy_settings import proxy_settings
from tests.fakes.fake_upstream import eventually
from tests.unit.proxy.conftest import ProxyFactory

# What the issue asks of every page response, directive by directive.
REQUIRED_CSP = {
    "default-src": "'none'",
    "script-src": "'self'",
    "style-src": "'self'",
    "connect-src": "'self'",
    "img-src": "'self'",
    "base-uri": "'none'",
    "form-action": "'none'",
    "frame-ancestors": "'none'",
}

PAGE_FILES = sorted(p.name for p in STATIC_DIR.iterdir() if p.is_file())


def csp_directives(header: str) -> dict[str, str]:
    out = {}
    for part in header.split(";"):
        name, _, value = part.strip().partition(" ")
        out[name] = value.strip()
    return out


def assert_page_headers(r: httpx.Response) -> None:
    assert csp_directives(r.headers["content-security-policy"]).items() >= REQUIRED_CSP.items(), r.headers
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "no-referrer"
    assert r.headers["x-frame-options"] == "DENY"


def test_the_folder_holds_the_page() -> None:
    assert {"index.html", "app.js", "style.css"} <= set(PAGE_FILES)
    assert "/ui/" in static_files()


async def test_every_static_answer_carries_the_security_headers(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client(None) as c:
        types = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
        for name in PAGE_FILES:
            r = await c.get(f"/ui/{name}")
            assert r.status_code == 200, name
            assert r.content == (STATIC_DIR / name).read_bytes()
            assert r.headers["content-type"].startswith(types[Path(name).suffix])
            assert_page_headers(r)
        r = await c.get("/ui/")
        assert r.status_code == 200 and r.content == (STATIC_DIR / "index.html").read_bytes()
        assert_page_headers(r)
        for path in ("/", "/ui"):
            r = await c.get(path)
            assert r.status_code == 307 and r.headers["location"] == "/ui/", path
            assert_page_headers(r)


async def test_ui_false_answers_404_everywhere_and_a_reload_applies_it(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(ui=False) as p, p.client(None) as c:
        for path in ("/", "/ui", "/ui/", *(f"/ui/{n}" for n in PAGE_FILES)):
            r = await c.get(path)
            assert r.status_code == 404, path
            assert r.json()["error"]["code"] == "not_found"
            assert "content-security-policy" not in r.headers
        p.state.reload(dataclasses.replace(p.settings, ui=True))
        assert (await c.get("/ui/")).status_code == 200
        p.state.reload(dataclasses.replace(p.settings, ui=False))
        assert (await c.get("/ui/app.js")).status_code == 404


def test_config_key_reaches_the_proxy(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("proxy:\n  ui: false\n")
    assert proxy_settings(load_config(path)).ui is False
    path.write_text("proxy:\n  port: 8081\n")
    assert proxy_settings(load_config(path)).ui is True


async def raw_get(url: str, target: str) -> tuple[int, bytes]:
    """One GET with the request target exactly as given (httpx would normalise dot segments)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    status = int(data.split(b" ", 2)[1])
    return status, data


@pytest.mark.parametrize(
    "target",
    [
        "/ui/../pyproject.toml",
        "/ui/../proxy/ui.py",
        "/ui/%2e%2e/ui.py",
        "/ui/..%2fui.py",
        "/ui/%2e%2e%2f%2e%2e%2fpyproject.toml",
        "/ui/..\\ui.py",
        "/ui//etc/passwd",
        "/ui/./app.js",
        "/ui/static/app.js",
        "/ui/ui.py",
        "/ui/__init__.py",
        "/static/app.js",
        "/ui/app.js/",
        "/ui/app.js%00.html",
    ],
)
async def test_nothing_outside_the_listed_files_is_served(proxy_factory: ProxyFactory, target: str) -> None:
    async with proxy_factory() as p:
        status, data = await raw_get(p.url, target)
        assert status in (400, 404), data[:300]
        assert b"import " not in data and b"[build-system]" not in data and b"root:" not in data


def test_only_plain_files_of_known_kinds_are_listed(tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("<p>hi</p>")
    (tmp_path / "notes.txt").write_text("not served")
    (tmp_path / "server.py").write_text("not served")
    (tmp_path / ".hidden.js").write_text("not served")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deep.js").write_text("not served")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.js"
    outside.write_text("secret")
    (tmp_path / "link.js").symlink_to(outside)
    assert sorted(static_files(tmp_path)) == ["/ui/", "/ui/index.html"]


class _Scan(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.problems: list[str] = []
        self.urls: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = dict(attrs)
        if tag == "style":
            self.problems.append("<style> element")
        for name, value in attrs:
            if name == "style" or name.startswith("on"):
                self.problems.append(f"inline {name}= on <{tag}>")
            if name in ("src", "href", "action") and value is not None:
                self.urls.append(value)
        if tag == "script":
            self._in_script = True
            if not names.get("src"):
                self.problems.append("inline <script>")
        if tag == "input" and "name" in names:
            self.problems.append("a named input (would be submitted in a URL)")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.problems.append("inline script text")


def test_the_page_has_no_inline_code_and_only_local_urls() -> None:
    scan = _Scan()
    scan.feed((STATIC_DIR / "index.html").read_text())
    assert scan.problems == []
    assert scan.urls and all(re.fullmatch(r"[a-z]+\.(js|css|svg)", u) for u in scan.urls), scan.urls


@pytest.mark.parametrize("name", [n for n in PAGE_FILES if n.endswith(".js")])
def test_scripts_use_no_html_sinks_no_eval_and_only_local_modules(name: str) -> None:
    text = (STATIC_DIR / name).read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "Function(",
        "localStorage",
        "document.cookie",
        "console.",
    ):
        assert sink not in code, f"{name} uses {sink}"
    imports = re.findall(r"""from\s+["']([^"']+)["']""", code)
    assert all(re.fullmatch(r"\./[a-z]+\.js", i) for i in imports), imports
    assert "http://" not in code and "https://" not in code


def test_policy_forbids_inline_code_and_eval() -> None:
    directives = csp_directives(CONTENT_SECURITY_POLICY)
    for name in ("script-src", "style-src"):
        assert "unsafe" not in directives[name]
    assert directives["require-trusted-types-for"] == "'script'"


async def test_admin_load_reports_each_tenant(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client("admin") as admin, p.client("user") as user:
        r = await admin.get("/admin/load")
        assert r.status_code == 200
        body = r.json()
        assert body["in_flight"] == 0 and body["queued"] == 0 and body["slots"] == 4
        by_name = {t["name"]: t for t in body["tenants"]}
        assert set(by_name) == {"team", "other", "ops"}
        assert by_name["team"] == {
            "name": "team",
            "in_flight": 0,
            "queued": 0,
            "max_concurrency": 4,
            "max_queue": 8,
            "max_concurrency_total": None,  # the shape of several models' daemon: one shape for both
        }
        assert (await user.get("/admin/load")).status_code == 403
        async with p.client(None) as anonymous:
            assert (await anonymous.get("/admin/load")).status_code == 401

        slow = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "fake_delay_ms": 60000}
        task = asyncio.create_task(user.post("/v1/chat/completions", json=slow))
        try:
            await eventually(lambda: p.state.in_flight == 1, 10.0)
            body = (await admin.get("/admin/load")).json()
            assert body["in_flight"] == 1
            assert {t["name"]: t["in_flight"] for t in body["tenants"]} == {"team": 1, "other": 0, "ops": 0}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_admin_load_counts_the_generation_requests_answered_and_their_tokens(
    proxy_factory: ProxyFactory,
) -> None:
    """The counters behind the page's requests and tokens per second: generation routes only (not the
    page's own polls, not counting routes), each answer's output tokens."""
    async with proxy_factory() as p, p.client("admin") as admin, p.client("user") as user:
        (name,) = p.state.router.lanes
        before = (await admin.get("/admin/load")).json()
        assert before["answered"] == {"requests": 0, "output_tokens": 0}
        tokens = 0
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        for _ in range(2):
            r = await user.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200
            tokens += r.json()["usage"]["completion_tokens"]
        assert tokens > 0
        assert (await user.post("/tokenize", json={"content": "hi"})).status_code == 200
        await admin.get("/readyz")
        body = (await admin.get("/admin/load")).json()
        assert body["answered"] == {"requests": 2, "output_tokens": tokens}
        assert body["models"][name]["answered"] == {"requests": 2, "output_tokens": tokens}
