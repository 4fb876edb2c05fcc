"""``python -m tests.benchmarks.store_write``: the SQLite writer's CPU per usage row, as the store writes a
batch now (multi-row ``INSERT ... VALUES`` with bound parameters, ``proxy.accounts.sqlite``) against the
earlier way (the batch as one JSON array, each column read with ``json_extract`` over ``json_each``).

Both run in one process on one fresh file each, alternating batch by batch, the same rows (the shape of
a chat request's record), inside a transaction per batch as the writer commits them. CPU is this
process's (``time.process_time``): the writer thread's share of the daemon's CPU per request.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from proxy.accounts.records import Batch, UsageRecord
from proxy.accounts.sqlbase import USAGE_COLUMNS
from proxy.accounts.sqlite import open_store
from supervisor.errors import UsageError
from tests.benchmarks import cli

_JSON_INSERT = (
    f"INSERT INTO usage_events ({USAGE_COLUMNS}) SELECT "
    + ", ".join(f"json_extract(value, '$[{i}]')" for i in range(12))
    + " FROM json_each(?)"
)


def _rows(count: int, at: float) -> tuple[UsageRecord, ...]:
    return tuple(
        UsageRecord(
            "bench",
            "a7e476b5aef1",
            "gemma-3-270m",
            "chat",
            12,
            0,
            16,
            200,
            0.0123,
            at + i / 1000,
            f"{at}-{i:012x}",
        )
        for i in range(count)
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, default=40, help="batches per way (40)")
    parser.add_argument("--rows", type=int, default=500, help="rows per batch, the writer's batch size (500)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")


def handle(args: argparse.Namespace) -> int:
    if args.batches < 1 or args.rows < 1:
        raise UsageError("--batches and --rows must be >= 1")
    with tempfile.TemporaryDirectory(prefix="llamagate-store-write-") as folder:
        store = open_store(Path(folder) / "values.db")
        open_store(Path(folder) / "json.db").close()  # the same schema, written raw below
        raw = sqlite3.connect(Path(folder) / "json.db", isolation_level=None)
        raw.execute("PRAGMA synchronous=NORMAL")

        def as_json(rows: tuple[UsageRecord, ...]) -> None:
            raw.execute("BEGIN IMMEDIATE")
            raw.execute(_JSON_INSERT, (json.dumps(rows),))
            raw.execute("COMMIT")

        def as_values(rows: tuple[UsageRecord, ...]) -> None:
            store.write(Batch(usage=rows))  # the ledger rows and their hourly rollup, one transaction

        ways: dict[str, Callable[[tuple[UsageRecord, ...]], None]] = {"values": as_values, "json": as_json}
        per_row: dict[str, list[float]] = {name: [] for name in ways}
        start = time.time()
        for i in range(args.batches):
            order = list(ways) if i % 2 == 0 else list(reversed(ways))
            for name in order:
                rows = _rows(args.rows, start + i * 10 + (0.5 if name == "json" else 0))
                cpu = time.process_time()
                ways[name](rows)
                per_row[name].append((time.process_time() - cpu) / args.rows * 1e6)
        store.close()
        raw.close()
    result = {
        "sqlite": sqlite3.sqlite_version,
        "rows_per_batch": args.rows,
        "batches": args.batches,
        **{f"{name}_us_per_row_median": round(statistics.median(v), 2) for name, v in per_row.items()},
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(
            json.dumps({"command": cli.command_line("store_write"), "results": result}, indent=2)
        )
    return 0


def main() -> int:
    return cli.run("store_write", __doc__, add_arguments, handle)


if __name__ == "__main__":
    raise SystemExit(main())
