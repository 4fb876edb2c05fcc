"""The lock's tools besides llama-server, built by ``artifacts.build`` from the same sources and the same
cmake arguments and cached beside it (``<cache>/<tool>/<digest[:16]>/``, with a receipt of its own).

A built binary must say which build it is before it is installed, as llama-server does with
``--version``. llama-quantize has no ``--version``, but it prints the same version line
(``llama_print_build_info``, to stderr) on every run before it opens its input: a dry run on a file that
does not exist makes it print the line and exit 1 without reading or writing anything.
"""

from __future__ import annotations

QUANTIZE = "llama-quantize"

# Tool target -> the arguments that make it print the build's version line.
TOOLS: dict[str, tuple[str, ...]] = {
    QUANTIZE: ("--dry-run", "/nonexistent/llamagate-identity-probe.gguf", "COPY"),
}


def identity_args(target: str) -> tuple[str, ...]:
    return TOOLS.get(target, ("--version",))
