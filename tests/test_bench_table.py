"""scripts/bench_table.py: docs/benchmarks.md's table is one run's, rendered from its JSON."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from bench_table import END, START, render, update

pytestmark = pytest.mark.fast

REPORT = {
    "machine": {"nproc": 2, "memory_GiB": 23.5, "cpu_model": "AMD EPYC", "python": "3.11.7", "grpcio": "1.85.1"},
    "date": "2026-12-04T20:50:00+00:00",
    "sizes": {"reps": 7},
    "seconds": 300.0,
    "load_average": {"start": [0.5, 0.4, 0.3], "end": [1.25, 1.0, 0.9]},
    "results": {
        "cold_first_turn": {"what": "spawn | to end", "ratio": 1.1041, "target": "<= 1.2", "ok": True,
                            "details": {"daemon_ms": 144.12, "all_ms": [1.0], "measure_s": 7.4}},
        "daemon_start_to_serving": {"what": "start", "ratio": None, "target": "report", "ok": None,
                                    "details": {"median_ms": 687.0}},
        "first_chunk_live": {"what": "live", "ratio": 1.3, "target": "<= 1.15", "ok": False, "details": {}},
    },
}  # fmt: skip


def test_the_table_has_the_run_s_machine_and_date_and_a_row_a_measure() -> None:
    table = render(REPORT).splitlines()
    assert table[0].startswith("Measured 2026-12-04 on 2 cores, 23.5 GiB, CPU `AMD EPYC`")
    assert "load average 0.50 at its start and 1.25 at its end" in table[0]
    rows = [line for line in table if line.startswith("| `")]
    assert rows == [
        r"| `cold_first_turn` | spawn \| to end | <= 1.2 | 1.104 | PASS | daemon_ms 144.1 |",
        "| `daemon_start_to_serving` | start | report | - |  | median_ms 687 |",
        "| `first_chunk_live` | live | <= 1.15 | 1.300 | FAIL |  |",
    ]


def test_the_page_keeps_everything_but_the_old_table() -> None:
    page = f"# Benchmarks\n\nintro\n\n{START}\nold table\n{END}\n\nhow to read it\n"
    updated = update(page, "new table")
    assert updated == f"# Benchmarks\n\nintro\n\n{START}\nnew table\n{END}\n\nhow to read it\n"
    with pytest.raises(ValueError, match="no <!-- bench-table -->"):
        update("# no markers\n", "new table")
