"""The ACP SDK's quick import (rcoder/agent/acp/sdk.py): the same models, without field docstrings,
each built at its first use, and pydantic left as it was for every other model. Each check runs
in a fresh interpreter: this one imported the SDK long ago."""

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
from rcoder.agent.acp.sdk import import_acp
import_acp()
from acp.schema import PromptResponse, SessionNotification
deferred = not SessionNotification.__pydantic_complete__
note = SessionNotification.model_validate(
    {"sessionId": "s", "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "hi"}}}
)

class Mine(BaseModel):
    model_config = {"use_attribute_docstrings": True}
    x: int
    \"\"\"documented\"\"\"

print(json.dumps({
    "restored": _fields._update_fields_from_docstrings is usual,
    "deferred_until_used": [deferred, SessionNotification.__pydantic_complete__, PromptResponse.__pydantic_complete__],
    "mine_built": Mine.__pydantic_complete__,
    "validated": note.update.content.text,
    "sdk_description": SessionNotification.model_fields["session_id"].description,
    "mine_description": Mine.model_fields["x"].description,
}))
"""


def test_the_sdk_imports_without_docstrings_its_models_built_when_used_and_pydantic_as_it_was(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"  # a file: pydantic reads a class's docstrings from its source
    probe.write_text(PROBE)
    done = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(done.stdout)
    assert seen == {
        "restored": True,
        "deferred_until_used": [True, True, False],  # built at its first use; one not used, not built
        "mine_built": True,  # any other model: as pydantic builds it
        "validated": "hi",
        "sdk_description": None,
        "mine_description": "documented",
    }
