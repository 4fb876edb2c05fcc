"""Logging setup for every llamagate command: human text on a terminal, JSON lines on request.

Convention shared with the proxy (which does not import this module): structured fields travel in
``extra={"fields": {...}}``. Both formatters render them; nothing else is added, so a prompt, a
completion or a key can only reach a log if a caller puts it in ``fields``, and none does.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal

LogFormat = Literal["text", "json"]


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return dict(fields) if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def one_line(text: str) -> str:
    """Newlines escaped: one record is one line, so a journal, grep or a log shipper never reads the
    second line of a traceback or of the child's log tail as a record of its own."""
    return text.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        base = one_line(super().format(record))  # the message, and a traceback when there is one
        fields = _fields(record)
        if not fields:
            return base
        return base + " " + " ".join(f"{k}={one_line(str(v))}" for k, v in fields.items())


def setup(fmt: LogFormat = "text", level: str | int = "INFO") -> None:
    """Configure the root logger once; safe to call again (replaces llamagate's handler)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_llamagate", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._llamagate = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(level)
    # httpx logs every request URL at INFO; our URLs carry no secrets, but the noise drowns the
    # supervisor's own lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
