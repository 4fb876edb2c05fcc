"""A real nginx in front of llamagate replicas: the shipped ``deploy/nginx/llamagate.conf``, run as a child.

The scale-out test and ``llamagate bench scaleout`` run the operator's file itself, not a look-alike: only
its replica lines (``server ... # replica``), its ``listen`` port and the path of its conversation script
(``conversation.js`` beside it) are replaced. The comparison modes change one thing each, so two runs
differ only in what is being compared: ``least-conn`` balances by load instead of hashing conversations;
``round-robin`` removes the balancing line and the retry rule. nginx runs in the foreground (``daemon
off``) as a single process (``master_process off``: a master's workers would outlive a master killed by
SIGKILL, they carry no parent-death signal), under a private prefix folder, with the JavaScript module
loaded (``load_module``), tied to this process (``child.spawn.popen_tied``: it dies with it, even by
SIGKILL) and stopped with SIGQUIT (graceful), then SIGKILL.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from supervisor.child.spawn import free_port, popen_tied, port_open, stop_popen
from supervisor.errors import StartupError, UsageError

Mode = Literal["balanced", "least-conn", "round-robin"]
MODES: tuple[Mode, ...] = ("balanced", "least-conn", "round-robin")
SHIPPED_CONF = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "llamagate.conf"
CONVERSATION_JS = SHIPPED_CONF.with_name("conversation.js")
# Debian's libnginx-mod-http-js; a private nginx loads it itself (the system one does through
# /etc/nginx/modules-enabled).
JS_MODULE = Path("/usr/lib/nginx/modules/ngx_http_js_module.so")
# One access-log line per request: status, every replica tried and what each answered (nginx lists them
# comma-separated in order), so a test can see a refusal being retried on the next replica; and the
# conversation id the hash used (conversation.js), so a benchmark can tell where each conversation went.
ACCESS_FORMAT = "$status|$upstream_addr|$upstream_status|$request_time|$llamagate_conversation"

_REPLICA = re.compile(r"^[ \t]*server[ \t]+\S+[^\n]*#[ \t]*replica[ \t]*\n", re.MULTILINE)
_LISTEN = re.compile(r"^([ \t]*)listen[ \t]+\S+;", re.MULTILINE)
_BALANCING = re.compile(r"^([ \t]*)hash \$llamagate_conversation consistent;[ \t]*\n", re.MULTILINE)
_JS_IMPORT = re.compile(r"^([ \t]*js_import[ \t]+\w+[ \t]+from[ \t]+)\S+;", re.MULTILINE)
_NEXT_UPSTREAM = re.compile(r"^([ \t]*)proxy_next_upstream[ \t][^\n]*\n", re.MULTILINE)
_NEXT_UPSTREAM_ANY = re.compile(r"^[ \t]*proxy_next_upstream_\w+[ \t][^\n]*\n", re.MULTILINE)


def render_site(
    shipped: str,
    replicas: Sequence[str],
    listen_port: int,
    mode: Mode = "balanced",
    script: Path = CONVERSATION_JS,
) -> str:
    """The shipped site file with ``replicas`` (``host:port``), ``listen_port`` and the conversation
    ``script``'s path put in.

    ``least-conn``: load balancing instead of conversation hashing. ``round-robin`` is the baseline:
    nginx's default balancing and no retries (``proxy_next_upstream off``). Raises ``UsageError`` when
    the file no longer has the lines this relies on."""
    if not replicas:
        raise UsageError("no replicas to balance")
    found = list(_REPLICA.finditer(shipped))
    if not found:
        raise UsageError("nginx site file: no `server HOST:PORT ...; # replica` line in the upstream block")
    indent = re.match(r"[ \t]*", found[0].group(0))
    pad = indent.group(0) if indent else "    "
    lines = "".join(f"{pad}server {addr} max_fails=0;  # replica\n" for addr in replicas)
    # Replace the first replica line with the new set and drop the others.
    out = shipped[: found[0].start()] + lines + _REPLICA.sub("", shipped[found[0].end() :])
    out, n = _LISTEN.subn(rf"\g<1>listen 127.0.0.1:{listen_port};", out)
    if n != 1:
        raise UsageError(f"nginx site file: expected one `listen` directive, found {n}")
    out = re.sub(r"proxy_next_upstream_tries \d+;", f"proxy_next_upstream_tries {len(replicas)};", out)
    out, n_js = _JS_IMPORT.subn(rf"\g<1>{script};", out)
    if n_js != 1:
        raise UsageError(f"nginx site file: expected one `js_import ... from PATH;` line, found {n_js}")
    if mode == "least-conn":
        out, n_b = _BALANCING.subn(r"\g<1>least_conn;\n", out)
        if n_b != 1:
            raise UsageError("nginx site file: expected one `hash $llamagate_conversation consistent;` line")
    elif mode == "round-robin":
        out, n_b = _BALANCING.subn("", out)
        out = _NEXT_UPSTREAM_ANY.sub("", out)
        out, n_nu = _NEXT_UPSTREAM.subn(r"\g<1>proxy_next_upstream off;\n", out)
        if n_b != 1 or n_nu != 1:
            raise UsageError(
                "nginx site file: expected one `hash $llamagate_conversation consistent;` and one "
                "`proxy_next_upstream` line"
            )
    return out


def main_conf(prefix: Path, site: Path) -> str:
    """nginx.conf for a private, foreground nginx whose every file lives under ``prefix``."""
    user = "user root root;\n" if os.geteuid() == 0 else ""  # workers must read/write the prefix folder
    temp = "\n".join(
        f"    {kind}_temp_path {prefix / 'tmp' / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    load = f"load_module {JS_MODULE};\n"
    return f"""{load}{user}master_process off;
daemon off;
pid {prefix / "nginx.pid"};
error_log {prefix / "error.log"} info;
events {{ worker_connections 1024; }}
http {{
    log_format llamagate '{ACCESS_FORMAT}';
    access_log {prefix / "access.log"} llamagate;
{temp}
    include {site};
}}
"""


@dataclass
class AccessRecord:
    status: int
    tried: list[str]  # replica addresses, in the order nginx tried them
    answers: list[str]  # what each tried replica answered ("429", "200", "502", "-")
    conversation: str = ""  # the conversation id nginx hashed ("" when the request had none)


@dataclass
class Nginx:
    proc: subprocess.Popen[bytes]
    port: int
    prefix: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def access_log(self) -> list[AccessRecord]:
        path = self.prefix / "access.log"
        out: list[AccessRecord] = []
        if not path.exists():
            return out
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            parts = line.split("|", 4)
            if len(parts) < 4 or not parts[0].isdigit():
                continue
            # Several tries read "a:1, b:2" (", " between tries; " : " between upstream groups).
            tried = [p for p in re.split(r"[,:]\s+", parts[1].strip()) if p]
            answers = [p for p in re.split(r"[,:]\s+", parts[2].strip()) if p]
            conversation = parts[4].strip() if len(parts) > 4 and parts[4].strip() != "-" else ""
            out.append(AccessRecord(int(parts[0]), tried, answers, conversation))
        return out

    def error_log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""

    def stop(self, grace_s: float = 10.0) -> int | None:
        # SIGQUIT is nginx's graceful stop: finish open requests, then exit.
        return stop_popen(self.proc, grace_s, signal.SIGQUIT)


def nginx_binary() -> Path | None:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )
    return Path(found) if found else None


def start_nginx(
    replicas: Sequence[str],
    prefix: Path,
    *,
    mode: Mode = "balanced",
    site_conf: Path = SHIPPED_CONF,
    port: int | None = None,
    ready_timeout_s: float = 30.0,
) -> Nginx:
    """Render the site file for ``replicas``, check it (``nginx -t``), start nginx, wait for its port."""
    binary = nginx_binary()
    if binary is None:
        raise StartupError("nginx is not installed (Debian: apt-get install nginx)")
    if not JS_MODULE.exists():
        raise StartupError(
            f"nginx's JavaScript module is not installed ({JS_MODULE}; Debian: apt-get install "
            "libnginx-mod-http-js)"
        )
    try:
        shipped = site_conf.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"nginx site file {site_conf}: {exc.strerror or exc}") from exc
    port = port or free_port()
    (prefix / "tmp").mkdir(parents=True, exist_ok=True)
    site = prefix / "site.conf"
    site.write_text(render_site(shipped, replicas, port, mode), encoding="utf-8")
    conf = prefix / "nginx.conf"
    conf.write_text(main_conf(prefix, site), encoding="utf-8")
    argv = [str(binary), "-p", str(prefix), "-c", str(conf)]
    check = subprocess.run([*argv, "-t", "-q"], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        raise StartupError(f"nginx -t refused the rendered configuration:\n{check.stderr.strip()}")
    with (prefix / "stderr.log").open("wb") as err:
        proc = popen_tied(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT)
    nginx = Nginx(proc, port, prefix)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StartupError(f"nginx exited with {proc.returncode}:\n{nginx.error_log()[-2000:]}")
        if port_open(port):
            return nginx
        time.sleep(0.05)
    nginx.stop()
    raise StartupError(f"nginx did not listen on 127.0.0.1:{port} within {ready_timeout_s:g} s")
