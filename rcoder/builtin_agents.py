"""The agent profiles rcoder ships, as ``[agents.<name>]`` tables: no config file needed.

``rcoder.config`` checks them like any other table (``builtin_profiles``), and a
table of the same name in the config file changes only the keys it sets.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# The pinned agents `make agents` installs, beside the rcoder package (not the cwd).
AGENTS_DIR = Path(__file__).resolve().parent.parent / "agents" / "node_modules"

# profile (and kind) name: its path under AGENTS_DIR, its args, the daemon variables passed through
_INSTALLED = {
    "claude": (".bin/claude-agent-acp", [], ["ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"]),
    "claude-legacy": (".bin/claude-code-acp", [], ["ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"]),
    "codex": ("@zed-industries/codex-acp-linux-x64/bin/codex-acp", [], ["OPENAI_API_KEY"]),
    "gemini": (".bin/gemini", ["--acp"], ["GEMINI_API_KEY"]),
    "opencode": ("opencode-linux-x64/bin/opencode", ["acp", "--pure"], []),
}


def builtin_tables(data_dir: Path) -> dict[str, dict[str, Any]]:
    """The agents ``make agents`` installs (each the installed program, else its name on PATH),
    and ``echo``: rcoder's own, no model needed, its sessions kept in its home under ``data_dir``."""

    def command(relative: str) -> str:
        path = AGENTS_DIR / relative
        return str(path) if path.is_file() else path.name

    # The echo agent is rcoder/echo_agent.py, run with -P so that the project's cwd never shadows the
    # rcoder package. Confined, it reads the rcoder package and writes its state in
    # <state-dir>/sessions; it has no tools, so it reaches nothing else anyway. That folder, not the
    # profile's homes folder, is what it is granted: under a uid of its own (agent_user) the folder
    # belongs to the agent, while the homes folder stays rcoder's.
    echo_home = (data_dir / "agents" / "echo").absolute()  # Settings.agent_homes
    echo = {
        "command": sys.executable,
        "args": ["-P", "-m", "rcoder.echo_agent", "--state-dir", str(echo_home)],
        "read_paths": [str(Path(__file__).resolve().parent)],
        "write_paths": [str(echo_home / "sessions")],
    }
    return {"echo": echo} | {
        name: {"kind": name, "command": command(relative), "args": args, "inherit_env": inherit}
        for name, (relative, args, inherit) in _INSTALLED.items()
    }
