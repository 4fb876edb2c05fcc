"""The conversations' disk tier in ``/metrics`` (``proxy.conversations.tier``), read at scrape time from
every model's tier: prompt tokens by where they came from, saves and restores (counts, bytes, seconds),
restores not reused, states refused or evicted, and the folder's bytes against its budget; what the write
policy left unwritten and why, each tenant's measured return rate, and the write rate bound
(``proxy.conversations.writes``). Bytes written against bytes restored, by model: ``save_bytes`` and
``restore_bytes`` summed over tenants.

``llamagate_prompt_tokens_by_source_total{source}``: ``cache`` (served from the slot or llama-server's RAM
cache), ``disk`` (the part of those a restore from disk brought), ``computed`` (evaluated): a prompt-cache
hit rate per model and tenant, for the turns placed on a slot (a conversation's turns).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.conversations.tier import DiskTier

Tiers = Callable[[], Mapping[str, DiskTier]]


class TierCollector(Collector):
    def __init__(self, tiers: Tiers) -> None:
        self._tiers = tiers

    def collect(self) -> Iterator[Metric]:
        mt = ["model", "tenant"]
        prompt = CounterMetricFamily(
            "llamagate_prompt_tokens_by_source",
            "Prompt tokens of conversation turns by source: cache (slot or RAM), disk (restored), computed",
            labels=[*mt, "source"],
        )
        counters = {
            name: CounterMetricFamily(f"llamagate_conversation_state_{name}", doc, labels=mt)
            for name, doc in (
                ("saves", "Conversation states saved to disk"),
                ("save_bytes", "Bytes of conversation states saved to disk"),
                ("save_seconds", "Seconds spent saving conversation states, waits for the child included"),
                ("save_child_seconds", "Seconds the child spent writing states (its other slots wait)"),
                ("restores", "Conversation states restored from disk"),
                ("restore_bytes", "Bytes of conversation states restored from disk"),
                ("restore_seconds", "Seconds spent checking and restoring conversation states"),
                ("restore_child_seconds", "Seconds the child spent reading states (its other slots wait)"),
                ("misses", "Restored states the turn did not reuse (its cached count fell short)"),
                ("evictions", "Conversation states removed to keep the disk budget"),
                ("save_failures", "Conversation states that could not be saved"),
            )
        }
        refused = CounterMetricFamily(
            "llamagate_conversation_state_refused",
            "States on disk not restored: changed, tenant, unsafe, failed (refused by the child)",
            labels=[*mt, "reason"],
        )
        skipped = CounterMetricFamily(
            "llamagate_conversation_state_writes_skipped",
            "States that left a slot unwritten: one_shot (not likely to come back), rate (the write bound)",
            labels=[*mt, "reason"],
        )
        returns = GaugeMetricFamily(
            "llamagate_conversation_state_return_rate",
            "The share of the tenant's unnamed conversations that come back for a second turn (prior incl.)",
            labels=mt,
        )
        limit = GaugeMetricFamily(
            "llamagate_conversation_state_write_limit_bytes_per_second",
            "The disk tier's write rate bound (llama.state_write_mib_s); 0 = unbounded",
            labels=["model"],
        )
        held = GaugeMetricFamily(
            "llamagate_conversation_state_disk_bytes",
            "Bytes of conversation states on disk",
            labels=["model"],
        )
        budget = GaugeMetricFamily(
            "llamagate_conversation_state_disk_budget_bytes",
            "The disk budget of conversation states (llama.state_disk_mib)",
            labels=["model"],
        )
        restoring = GaugeMetricFamily(
            "llamagate_conversation_state_restoring",
            "1 while states are restored; 0 after repeated misses (or with the tier off)",
            labels=["model"],
        )
        for model, tier in self._tiers().items():
            s = tier.stats
            for (tenant, source), n in s.prompt_tokens.items():
                prompt.add_metric([model, tenant, source], n)
            for name, values in (
                ("saves", s.saves),
                ("save_bytes", s.save_bytes),
                ("save_seconds", s.save_seconds),
                ("save_child_seconds", s.save_child_seconds),
                ("restores", s.restores),
                ("restore_bytes", s.restore_bytes),
                ("restore_seconds", s.restore_seconds),
                ("restore_child_seconds", s.restore_child_seconds),
                ("misses", s.misses),
                ("evictions", s.evicted),
                ("save_failures", s.save_failures),
            ):
                for tenant, value in values.items():
                    counters[name].add_metric([model, tenant], value)
            for (tenant, reason), n in s.refused.items():
                refused.add_metric([model, tenant, reason], n)
            for (tenant, reason), n in s.skipped.items():
                skipped.add_metric([model, tenant, reason], n)
            for tenant, rate in tier.writes.return_rates().items():
                returns.add_metric([model, tenant], rate)
            limit.add_metric([model], tier.writes.rate_bytes_s or 0)
            folder = tier.folder
            if folder is not None:
                held.add_metric([model], folder.bytes)
                budget.add_metric([model], folder.budget)
            restoring.add_metric([model], 1 if folder is not None and tier.restoring else 0)
        yield prompt
        yield from counters.values()
        yield from (refused, skipped, returns, limit, held, budget, restoring)
