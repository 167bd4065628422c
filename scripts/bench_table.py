"""docs/benchmarks.md's table, from one run's bench-results.json (what ``make bench`` writes).

    .venv/bin/python scripts/bench_table.py [bench-results.json] [docs/benchmarks.md]

Replaces what lies between the page's ``<!-- bench-table -->`` and ``<!-- /bench-table -->``
lines with one table of that run: the machine and the date above it, a row a measure. The page
holds one run, never a mix; earlier runs are in git's history of the page.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- bench-table -->", "<!-- /bench-table -->"


def render(report: dict[str, Any]) -> str:
    """The table of ``report`` (bench.py's JSON), with the line that says where and when."""
    info, load = report["machine"], report.get("load_average", {})
    when = report.get("date", "an unknown date")[:10]
    reps = report.get("sizes", {}).get("reps", "?")
    start, end = (f"{v[0]:.2f}" if v else "?" for v in (load.get("start"), load.get("end")))
    lines = [
        f"Measured {when} on {info['nproc']} cores, {info['memory_GiB']} GiB, CPU `{info['cpu_model']}`, "
        f"Python {info['python']}, grpcio {info['grpcio']}: {reps} repetitions, {report.get('seconds', '?')} s "
        f"for the whole run, load average {start} at its start and {end} at its end.",
        "",
        "| measure | what | target | measured | | details |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in report["results"].items():
        ratio = "-" if result["ratio"] is None else f"{result['ratio']:.3f}"
        verdict = "" if result["ok"] is None else ("PASS" if result["ok"] else "FAIL")
        lines.append(
            f"| `{name}` | {_cell(result['what'])} | {_cell(result['target'])} | {ratio} | {verdict} "
            f"| {_cell(_details(result['details']))} |"
        )
    return "\n".join(lines)


def _details(details: dict[str, Any]) -> str:
    shown = []
    for key, value in details.items():
        if isinstance(value, list | dict) or key == "measure_s":
            continue
        shown.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return "; ".join(shown)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def update(page: str, table: str) -> str:
    """``page`` with its table replaced by ``table``; a ValueError where it has no markers."""
    if START not in page or END not in page:
        raise ValueError(f"the page has no {START} ... {END} lines to put the table between")
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv: list[str]) -> int:
    results = Path(argv[0]) if argv else ROOT / "bench-results.json"
    page = Path(argv[1]) if len(argv) > 1 else ROOT / "docs" / "benchmarks.md"
    report = json.loads(results.read_text())
    if report.get("smoke"):
        print("bench_table: a --smoke run has no figures worth a page", file=sys.stderr)
        return 2
    page.write_text(update(page.read_text(), render(report)))
    print(f"bench_table: {page} now holds the run of {report.get('date', '?')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
