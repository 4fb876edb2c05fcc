"""What one unit of a costly value holds llama-server's server loop for, as data: the cost table the
door's default bounds are computed from.

llama-server runs every slot on one thread: a request's setup (its sampler chain, DRY's breaker table,
logit biases, the grammar, stop strings) runs there, and while it runs no slot of any tenant makes
progress (docs/security.md, "What a value costs the server loop"). Each entry is the seconds per unit
measured on the pinned server with the demo model (SmolLM2 135M, 49,152 tokens), by
``python -m tests.benchmarks.loop_cost`` (the figures and how they were taken: docs/security.md). A
default bound is the most units whose setup fits ``BUDGET_S``; where the cost scales with the model's
vocabulary (a pass over every token's text per unit), the model's own size (``Context.n_vocab``, from
the GGUF header at load) tightens it in proportion. A tenant's ``field_bounds`` replaces a bound.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

# The longest one request may hold the server loop outside a decode (or one of the child's HTTP
# threads, which it has few of), on the demo model.
BUDGET_S = 1.0
# The demo model's vocabulary: the one the costs were measured with.
REFERENCE_VOCAB = 49_152
# A model whose vocabulary is unknown (no GGUF header read) is taken to have Gemma 3's 262,144 tokens,
# the largest of the models llamagate is tested with: the bounds err tight.
UNKNOWN_VOCAB = 262_144


@dataclass(frozen=True, slots=True)
class UnitCost:
    """``seconds`` per ``unit`` at ``REFERENCE_VOCAB``, held on the server ``loop`` or on one of the
    child's few ``http`` threads (a request parsed there: its thread serves nothing else meanwhile);
    ``per_vocab``: in proportion to the model's vocabulary; ``source``: what was measured, how."""

    seconds: float
    unit: str
    where: Literal["loop", "http"]
    per_vocab: bool
    source: str

    def at(self, n_vocab: int | None) -> float:
        """Seconds per unit with a vocabulary of ``n_vocab`` tokens."""
        if not self.per_vocab:
            return self.seconds
        return self.seconds * (n_vocab or UNKNOWN_VOCAB) / REFERENCE_VOCAB


# Measured with ``python -m tests.benchmarks.loop_cost`` on 2 shared cores (2026-12-07, load average
# about 10): the slope of the longest ``/slots`` probe (loop) or of the request's time (http) over the
# units; where runs differed, the largest. Values that hold neither for long at any size the body limit
# lets through are not here (token-id logit biases: 0.1 s for the whole vocabulary; stop strings and
# n_probs: a few ms a token step at 4,000 and 10,000; tools with a required tool call: under 40 ms at
# 128): their bounds are plain.
COSTS: Mapping[str, UnitCost] = MappingProxyType(
    {
        "dry_breaker": UnitCost(
            35e-3,
            "breaker",
            "loop",
            True,
            "DRY's setup scans every token's text for each breaker (llama_sampler_init_dry):"
            " 8 breakers 0.37 s, 16 0.70 s, 32 1.28 s, 48 1.65 s; 29 to 33 ms each in four runs",
        ),
        "logit_bias_entry": UnitCost(
            0.2e-3,
            "entry",
            "http",
            False,
            "an entry given as text is tokenized while the body is read: 2,000 0.8 s, 8,000 2.0 s;"
            " the whole vocabulary 9 s (issue 54); token ids cost nothing measurable",
        ),
        "grammar_char": UnitCost(
            53e-6,
            "character",
            "loop",
            False,
            "the grammar is parsed and its stacks built at the sampler's setup: 1,000 alternatives"
            " (11 KB) 0.62 s, 3,000 (35 KB) 1.26 to 1.69 s, 5,000 2.4 s; 34 to 53 us a character in"
            " three runs; long rule chains cost less (3,000 rules, 91 KB: 0.05 s)",
        ),
        "json_schema_char": UnitCost(
            40e-6,
            "character",
            "loop",
            False,
            "a JSON schema becomes a grammar, parsed at setup: an enum of 2,000 strings (23 KB) 0.56 to"
            " 1.2 s, 4,000 (47 KB) 1.36 to 1.89 s (28 to 37 us a character in three runs), and as long"
            " again in an HTTP thread converting it",
        ),
        "tokenize_char": UnitCost(
            10e-6,
            "character",
            "http",
            False,
            "/tokenize with parse_special splits the text at every special token, more than linearly:"
            " 80,000 characters 0.28 to 0.45 s, 240,000 3.1 to 4.8 s, 600,000 (50,000 special tokens)"
            " 7 s (issue 54); 10 us a character is its cost at about 100,000",
        ),
    }
)


@functools.lru_cache(maxsize=256)
def cost_limit(cost: str, most: int, n_vocab: int | None) -> tuple[int, str]:
    """The most units of ``cost`` one request may send with this vocabulary (never above ``most``, at
    least 1), and why, for the refusal."""
    entry = COSTS[cost]
    per_unit = entry.at(n_vocab)
    limit = max(1, min(most, int(BUDGET_S / per_unit * (1 + 1e-9))))  # 1 / 40e-6 is 24,999.99...
    vocab = f" with {n_vocab or UNKNOWN_VOCAB:,} tokens of vocabulary" if entry.per_vocab else ""
    held = "the server loop" if entry.where == "loop" else "an HTTP thread of the child"
    why = f"{per_unit * 1000:.3g} ms of {held} per {entry.unit}{vocab}, {BUDGET_S:g} s at most"
    return limit, why
