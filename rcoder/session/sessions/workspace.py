"""Projects live under ``workspace_root``; nothing may point outside it."""

from __future__ import annotations

import os
import re
from pathlib import Path

from rcoder.domain import SessionRecord
from rcoder.errors import InvalidArgument, PermissionDenied, UnsafePath

PROJECT_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def check_project_id(project_id: str) -> None:
    if not project_id:
        raise InvalidArgument("project_id", "required: a name such as 'my-service' (letters, digits, '.', '_', '-')")
    if not PROJECT_ID.fullmatch(project_id) or set(project_id) == {"."}:
        raise InvalidArgument(
            "project_id",
            f"{project_id[:80]!r} is not a safe name: use 1-128 of [A-Za-z0-9._-], not '.' or '..'",
        )


def project_dir(workspace_root: Path, project_id: str) -> Path:
    """The project's working directory, created on first use, confined to the root."""
    check_project_id(project_id)
    root = workspace_root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    path = root / project_id
    path.mkdir(exist_ok=True)
    real = path.resolve()
    if not real.is_relative_to(root) or real == root:
        raise PermissionDenied(
            f"project {project_id!r} resolves outside workspace_root (a symlink?); refusing to run an agent there",
            reason="PROJECT_OUTSIDE_WORKSPACE",
            project_id=project_id,
        )
    return real


def stored_cwd(workspace_root: Path, record: SessionRecord) -> str:
    """The working directory a stored session resumes in, checked: it becomes the agent's write
    grant, so whoever can write the store could otherwise point it anywhere. It must be the
    session's project folder (both resolved), or the turn is refused (FAILED_PRECONDITION: the
    caller may use the session, but the stored record is not in a state rcoder acts on)."""
    project = project_dir(workspace_root, record.project_id)
    if os.path.realpath(record.cwd) != str(project):
        raise UnsafePath(
            f"session {record.session_id} is stored with cwd {record.cwd!r}, which is not its project's folder "
            f"{str(project)!r}; refusing to grant an agent write access there (was the store edited, or "
            "workspace_root moved?)",
            reason="SESSION_CWD_MISMATCH",
            session_id=record.session_id,
            cwd=record.cwd,
        )
    return record.cwd
