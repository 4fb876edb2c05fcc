"""A fake llama-server for the supervisor's fault paths. Standard library only (it runs under the
scrubbed environment the supervisor gives its child).

It accepts llama-server's command line (the flags the supervisor passes), binds the port at once and
answers 503 "Loading model" like the real one while it "loads", then serves /health, /v1/models
(alias and per-slot n_ctx = -c / -np), /slots (each slot idle) and a one-token /v1/completions, all
but /health behind the LLAMA_API_KEY bearer secret. Switches make it misbehave:

  --load-seconds S              normal load time (default 0.2)
  --exit-during-load CODE       print a few log lines, then exit with CODE before ready
  --stall-during-load           print one line, then go silent (and idle) forever while "loading"
  --slow-but-progressing-load S load for S seconds, printing a line every 0.2 s
  --hang-after-ready S          S seconds after ready, stop answering /health (requests hang)
  --crash-after-ready S         S seconds after ready, exit with code 3
  --crash-file PATH             crash after ready only while PATH exists (a crash loop a test can end)
  --ignore-sigterm              ignore SIGTERM (only SIGKILL ends it)
  --wrong-ctx                   report a different n_ctx than asked (the readiness gate must refuse)
  --abort-on MARKER             abort (SIGABRT, like a failed GGML_ASSERT) on a POST whose body holds MARKER
  --answer-seconds S            take S seconds to answer a completion (a request stays in flight that long)
  --hold-on MARKER              hold the server loop on a POST whose body holds MARKER, as a request that
                                never yields does: from then on nothing is answered (that request, the
                                others in flight, /slots, every later request) until the process is killed,
                                but /health, which the pinned server answers without its loop (HTTP thread)
  --hold-file PATH              with --hold-on: hold only while PATH exists, and remove it on holding (one
                                hold; the marked request is then served, or aborts with --abort-on MARKER)
  --request-log PATH            append one JSON line per POST received: pid, path, whether a marker was in
                                it, whether it holds the loop, and the body's first 2000 characters
                                (written before any abort or hold)
  --cpu-fallback                with -ngl and a device, still report 0 layers offloaded

GPU, as a vulkan build on a machine whose only device is lavapipe: ``--list-devices`` lists one device
only when GGML_VK_VISIBLE_DEVICES names it (the real ggml-vulkan skips CPU-type devices otherwise), and
a load at -lv 4 reports ``offloaded min(N, 31)/31 layers to GPU`` (N of -ngl) and a Vulkan0 model buffer.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def log(msg: str) -> None:
    sys.stderr.write(f"0.00.000.000 I fake {msg}\n")
    sys.stderr.flush()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-np", "--parallel", type=int, default=1)
    p.add_argument("-a", "--alias", default="fake")
    p.add_argument("-t", "--threads")
    p.add_argument("-tb", "--threads-batch")
    p.add_argument("-ngl", "--gpu-layers")
    p.add_argument("-ctk", "--cache-type-k")
    p.add_argument("-ctv", "--cache-type-v")
    p.add_argument("--cache-ram")
    p.add_argument("--ctx-checkpoints")
    p.add_argument("--slot-save-path")  # the disk tier's folder: this fake saves nothing
    p.add_argument("-sps", "--slot-prompt-similarity")
    p.add_argument("--no-cache-idle-slots", action="store_true")
    p.add_argument("--metrics", action="store_true")
    p.add_argument("--no-ui", action="store_true")
    p.add_argument("--embeddings", action="store_true")
    p.add_argument("--chat-template")
    p.add_argument("--chat-template-file")
    p.add_argument("--no-jinja", "--jinja", action="store_true")
    p.add_argument("--load-seconds", type=float, default=0.2)
    p.add_argument("--exit-during-load", type=int)
    p.add_argument("--stall-during-load", action="store_true")
    p.add_argument("--slow-but-progressing-load", type=float)
    p.add_argument("--hang-after-ready", type=float)
    p.add_argument("--crash-after-ready", type=float)
    p.add_argument("--crash-file")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--wrong-ctx", action="store_true")
    p.add_argument("--abort-on")
    p.add_argument("--request-log")
    p.add_argument("--answer-seconds", type=float, default=0.0)
    p.add_argument("--hold-on")
    p.add_argument("--hold-file")
    p.add_argument("-dev", "--device")
    p.add_argument("-lv", "--verbosity", type=int, default=3)
    p.add_argument("--list-devices", action="store_true")
    p.add_argument("--cpu-fallback", action="store_true")
    return p.parse_args()


LAVAPIPE = "Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)"
LAYERS = 31


def has_device() -> bool:
    return os.environ.get("GGML_VK_VISIBLE_DEVICES", "").split(",")[0] == "0"


def list_devices() -> None:
    print("Available devices:")
    print(f"  {LAVAPIPE}" if has_device() else "  (none)")
    sys.exit(0)


def report_offload(a: argparse.Namespace) -> None:
    if a.verbosity < 4:
        return  # libllama's INFO lines: at -lv 4 only, as in the real one
    asked = int(a.gpu_layers or 0)
    on = 0 if a.cpu_fallback or not has_device() or a.device == "none" else min(asked, LAYERS)
    sys.stderr.write(f"load_tensors: offloaded {on}/{LAYERS} layers to GPU\n")
    sys.stderr.write("load_tensors:   CPU_Mapped model buffer size =    28.62 MiB\n")
    if on:
        sys.stderr.write("load_tensors:      Vulkan0 model buffer size =    76.23 MiB\n")
    sys.stderr.flush()


class State:
    ready = threading.Event()
    hang = threading.Event()
    held = threading.Event()  # --hold-on: the server loop is held
    hold_lock = threading.Lock()
    args: argparse.Namespace
    secret = ""


class Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        return None

    def reply(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def gate(self) -> bool:
        if not State.ready.is_set():
            self.reply(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
            return False
        if self.path != "/health" and self.headers.get("Authorization") != f"Bearer {State.secret}":
            self.reply(
                401, {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
            )
            return False
        return True

    def do_GET(self) -> None:
        if State.hang.is_set():
            time.sleep(3600)
        if self.path != "/health":
            wait_while_held()
        if not self.gate():
            return
        a = State.args
        if self.path == "/health":
            self.reply(200, {"status": "ok"})
        elif self.path == "/slots":
            # The supervisor's watchdog asks it after each /health 200: the (fake) loop answers.
            self.reply(200, [{"id": i, "is_processing": False} for i in range(a.parallel)])
        elif self.path in ("/v1/models", "/models"):
            n_ctx = a.ctx_size // a.parallel + (256 if a.wrong_ctx else 0)
            self.reply(200, {"object": "list", "data": [{"id": a.alias, "meta": {"n_ctx": n_ctx}}]})
        else:
            self.reply(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})

    def do_POST(self) -> None:
        if State.hang.is_set():
            time.sleep(3600)
        wait_while_held()
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode("utf-8", "replace")
        if not self.gate():
            return
        marker = State.args.abort_on
        poisoned = marker is not None and marker in body
        holds = holds_loop(body)
        if State.args.request_log:
            record_request(State.args.request_log, self.path, body, poisoned or holds, holds)
        if holds:
            log("holding the server loop (fake): nothing but /health is answered from now on")
            State.held.set()
            wait_while_held()
        if poisoned:
            log("GGML_ASSERT failed (fake): aborting on the marked request")
            # No core file: the test's folder is not the place for one.
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.abort()
        if self.path in ("/v1/completions", "/completions"):
            time.sleep(State.args.answer_seconds)
            wait_while_held()  # a request in flight when the loop is held is never answered
            self.reply(
                200,
                {
                    "choices": [{"text": " Paris", "index": 0, "finish_reason": "length"}],
                    "usage": {"completion_tokens": 1, "prompt_tokens": 5, "total_tokens": 6},
                },
            )
        else:
            self.reply(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})


def wait_while_held() -> None:
    """The server loop is held: no answer but /health's until the process is killed."""
    while State.held.is_set():
        time.sleep(3600)


def holds_loop(body: str) -> bool:
    """The request holds the loop (``--hold-on``), once per ``--hold-file`` when one is named."""
    a = State.args
    if a.hold_on is None or a.hold_on not in body:
        return False
    if a.hold_file is None:
        return True
    with State.hold_lock:
        try:
            os.remove(a.hold_file)
        except FileNotFoundError:
            return False
        return True


def record_request(path: str, route: str, body: str, marked: bool, held: bool = False) -> None:
    record = {"pid": os.getpid(), "path": route, "marked": marked, "held": held, "body": body[:2000]}
    line = json.dumps(record)
    # One write of one line in append mode: concurrent handlers' lines do not interleave.
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def main() -> None:
    a = parse()
    if a.list_devices:
        list_devices()
    State.args = a
    State.secret = os.environ.get("LLAMA_API_KEY", "")
    if a.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = ThreadingHTTPServer((a.host, a.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log(f"loading model '{a.model}'")
    report_offload(a)
    if a.exit_during_load is not None:
        log("error: failed to load model (fake)")
        time.sleep(0.1)
        sys.exit(a.exit_during_load)
    if a.stall_during_load:
        while True:
            time.sleep(3600)
    if a.slow_but_progressing_load is not None:
        end = time.monotonic() + a.slow_but_progressing_load
        while time.monotonic() < end:
            log("loading tensors ...")
            time.sleep(0.2)
    else:
        time.sleep(a.load_seconds)
    State.ready.set()
    log(f"listening on http://{a.host}:{a.port}")
    if a.hang_after_ready is not None:
        time.sleep(a.hang_after_ready)
        log("hanging (fake)")
        State.hang.set()
    crash = a.crash_after_ready is not None and (a.crash_file is None or os.path.exists(a.crash_file))
    if crash:
        time.sleep(a.crash_after_ready)
        log("error: crashing (fake)")
        os._exit(3)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
