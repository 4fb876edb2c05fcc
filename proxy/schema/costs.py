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

# The longest one request may hold the server loop outside a decode, on the demo model.
BUDGET_S = 1.0
# The demo model's vocabulary: the one the costs were measured with.
REFERENCE_VOCAB = 49_152
# A model whose vocabulary is unknown (no GGUF header read) is taken to have Gemma 3's 262,144 tokens,
# the largest of the models llamagate is tested with: the bounds err tight.
UNKNOWN_VOCAB = 262_144


@dataclass(frozen=True, slots=True)
class UnitCost:
    """``seconds`` of the server loop per ``unit`` at ``REFERENCE_VOCAB``; ``per_vocab``: in proportion
    to the model's vocabulary; ``source``: what was measured."""

    seconds: float
    unit: str
    per_vocab: bool
    source: str

    def at(self, n_vocab: int | None) -> float:
        """Seconds per unit with a vocabulary of ``n_vocab`` tokens."""
        if not self.per_vocab:
            return self.seconds
        return self.seconds * (n_vocab or UNKNOWN_VOCAB) / REFERENCE_VOCAB


COSTS: Mapping[str, UnitCost] = MappingProxyType(
    {
        "dry_breaker": UnitCost(
            31e-3,
            "breaker",
            True,
            "DRY's setup scans every token's text for each breaker (llama_sampler_init_dry)",
        ),
        "logit_bias_entry": UnitCost(
            0.18e-3,
            "entry",
            False,
            "each entry is tokenized (text) and copied into the sampler's bias list",
        ),
        "stop_string": UnitCost(
            5e-6,
            "stop string",
            False,
            "each generated token is searched for every stop string (find_stopping_strings)",
        ),
        "tool": UnitCost(
            2e-3,
            "tool",
            False,
            "each tool adds rules to the tool-call grammar the sampler parses at setup",
        ),
        "grammar_char": UnitCost(
            2e-6,
            "character",
            False,
            "the GBNF grammar is parsed at the sampler's setup (llama_grammar_init_impl)",
        ),
        "json_schema_char": UnitCost(
            60e-6,
            "character",
            False,
            "a JSON schema is turned into a grammar, then parsed at setup (an enum of 100,000 strings: 70 s)",
        ),
        "tokenize_char": UnitCost(
            12e-6,
            "character",
            False,
            "/tokenize with parse_special: the text is split at every special token (50,000 of them: 7 s)",
        ),
    }
)


@functools.lru_cache(maxsize=256)
def cost_limit(cost: str, most: int, n_vocab: int | None) -> tuple[int, str]:
    """The most units of ``cost`` one request may send with this vocabulary (never above ``most``, at
    least 1), and why, for the refusal."""
    entry = COSTS[cost]
    per_unit = entry.at(n_vocab)
    limit = max(1, min(most, int(BUDGET_S / per_unit)))
    vocab = f" with {n_vocab or UNKNOWN_VOCAB:,} tokens of vocabulary" if entry.per_vocab else ""
    why = f"{per_unit * 1000:.3g} ms of the server loop per {entry.unit}{vocab}, {BUDGET_S:g} s at most"
    return limit, why
