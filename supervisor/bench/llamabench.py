"""llama.cpp's own ``llama-bench``: raw prompt-processing and decode rates, set beside serving figures.

llamagate builds only the ``llama-server`` target; ``llama-bench`` comes from the same build tree
(same lock, same flags) with one more target:

    cmake --build BUILD --target llama-bench -j2        # BUILD: the folder llama-server was built in

The experiments look for it next to the llama-server binary, or take ``--llama-bench PATH``. Without it
they still run and say how to get it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor.child.spawn import popen_tied
from supervisor.errors import CheckFailed

HOW_TO_BUILD = (
    "llama-bench not found; build it from the same tree as llama-server: "
    "cmake --build BUILD --target llama-bench -j2 (BUILD = the folder holding bin/llama-server's build), "
    "then pass --llama-bench PATH"
)


@dataclass(frozen=True)
class BenchRate:
    threads: int
    test: str  # "pp512" (prompt processing of 512 tokens) or "tg128" (generating 128 tokens)
    tokens_per_s: float
    stddev: float


def find(server_binary: Path | None, explicit: Path | None = None) -> Path | None:
    if explicit is not None:
        return explicit if explicit.is_file() else None
    if server_binary is not None:
        sibling = server_binary.parent / "llama-bench"
        if sibling.is_file():
            return sibling
    found = shutil.which("llama-bench")
    return Path(found) if found else None


def parse(output: str) -> list[BenchRate]:
    try:
        rows = json.loads(output)
    except json.JSONDecodeError as exc:
        raise CheckFailed(f"llama-bench printed no JSON ({exc.msg})") from exc
    rates = []
    for row in rows if isinstance(rows, list) else []:
        n_prompt, n_gen = int(row.get("n_prompt", 0)), int(row.get("n_gen", 0))
        test = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0 else f"pp{n_prompt}+tg{n_gen}"
        rates.append(
            BenchRate(int(row["n_threads"]), test, float(row["avg_ts"]), float(row.get("stddev_ts", 0.0)))
        )
    return rates


def run(
    binary: Path,
    model: Path,
    threads: Sequence[int],
    prompt_tokens: int = 512,
    gen_tokens: int = 128,
    repetitions: int = 3,
    timeout_s: float = 1800.0,
) -> list[BenchRate]:
    argv = [
        str(binary),
        "-m",
        str(model),
        "-t",
        ",".join(str(t) for t in threads),
        "-p",
        str(prompt_tokens),
        "-n",
        str(gen_tokens),
        "-r",
        str(repetitions),
        "-ngl",
        "0",
        "-o",
        "json",
    ]
    # Tied to this process: a bench killed mid-run must not leave llama-bench busy on every core.
    with popen_tied(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            proc.communicate()
            raise CheckFailed(f"llama-bench did not finish within {timeout_s:g} s") from exc
        except BaseException:
            proc.kill()
            raise
    if proc.returncode != 0:
        raise CheckFailed(f"llama-bench exited {proc.returncode}: {err.strip()[-800:]}")
    return parse(out)
