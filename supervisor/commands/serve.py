"""``llamagate serve``: bring up llama-server under supervision behind the proxy.

With no configuration at all this is the quick start: the demo model, the binary built from the lock
(both fetched/built on first use, with progress), 127.0.0.1:8080, 2 slots x 4096, and one fresh API
key printed once on stdout (never logged).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from dataclasses import replace

from proxy.accounts.store import StoreError
from proxy.auth import new_key
from proxy.settings import KeyEntry
from supervisor import logs
from supervisor.commands.config import add_config_argument
from supervisor.config.load import load_config, resolve_config_path
from supervisor.config.models import served_models
from supervisor.config.schema import Config
from supervisor.daemon.listener import bind_listener
from supervisor.daemon.prepare import default_threads
from supervisor.daemon.prepare_models import joint_budget_lines, prepare_models, thread_warning
from supervisor.daemon.service import Daemon
from supervisor.daemon.state_disk import sweep
from supervisor.daemon.wiring import DaemonAccounts, open_accounts
from supervisor.errors import Misconfigured
from supervisor.progress import ConsoleProgress

log = logging.getLogger("llamagate.serve")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("serve", help="run the daemon: supervised llama-server behind the proxy")
    add_config_argument(parser)
    parser.add_argument("--host", type=_host, help="override proxy.host")
    parser.add_argument("--port", type=_port, help="override proxy.port (1-65535)")
    parser.set_defaults(func=_serve)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if port == 0:
        # Port 0 would bind a random port nobody was told about; say so rather than ignore it.
        raise argparse.ArgumentTypeError("0 is not supported: give the port to listen on (1-65535)")
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (1-65535)")
    return port


def _host(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give an address, e.g. 127.0.0.1")
    return text


def _apply_logging(args: argparse.Namespace, cfg: Config) -> None:
    # The command line's --log-format json / --log-level win; otherwise the config's choice applies.
    fmt: logs.LogFormat = "json" if "json" in (args.log_format, cfg.logging.format) else "text"
    level = args.log_level or cfg.logging.level
    logs.setup(fmt, level)


def generate_key(cfg: Config, store_admins: int = 0) -> tuple[str, KeyEntry] | None:
    """One fresh inference+admin key when the config has none (and no anonymous tenant) and the store
    holds no active admin key (``store_admins``): an operator who keeps keys in the store has one."""
    if cfg.keys or cfg.proxy.anonymous_tenant is not None or store_admins > 0:
        return None
    return new_key(cfg.tenants[0].name, frozenset({"inference", "admin"}))


def store_admin_keys(accounts: DaemonAccounts) -> int:
    """Active admin keys in the daemon's store (0 without one). A store that cannot list them is the
    daemon's problem to report at start (``Misconfigured``), as every other store failure."""
    if accounts.accounts is None:
        return 0
    try:
        keys = accounts.accounts.store.list_keys()
    except StoreError as exc:
        raise Misconfigured(str(exc)) from exc
    now = time.time()
    return sum(1 for k in keys if "admin" in k.scopes and k.status(now) == "active")


def _banner(cfg: Config, key: str) -> str:
    base = f"http://{cfg.proxy.host}:{cfg.proxy.port}"
    alias = served_models(cfg)[0].name
    return f"""\
llamagate: no API key in the configuration; this one is valid until the daemon stops (shown once):

    {key}

  curl {base}/v1/chat/completions -H "Authorization: Bearer {key}" \\
       -H "Content-Type: application/json" \\
       -d '{{"model": "{alias}", "max_tokens": 64, "temperature": 0,
            "messages": [{{"role": "user", "content": "Hello"}}]}}'

  # Python, OpenAI SDK
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="{key}")
  reply = client.chat.completions.create(
      model="{alias}", max_tokens=64, temperature=0, messages=[{{"role": "user", "content": "Hello"}}]
  )
  print(reply.choices[0].message.content)

  llamagate status --url {base}        (readiness; add --key for identity)
"""


def _serve(args: argparse.Namespace) -> int:
    path = resolve_config_path(args.config)
    cfg = load_config(path)
    if args.host is not None or args.port is not None:
        proxy = replace(
            cfg.proxy,
            host=cfg.proxy.host if args.host is None else args.host,
            port=cfg.proxy.port if args.port is None else args.port,
        )
        cfg = replace(cfg, proxy=proxy)
    _apply_logging(args, cfg)
    sock = bind_listener(cfg.proxy.host, cfg.proxy.port)
    accounts: DaemonAccounts | None = None
    try:
        # The store first: a bad file (or a second daemon on it) fails in a moment, before a model load.
        accounts = DaemonAccounts(open_accounts(cfg))
        # Every model verified and budgeted, alone and together (one model: a set of one), then one daemon.
        models = prepare_models(cfg, progress=ConsoleProgress())
        for model in models:
            for line in model.prepared.budget.lines():
                log.info(f"memory budget: {model.served.name}: {line.strip()}")
        for line in joint_budget_lines(models):
            log.info(f"memory budget: {line}")
        for model in models:
            log.info(model.prepared.disk.line(model.served.name))
            states = model.prepared.spec.slot_states
            if states is not None:  # identities nobody serves (held) or used lately: never restored again
                sweep(states, model.prepared.spec.alias)
        crowded = thread_warning(models, default_threads())
        if crowded is not None:
            log.warning(crowded)
        admins = store_admin_keys(accounts)
        generated = generate_key(cfg, admins)
        if generated is not None:
            # stdout, once, never a log line: logs are kept and shipped; this key must not be.
            sys.stdout.write(_banner(cfg, generated[0]))
            sys.stdout.flush()
        elif admins and not cfg.keys:
            sys.stdout.write(
                f"llamagate: no temporary key made: the store holds {admins} active admin key(s) "
                "(llamagate keys list; keys new --admin makes another)\n"
            )
            sys.stdout.flush()
        daemon = Daemon(
            cfg,
            models,
            config_path=path,
            generated_keys=[generated[1]] if generated else [],
            accounts=accounts,
        )
        exit_code: int = asyncio.run(daemon.run(sock))
        return exit_code
    finally:
        if accounts is not None and accounts.accounts is not None:
            asyncio.run(accounts.close())  # the daemon never ran (it closes it itself otherwise)
        sock.close()
