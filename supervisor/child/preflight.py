"""Ask the binary whether it accepts a command line, before the working child is stopped for it.

llama-server parses its whole command line before it loads anything (``common_params_parse`` in
llama.cpp's ``common/arg.cpp`` at the pinned commit): an unknown flag (``error: invalid argument:
--bogus-flag``), a missing or malformed value, an unreadable ``--chat-template-file`` or an unsupported
chat template all end the process with exit 1 and one error line. ``--help`` only sets a flag during
that pass; once every argument has been parsed the usage is printed and the process exits 0, with no
model loaded and no port bound. So ``BINARY --help ARGS...`` is a dry parse: exit 0 means the parser
accepts ARGS. ``--help`` goes first so that it is never taken as the value of a flag at the end of ARGS
(which would leave the usage flag unset and start a real server).

What the parser cannot see (a LoRA file that does not load, a context the model refuses) shows only
when the child loads: the driver's rollback covers that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

from supervisor.child.log import is_error
from supervisor.child.osseam import ChildOs

log = logging.getLogger("llamagate.preflight")

DRY_PARSE_TIMEOUT_S = 30.0
_KEEP_BYTES = 16384  # of the output's start: the error line comes first; the usage text after is unused


async def refused_arguments(
    os: ChildOs,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    timeout_s: float = DRY_PARSE_TIMEOUT_S,
) -> str | None:
    """None when ``argv[0]`` accepts ``argv[1:]``; else its own error line. A dry parse that cannot be
    run or does not finish is logged and answers None: the child's start is still watched."""
    dry = [argv[0], "--help", *argv[1:]]
    try:
        handle = await os.spawn(dry, env, cwd)
    except OSError as exc:
        log.warning(f"could not check llama-server's arguments: {exc.strerror or exc}")
        return None
    head = bytearray()

    async def read() -> int:
        async for chunk in handle.output():
            if len(head) < _KEEP_BYTES:
                head.extend(chunk[: _KEEP_BYTES - len(head)])
        return await handle.wait()

    try:
        rc = await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        handle.send_signal(signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(handle.wait(), 5.0)
        log.warning(f"llama-server's argument check did not finish within {timeout_s:g} s; not judged")
        return None
    if rc == 0:
        return None
    return error_line(head.decode("utf-8", errors="replace"), rc)


def error_line(output: str, returncode: int) -> str:
    """The line that says what is wrong: the first error line, else the last line, else the exit code."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if is_error(line) or line.lower().startswith("error"):
            return line
    return lines[-1] if lines else f"exited with code {returncode}"
