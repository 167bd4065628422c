"""``make check-api`` (scripts/check_api.py: buf lint, buf breaking against api/baseline) on altered
copies of the proto: each change the contract forbids fails it, and what it allows passes.

No daemon: each case copies buf.yaml, proto/ and api/ to a folder of its own and runs the check there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "scripts" / "check_api.py"
PROTO = Path("proto") / "rcoder" / "v1" / "agent_runner.proto"


# ChatRequest.prompt, by the comment above it (RunInfo has a field of the same name and number)
ASKED = "// Required unless attachments are given.\n  "


def check(tmp_path: Path, *edits: tuple[str, str], buf_yaml: tuple[str, str] | None = None) -> tuple[int, str]:
    """scripts/check_api.py on a copy of the contract with ``edits`` (old text -> new, each found once)."""
    for name in ("proto", "api"):
        shutil.copytree(ROOT / name, tmp_path / name)
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    for path, (old, new) in [(PROTO, edit) for edit in edits] + ([(Path("buf.yaml"), buf_yaml)] if buf_yaml else []):
        text = (tmp_path / path).read_text()
        assert text.count(old) == 1, f"{old!r} is not once in {path}: the case no longer alters what it says"
        (tmp_path / path).write_text(text.replace(old, new))
    done = subprocess.run(
        [sys.executable, str(CHECK), "--root", str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


ADDITIONS = (
    ("  string prompt = 3;\n", "  string prompt = 3;\n  string added_by_a_later_change = 999;\n"),
    (
        "service AgentRunner {\n",
        "service AgentRunner {\n  rpc Ping(PingRequest) returns (PingResponse);\n",
    ),
    (
        "message SubscribeRequest {",
        "message PingRequest {}\nmessage PingResponse { bool ok = 1; }\n\nmessage SubscribeRequest {",
    ),
)


def test_additions_pass_fields_messages_and_rpcs(tmp_path: Path) -> None:
    # (also the control of the cases below: the copy, unaltered but for additions, passes)
    code, output = check(tmp_path, *ADDITIONS)
    assert code == 0, output
    assert "the API contract holds" in output


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        pytest.param(
            (ASKED + "string prompt = 3;", ASKED + "string prompt = 30;"),
            'field "3" with name "prompt"',
            id="renumbered-field",
        ),
        pytest.param(
            (ASKED + "string prompt = 3;", ASKED + "string text = 3;"),
            'changed name from "prompt" to "text"',
            id="renamed-field",
        ),
        pytest.param(
            (ASKED + "string prompt = 3;", ASKED + "bytes prompt = 3;"),
            'type from "string" to "bytes"',
            id="retyped-field",
        ),
        pytest.param(
            ("  rpc ListHosts(ListHostsRequest) returns (ListHostsResponse);\n", ""),
            'RPC "ListHosts" on service "AgentRunner" was deleted',
            id="deleted-rpc",
        ),
    ],
)
def test_a_renumbered_renamed_retyped_or_deleted_name_fails_the_breaking_check(
    tmp_path: Path, edit: tuple[str, str], says: str
) -> None:
    code, output = check(tmp_path, edit)
    assert code == 1, output
    assert "changed against api/baseline" in output and says in output


def test_a_new_rpc_breaking_a_rule_excepted_for_the_contracts_names_fails_lint(tmp_path: Path) -> None:
    # the rule left out in buf.yaml for Chat, Subscribe and GetSession holds for every other RPC
    code, output = check(
        tmp_path,
        ("service AgentRunner {\n", "service AgentRunner {\n  rpc Ping(PingRequest)\n      returns (Pong);\n"),
        ("message SubscribeRequest {", "message PingRequest {}\nmessage Pong {}\n\nmessage SubscribeRequest {"),
    )
    assert code == 1, output
    assert 'RPC response type "Pong" should be named "PingResponse"' in output
    assert "ChatStream" not in output and "GetSession" not in output  # the contract's names stay allowed


def test_buf_yaml_excepting_a_rule_the_check_does_not_run_again_fails(tmp_path: Path) -> None:
    # leaving a rule out in buf.yaml alone would loosen lint for every name: it must be in EXCEPTIONS too
    code, output = check(
        tmp_path, buf_yaml=("    - SERVICE_SUFFIX\n", "    - SERVICE_SUFFIX\n    - ENUM_ZERO_VALUE_SUFFIX\n")
    )
    assert code == 1, output
    assert "buf.yaml's lint.except must be the rules of check_api.py's EXCEPTIONS" in output
