"""The API contract's checks (``make check-api``, part of ``make test``): buf lint and buf breaking.

Lint: buf.yaml's rules (STANDARD), less four that names fixed by the contract break. Those four
run here again, and allow exactly the names in ``EXCEPTIONS``, each with its reason: a new RPC or
service that breaks them still fails.

Breaking: ``proto/`` against ``api/baseline/``, the proto of the last release, with buf.yaml's FILE
rules: a field, enum value, message, RPC or file renamed, renumbered, retyped or deleted fails;
additions pass. On a release the baseline moves forward (``make api-baseline``, committed with it).

``--root`` checks another tree laid out as this one (tests/test_api_contract.py checks altered
copies, to show each check can fail).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools" / "node_modules"
# npm installs the one binary package of this platform (@bufbuild/buf-linux-x64, ...); run it without
# the node launcher in .bin, which only finds it and costs a node start per call
BUF = next(iter(sorted(TOOLS.glob("@bufbuild/buf-*/bin/buf"))), TOOLS / ".bin" / "buf")
BASELINE = Path("api") / "baseline"
TIMEOUT = 120.0

# (rule, the RPC or service it names) -> why the contract keeps that name
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("SERVICE_SUFFIX", "AgentRunner"): "the contract's service name; every client's generated stub is named after it",
    ("RPC_REQUEST_RESPONSE_UNIQUE", "Chat"): "Chat and Subscribe stream the same ChatStream: a client that "
    "re-attaches with Subscribe reads the very events Chat streamed, with one handler for both",
    ("RPC_REQUEST_RESPONSE_UNIQUE", "Subscribe"): "as for Chat: Subscribe re-attaches to Chat's stream",
    ("RPC_RESPONSE_STANDARD_NAME", "Chat"): "the contract names Chat's stream ChatStream, not ChatResponse",
    ("RPC_RESPONSE_STANDARD_NAME", "Subscribe"): "Subscribe streams ChatStream, the events of a Chat",
    ("RPC_RESPONSE_STANDARD_NAME", "GetSession"): "GetSession returns the Session record itself, the message "
    "ListSessions pages, not a wrapper around it",
    ("RPC_RESPONSE_STANDARD_NAME", "ReadFile"): "ReadFile streams FileChunk, the name issue 34 gave it: each "
    "message is one chunk of the file, not an answer to the request",
    ("RPC_REQUEST_STANDARD_NAME", "WriteFile"): "WriteFile takes a stream of WriteFileChunk, the name issue 34 "
    "gave it: each message is one chunk of the file, the first also naming it",
}
_DECLARATION = re.compile(r"^\s*(?:rpc|service)\s+(\w+)")


def buf(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BUF), *args], cwd=root, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )  # fmt: skip


def excepted_rules(root: Path) -> set[str]:
    """The rules buf.yaml's ``lint.except`` leaves out (a list of ``- NAME`` lines)."""
    rules: set[str] = set()
    inside = False
    for line in (root / "buf.yaml").read_text().splitlines():
        if re.match(r"^\s*except:\s*$", line):
            inside = True
        elif inside and (item := re.match(r"^\s*-\s*([A-Z_]+)\s*$", line)):
            rules.add(item.group(1))
        elif inside and line.strip() and not line.lstrip().startswith("#"):
            inside = False
    return rules


def declared_at(root: Path, path: str, line: int) -> str:
    """The RPC or service whose declaration holds ``line`` (an rpc may span lines)."""
    lines = (root / path).read_text().splitlines()
    for text in reversed(lines[:line]):
        if found := _DECLARATION.match(text):
            return found.group(1)
    return ""


def lint(root: Path) -> list[str]:
    problems = []
    result = buf(root, "lint")
    if result.returncode != 0:
        problems.append(result.stdout + result.stderr)
    rules = sorted({rule for rule, _ in EXCEPTIONS})
    if excepted_rules(root) != set(rules):
        problems.append(f"buf.yaml's lint.except must be the rules of {Path(__file__).name}'s EXCEPTIONS: {rules}")
    config = {"version": "v2", "modules": [{"path": "proto"}], "lint": {"use": rules}}
    result = buf(root, "lint", "--config", json.dumps(config), "--error-format", "json")
    if result.returncode not in (0, 100):  # 100: found problems, listed on stdout
        problems.append(result.stdout + result.stderr)
        return problems
    for row in map(json.loads, result.stdout.splitlines()):
        name = declared_at(root, row["path"], row["start_line"])
        if (row["type"], name) not in EXCEPTIONS:
            problems.append(f"{row['path']}:{row['start_line']}:{row['start_column']}:{row['message']} ({row['type']})")
    return problems


def breaking(root: Path) -> list[str]:
    result = buf(root, "breaking", "--against", str(BASELINE))
    if result.returncode == 0:
        return []
    rule = "rename nothing, renumber nothing, delete nothing"
    return [f"changed against {BASELINE} ({rule}):\n{result.stdout}{result.stderr}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree to check (default: this repository)")
    opts = parser.parse_args()
    if not BUF.exists():
        print(f"{BUF} is missing: run `make tools`", file=sys.stderr)
        return 2
    problems = lint(opts.root) + breaking(opts.root)
    for problem in problems:
        print(problem.rstrip(), file=sys.stderr)
    if problems:
        return 1
    print(f"buf lint and buf breaking against {BASELINE}: the API contract holds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
