"""The shipped nginx script (deploy/nginx/conversation.js) computes the same conversation id as llamagate
(proxy/conversations/key.py), on the same requests: a real nginx with the real njs module runs it where
the shipped file does (``js_set``, read when the request goes upstream, the body in memory) and hands the
id to a backend, which records it beside Python's."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from proxy.conversations.key import conversation_id
from supervisor.bench.nginx import CONVERSATION_JS, main_conf, nginx_binary
from supervisor.child.spawn import free_port, popen_tied, port_open, stop_popen
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.needs_tool("nginx", "nginx-js")

SYSTEM = {"role": "system", "content": "Be brief."}
CASES: list[tuple[dict[str, str], Any]] = [
    ({"X-Session-Id": "s-42"}, {"messages": [SYSTEM, {"role": "user", "content": "hi"}]}),
    ({"X-Session-Id": "s", "session-id": "a"}, {"prompt_cache_key": "pk"}),
    ({"session-id": "a"}, {"prompt_cache_key": "pk", "messages": []}),
    ({"session-id": "sid", "x-claude-code-session-id": "cc"}, {"messages": []}),
    ({"session-id": "sid"}, "not json"),
    ({}, {"messages": [SYSTEM, {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "x"}]}),
    ({}, {"messages": [{"role": "developer", "content": "a"}, SYSTEM, {"role": "user", "content": "b"}]}),
    (
        {},
        {
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": "Hello"}],
        },
    ),
    (
        {},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "image_url"},
                        {"type": "text", "text": "b"},
                    ],
                }
            ]
        },
    ),
    ({}, {"instructions": "Be brief.", "input": "Grüße, 世界 🌍"}),
    ({}, {"instructions": "ü", "input": [{"role": "user", "content": "x"}]}),
    (
        {},
        {
            "input": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "input_text", "text": "t"}]},
            ]
        },
    ),
    ({}, {"messages": [{"role": "system", "content": "ab"}, {"role": "user", "content": "c"}]}),
    ({}, {"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "bc"}]}),
    ({}, {"prompt": "Once upon a time"}),
    ({}, {"messages": [SYSTEM]}),
    ({}, {"messages": ["not an object"]}),
    ({}, {"messages": [{"role": "user", "content": ""}]}),
    ({"X-Session-Id": "x" * 257}, {"prompt": "p"}),
    ({}, ["an", "array"]),
]


class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        _Recorder.seen.append(self.headers.get("X-Conversation", ""))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def nginx_url(tmp_path: Path) -> Iterator[str]:
    backend = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    port = free_port()
    site = tmp_path / "site.conf"
    site.write_text(
        f"""js_import llamagate_conversation from {CONVERSATION_JS};
js_set $llamagate_conversation llamagate_conversation.id;
server {{
    listen 127.0.0.1:{port};
    client_max_body_size 16m;
    client_body_buffer_size 16m;
    client_body_in_single_buffer on;
    location / {{
        proxy_pass http://127.0.0.1:{backend.server_address[1]};
        proxy_set_header X-Conversation $llamagate_conversation;
    }}
}}
"""
    )
    (tmp_path / "tmp").mkdir()
    conf = tmp_path / "nginx.conf"
    conf.write_text(main_conf(tmp_path, site))
    argv = [str(nginx_binary()), "-p", str(tmp_path), "-c", str(conf)]
    check = subprocess.run([*argv, "-t"], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr
    proc = popen_tied(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: port_open(port), "nginx listening", timeout=10)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_popen(proc, 5.0)
        backend.shutdown()
        backend.server_close()


def test_nginx_and_llamagate_derive_the_same_conversation_id(nginx_url: str) -> None:
    _Recorder.seen = []
    expected = []
    with httpx.Client(timeout=10, trust_env=False) as client:
        for headers, body in CASES:
            raw = body.encode() if isinstance(body, str) else json.dumps(body, ensure_ascii=False).encode()
            r = client.post(nginx_url + "/v1/chat/completions", content=raw, headers=headers)
            assert r.status_code == 200
            payload = body if isinstance(body, dict) else {}
            pairs = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
            expected.append(conversation_id(pairs, payload) or "")
    assert _Recorder.seen == expected
    assert len({e for e in expected if e}) > 10  # the cases do reach every source
