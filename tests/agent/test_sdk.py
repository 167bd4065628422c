"""The ACP SDK's quick import (rcoder/agent/sdk.py): the same models, without field docstrings,
and pydantic left as it was for every other model. Each check runs in a fresh interpreter: this
one imported the SDK long ago."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = """
import json
from pydantic import BaseModel
from pydantic._internal import _fields
usual = _fields._update_fields_from_docstrings
from rcoder.agent.sdk import import_acp
import_acp()
from acp.schema import SessionNotification
note = SessionNotification.model_validate(
    {"sessionId": "s", "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "hi"}}}
)

class Mine(BaseModel):
    model_config = {"use_attribute_docstrings": True}
    x: int
    \"\"\"documented\"\"\"

print(json.dumps({
    "restored": _fields._update_fields_from_docstrings is usual,
    "validated": note.update.content.text,
    "sdk_description": SessionNotification.model_fields["session_id"].description,
    "mine_description": Mine.model_fields["x"].description,
}))
"""


def test_the_sdk_imports_without_field_docstrings_and_leaves_pydantic_as_it_was(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"  # a file: pydantic reads a class's docstrings from its source
    probe.write_text(PROBE)
    done = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(done.stdout)
    assert seen == {"restored": True, "validated": "hi", "sdk_description": None, "mine_description": "documented"}
