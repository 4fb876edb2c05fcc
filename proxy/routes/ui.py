"""The page for people: a status view and a chat playground, as static files served at ``/ui/``.

The files live in ``proxy/routes/static`` (shipped as package data, no build step, nothing fetched from
any other host). They need no key: every figure the page shows comes from the API, with the key the
person enters (the page keeps it in ``sessionStorage`` and sends it only in ``Authorization``).

Path traversal cannot happen by construction: the files are read once, when the app is built, and each
becomes one exact route (``/ui/app.js``, ...). A path that is not one of them, ``/ui/../pyproject.toml``
or an encoded dot segment included, is an unknown route like any other and gets the usual 404; nothing is
resolved against the filesystem at request time.

Every answer here carries a strict Content-Security-Policy (scripts, styles and connections only from this
origin, no inline code, no eval, no framing) plus ``nosniff`` and ``no-referrer``. Model output is shown
with ``textContent`` only; Trusted Types ``'none'`` makes any HTML sink throw should one ever creep in.

``proxy.ui: false`` turns every route here, ``/`` included, into that same 404; it is read per request so
that a reload (SIGHUP) applies it.
"""

from __future__ import annotations

from pathlib import Path

from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from proxy.asgi.context import SCOPE_KEY, RequestContext
from proxy.errors import NotFound
from proxy.state import ProxyState

STATIC_DIR = Path(__file__).resolve().parent / "static"
PREFIX = "/ui/"

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        "require-trusted-types-for 'script'",
        "trusted-types 'none'",
    )
)

SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
    # Small files; revalidating each load means an upgraded daemon never mixes old and new modules.
    (b"cache-control", b"no-cache"),
)

# Only these kinds of file are served; anything else in the folder (an editor's backup) is not.
CONTENT_TYPES: dict[str, bytes] = {
    ".html": b"text/html; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".svg": b"image/svg+xml",
}


def static_files(folder: Path = STATIC_DIR) -> dict[str, tuple[bytes, bytes]]:
    """URL path -> (content, content type) for every servable file directly in ``folder``;
    ``index.html`` is also served as the folder itself."""
    table: dict[str, tuple[bytes, bytes]] = {}
    for path in sorted(folder.iterdir()):
        content_type = CONTENT_TYPES.get(path.suffix)
        # A symlink could point anywhere; hidden files are editors' and tools' business.
        if content_type is None or path.is_symlink() or not path.is_file() or path.name.startswith("."):
            continue
        entry = (path.read_bytes(), content_type)
        table[PREFIX + path.name] = entry
        if path.name == "index.html":
            table[PREFIX] = entry
    return table


async def _send(send: Send, status: int, content: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-length", str(len(content)).encode()), *headers, *SECURITY_HEADERS],
        }
    )
    await send({"type": "http.response.body", "body": content, "more_body": False})


class _UiEndpoint:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    def enter(self, scope: Scope) -> None:
        """404 exactly like an unknown route while the page is off; else label the request ``/ui/``
        (one label for all files keeps the metrics' route set small)."""
        if not self.state.settings.ui:
            raise NotFound(f"Invalid URL ({scope['method']} {scope['path'][:200]})")
        ctx: RequestContext = scope[SCOPE_KEY]
        ctx.route = PREFIX


class StaticFile(_UiEndpoint):
    def __init__(self, state: ProxyState, content: bytes, content_type: bytes) -> None:
        super().__init__(state)
        self.content = content
        self.content_type = content_type

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.enter(scope)
        await _send(send, 200, self.content, [(b"content-type", self.content_type)])


class ToIndex(_UiEndpoint):
    """``/`` and ``/ui`` -> ``/ui/``. Temporary (307): a browser must not remember it once the page is off."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.enter(scope)
        await _send(send, 307, b"", [(b"location", PREFIX.encode())])


def ui_routes(state: ProxyState, folder: Path = STATIC_DIR) -> list[Route]:
    get = ["GET"]
    routes = [Route("/", ToIndex(state), methods=get), Route("/ui", ToIndex(state), methods=get)]
    for path, (content, content_type) in static_files(folder).items():
        routes.append(Route(path, StaticFile(state, content, content_type), methods=get))
    return routes
