"""What a test needs to run agents under a uid of their own (``agent_user = "UID:GID"``).

``AGENT_UID`` is numeric and has no passwd entry: no user is made on the machine. The test's
folders are under an ``OpenRoot`` (a temporary folder other uids may pass, not list), since
``tmp_path`` is below pytest's 0700 folder. The checkout itself may be where that uid cannot go
(CI clones under ``/root``, 0700; the virtual environment's Python may be pyenv's there): then
``AgentKit`` copies what the fake agent runs (its script, rcoder's package, the site-packages it
imports) into the open root and runs it with the system's Python, which must be the same minor
version (compiled packages are copied as they are).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rcoder.agent.files.ownership import blocked
from tests.harness import FAKE_AGENT, FAKE_AGENT_READS, ROOT, FakeAgentSetup

AGENT_UID = AGENT_GID = 64123
AGENT_USER = f"{AGENT_UID}:{AGENT_GID}"
SYSTEM_PYTHON = Path("/usr/bin/python3")
# what the fake agent imports, as checked below; its own script and rcoder's package besides
_IMPORTS = (
    "import sys\nfrom rcoder.agent.acp.sdk import import_acp\nimport_acp()\n"
    "import acp, acp.schema, acp.helpers, acp.connection, acp.core\n"
)


_KIT: AgentKit | None = None


def as_agent(*argv: str) -> list[str]:
    """``argv`` as the agents' uid and gid, no supplementary groups (util-linux setpriv)."""
    return ["setpriv", f"--reuid={AGENT_UID}", f"--regid={AGENT_GID}", "--clear-groups", "--", *argv]


def open_root() -> Path:
    """A new temporary folder other uids may pass (0711) but not list; the caller removes it."""
    root = Path(tempfile.mkdtemp(prefix="rcoder-agent-user-"))
    root.chmod(0o711)
    return root


def reaches(argv: list[str], env: dict[str, str] | None = None) -> bool:
    """Whether ``argv`` runs to success as the agents' uid."""
    done = subprocess.run(as_agent(*argv), capture_output=True, timeout=60, check=False, env=env, cwd="/")
    return done.returncode == 0


@dataclass
class AgentKit:
    """The fake agent as the agents' uid can run it: from the checkout where it can reach it,
    else from a copy in the open root, run by the system's Python."""

    python: str
    script: Path
    reads: list[str]  # what a confined agent must read (read_paths)
    env: dict[str, str]  # the profile's env

    @classmethod
    def make(cls, root: Path | None = None) -> AgentKit:
        """The kit, made once per test process (a copy takes seconds) in an open folder of its
        own, removed when the process exits; ``root`` is not used (kept for the callers)."""
        global _KIT
        if _KIT is None:
            _KIT = cls._make()
        return _KIT

    @classmethod
    def _make(cls) -> AgentKit:
        # by the file modes on the way (a run alone may pass where a confined agent's exec is refused)
        reachable = not any(blocked(Path(p), (AGENT_UID, AGENT_GID)) for p in (sys.executable, FAKE_AGENT, ROOT))
        if reachable and reaches([sys.executable, "-c", _IMPORTS]):
            return cls(sys.executable, FAKE_AGENT, list(FAKE_AGENT_READS), {})
        kit = open_root()
        atexit.register(shutil.rmtree, kit, ignore_errors=True)
        site = kit / "site"
        site.mkdir(parents=True)
        shutil.copytree(ROOT / "rcoder", site / "rcoder", ignore=shutil.ignore_patterns("__pycache__"))
        for found in _packages():
            if found.is_dir():
                shutil.copytree(found, site / found.name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(found, site / found.name)
        script = kit / FAKE_AGENT.name
        shutil.copy(FAKE_AGENT, script)
        # compiled once here: the agent's uid cannot write __pycache__, and would compile every start
        subprocess.run([str(SYSTEM_PYTHON), "-m", "compileall", "-q", str(kit)], check=False, timeout=120)
        subprocess.run(["chmod", "-R", "a+rX", str(kit)], check=True, timeout=60)
        env = {"PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
        if not reaches([str(SYSTEM_PYTHON), "-c", _IMPORTS], env={**env, "PATH": "/usr/bin:/bin"}):
            raise RuntimeError(
                f"uid {AGENT_UID} can neither run {sys.executable} nor {SYSTEM_PYTHON} with a copy of the fake "
                "agent's packages (the system's Python must be Python "
                f"{sys.version_info.major}.{sys.version_info.minor})"
            )
        return cls(str(SYSTEM_PYTHON), script, [str(kit)], env)

    def profile(self, fake: FakeAgentSetup, **keys: Any) -> dict[str, Any]:
        """The fake agent's profile (as ``FakeAgentSetup.profile``), run from this kit."""
        args = [str(self.script), "--state-dir", str(fake.state_dir), "--record", str(fake.record)]
        reach = {"read_paths": self.reads, "write_paths": [str(fake.folder)]}
        return {"command": self.python, "args": args, **reach, "env": self.env, **keys}


def _packages() -> Iterator[Path]:
    """The packages (folders) and modules (files) of site-packages the fake agent imports."""
    code = (
        _IMPORTS
        + "print('\\n'.join(sorted({m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None)"
        + " and 'site-packages' in m.__file__})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    seen: set[Path] = set()
    for line in done.stdout.splitlines():
        path = Path(line)
        parts = path.parts
        top = Path(*parts[: parts.index("site-packages") + 2])
        if top.name.startswith(("_", "rcoder")) or top in seen:
            continue
        seen.add(top)
        yield top


def give_fake(fake: FakeAgentSetup) -> None:
    """The fake agents' own folder (their state and record) theirs: they write it."""
    for path in (fake.folder, *fake.folder.rglob("*")):
        os.chown(path, AGENT_UID, AGENT_GID)
