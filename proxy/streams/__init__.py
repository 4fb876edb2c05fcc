"""How each generation route's answer is measured and how an error ends its stream.

One ``StreamFormat`` per route kind (see ``proxy.route_table``): llama-server speaks four stream dialects
from the same slot machinery (``format_oai_sse``, ``format_oai_resp_sse`` and ``format_anthropic_sse``
in server-common.cpp, and its native one), and each hides the first token and the token count in a
different place. The relay stays byte-for-byte; only the meter and the last error event differ.
"""

from __future__ import annotations

from proxy.streams.formats import ANTHROPIC, NATIVE, OPENAI, RESPONSES, SILENT, Meter, StreamFormat

__all__ = ["ANTHROPIC", "NATIVE", "OPENAI", "RESPONSES", "SILENT", "Meter", "StreamFormat"]
