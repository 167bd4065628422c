"""What one history batch costs on PostgreSQL (``PostgresStore.append_events``), the way the
history writer sends it: every running turn's new events in one call, each run under its
session's lease. Run on a throwaway cluster (tests/pg.py) on this machine:

    .venv/bin/python scripts/flush_cost.py [--rounds 200]

For each shape (runs in the batch x events per run) it prints the median and 90th percentile
of a call's wall time (one round trip and the server's work) over ``--rounds`` calls. Written to
compare the unfenced batch with the fenced one: it calls ``append_events`` with the leases when
the store takes them.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rcoder.store.base import EventRow
from rcoder.store.cluster import Lease, Taken
from rcoder.store.pg_cluster import PgCoordination
from rcoder.store.postgres import PostgresStore
from tests.pg import PgCluster

SHAPES = ((1, 5), (10, 5), (50, 20), (200, 5))  # (runs in the batch, events of each run)
BODY = '{"text":"' + "x" * 60 + '"}'  # a merged text chunk of a quick agent


async def measure(url: str, rounds: int) -> None:
    store = PostgresStore(url, "host-a")
    await store.open()
    coordination = PgCoordination(store, 600.0)
    fenced = "leases" in inspect.signature(store.append_events).parameters
    print(f"append_events {'with' if fenced else 'without'} leases; {rounds} calls a shape")
    try:
        for runs, per_run in SHAPES:
            leases: dict[str, Lease] = {}
            for n in range(runs):
                taken = await coordination.acquire(f"s-{runs}-{n}")
                assert isinstance(taken, Taken)
                leases[f"r-{runs}-{n}"] = taken.lease
            times = []
            seq = 0
            for _ in range(rounds):
                now = datetime.now(UTC)
                rows = [
                    EventRow(f"s-{runs}-{n}", f"r-{runs}-{n}", seq + k, now, "text", BODY)
                    for n in range(runs)
                    for k in range(1, per_run + 1)
                ]
                seq += per_run
                started = time.perf_counter()
                if fenced:
                    await store.append_events(rows, leases)
                else:
                    await store.append_events(rows)
                times.append((time.perf_counter() - started) * 1000)
            times.sort()
            p90 = times[int(len(times) * 0.9)]
            print(
                f"  {runs:4d} runs x {per_run:3d} events: median {statistics.median(times):6.2f} ms, p90 {p90:6.2f} ms"
            )
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    cluster = PgCluster.create()
    try:
        asyncio.run(measure(cluster.create_schema(), args.rounds))
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
