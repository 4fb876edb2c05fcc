"""What of llama-server's own log may reach ours: its lines, minus the parts that quote a request.

At its default verbosity the pinned llama-server prints no prompt or completion for a request that
succeeds, but some failures echo the request back to stderr. Seen with the pinned build (2 slots,
gemma-3-270m), each line from a request whose body carried the marker CANARY:

    0.47.499.866 W srv    operator(): got exception: {"error":{"code":500,"message":"[json.exception.
        parse_error.101] parse error at line 1, column 41: syntax error while parsing value - invalid
        string: surrogate U+D800..U+DBFF must be followed by U+DC00..U+DFFF; last read: '"CANARY
        secret text \\ud800 '","type":"server_error"}}
    parse: error parsing grammar: Undefined rule identifier 'CANARY'
    <blank line, then the request's whole grammar, unprefixed, line by line>

The first quotes prompt text: Python's JSON parser (the proxy's) accepts a lone surrogate escape or
``NaN`` that nlohmann::json (the child's) refuses, and its error repeats the input it last read. The
second dumps a client's grammar. ``LineFilter`` keeps such lines' shape and drops the quoted part;
every other line is passed as it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

# llama-server's log lines: "0.02.593.227 I srv  load_model: ...": the letter is the level.
LLAMA_LINE = re.compile(r"^\d+\.\d+\.\d+\.\d+ ([DIWE]) ")
_EXCEPTION = "got exception:"
_LAST_READ = "last read:"
_GRAMMAR = "error parsing grammar"
WITHHELD = "(withheld: quotes the request)"


def _exception_summary(payload: str) -> str:
    """The error's code and type, never its message."""
    try:
        err = json.loads(payload)["error"]
        return f"code {int(err['code'])}, type {str(err['type'])[:40]} {WITHHELD}"
    except (ValueError, KeyError, TypeError):
        return WITHHELD


class LineFilter:
    """One per child: a grammar dump spans several lines, so the filter remembers being inside one."""

    def __init__(self) -> None:
        self._in_grammar_dump = False

    def __call__(self, line: str) -> str | None:
        """The line as it may be logged, or None to drop it."""
        prefixed = LLAMA_LINE.match(line) is not None
        if self._in_grammar_dump:
            if not prefixed:
                return None  # the client's grammar, line by line
            self._in_grammar_dump = False
        at = line.find(_GRAMMAR)
        if at >= 0 and not prefixed:
            self._in_grammar_dump = True
            return f"{line[: at + len(_GRAMMAR)]} {WITHHELD}"
        at = line.find(_EXCEPTION)
        if at >= 0:
            end = at + len(_EXCEPTION)
            return f"{line[:end]} {_exception_summary(line[end:].strip())}"
        at = line.find(_LAST_READ)
        if at >= 0:
            return f"{line[: at + len(_LAST_READ)]} {WITHHELD}"
        return line


def is_error(line: str) -> bool:
    """llama-server's E level, or an unprefixed line that says error (ggml aborts, exceptions)."""
    m = LLAMA_LINE.match(line)
    return (m is not None and m.group(1) == "E") or (m is None and "error" in line.lower())


# llama.cpp's notice on a build without GPU support, printed whatever -ngl is. With gpu_layers 0 (the
# supervisor always passes -ngl) it says nothing an operator can act on, and it would lead every
# failure's log tail (seen with the pinned build: these three lines, then the real error).
_NO_GPU_NOTICE = (
    "warning: no usable GPU found, --gpu-layers option will be ignored",
    "warning: one possible reason is that llama.cpp was compiled without GPU support",
    "warning: consult docs/build.md for compilation instructions",
)


def is_noise(line: str, *, gpu_layers: int) -> bool:
    """A known line that says nothing about this child's health, kept out of the tail of failures."""
    return gpu_layers == 0 and line.strip() in _NO_GPU_NOTICE


def first_error(lines: Iterable[str], limit: int = 300) -> str | None:
    """The first error line among ``lines`` (the root cause more often than the last: llama-server
    ends a failed load with "exiting due to model loading error"), without its time and level."""
    for line in lines:
        if is_error(line):
            text = LLAMA_LINE.sub("", line).strip()
            return text if len(text) <= limit else text[: limit - 3] + "..."
    return None


# Where the model's layers went, as llama-server's loader reports it (src/llama-model.cpp,
# load_tensors): "offloaded 31/31 layers to GPU", then one "<buffer> model buffer size = N MiB" per
# backend buffer (CPU_Mapped, CPU_REPACK... for the host; Vulkan0, CUDA0... for a device). libllama's
# INFO lines print at verbosity 4 (-lv 4) only (common/log.cpp maps them to TRACE): the supervised child
# runs at 3 and never shows them; verify's private smoke child asks for them.
_OFFLOADED = re.compile(r"load_tensors: offloaded (\d+)/(\d+) layers to GPU")
_BUFFER = re.compile(r"load_tensors: +([A-Za-z][A-Za-z0-9_]*) model buffer size = +([0-9.]+) MiB")


def offload_fact(line: str) -> tuple[str, str] | None:
    """("layers", "19/19") or ("device", "Vulkan0") from a load line, else None. A CPU buffer is
    the host's and names no device."""
    m = _OFFLOADED.search(line)
    if m:
        return "layers", f"{m.group(1)}/{m.group(2)}"
    m = _BUFFER.search(line)
    if m and not m.group(1).startswith("CPU"):
        return "device", m.group(1)
    return None
