"""Where this host's WriteFile calls are writing (docs/files.md#writes), so that the temporary
files, and the folders, of a daemon killed mid-upload are removed when it starts again.

Before a write makes its temporary file in the project, it notes the file's project, folder and
name in ``<data_dir>/uploads/``; before it makes a folder on the way to its target, it adds that
folder to the note (and takes it out again when the folder turned out to exist already: someone
else's). It removes the note once the file is renamed into place or removed, with the folders it
made. A note left behind names a temporary file, and folders, that no write will finish: the next
start removes them (``rcoder.session.files.project_files.ProjectFiles.sweep_uploads``), a folder only while it
is empty. Folders and the temporary file's folder are noted as the kernel resolved them (links
inside the project followed), so the removal reaches them through real folders only. This costs a
small file in rcoder's own folder per write, rewritten once per folder made, and finds every
leftover without walking the workspace. Each host keeps its own notes (``data_dir`` is its own), so
a host never removes another's upload.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rcoder.logs import get_logger

log = get_logger(__name__)
TEMP_PREFIX = ".rcoder-upload-"  # a write's file until it is renamed over its path
TEMP_NAME = re.compile(re.escape(TEMP_PREFIX) + r"[0-9a-f]{32}\.tmp")


def temp_name() -> str:
    """A new temporary file's name (``TEMP_NAME``)."""
    return f"{TEMP_PREFIX}{uuid.uuid4().hex}.tmp"


@dataclass(frozen=True, slots=True)
class Upload:
    """A temporary file a write made, by its project, its folder's parts and its name."""

    project_id: str
    folder: tuple[str, ...]
    name: str
    folders: tuple[tuple[str, ...], ...] = ()  # the folders it made, outermost first


class UploadJournal:
    def __init__(self, folder: Path) -> None:
        self._folder = folder

    def note(self, upload: Upload) -> Path:
        """Record ``upload`` before its file or a folder of it is made, or again with what it made
        since (blocking: called in the write's thread). The note is replaced whole (written beside,
        then renamed): a kill mid-write leaves the note before, never half of one."""
        self._folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        note = self._folder / f"{upload.name}.json"
        fields = {
            "project_id": upload.project_id,
            "folder": upload.folder,
            "name": upload.name,
            "folders": upload.folders,
        }
        draft = self._folder / f"{upload.name}.draft"
        draft.write_text(json.dumps(fields))
        os.replace(draft, note)
        return note

    @staticmethod
    def done(note: Path) -> None:
        """The upload's file is renamed into place or removed: forget it (idempotent)."""
        note.unlink(missing_ok=True)

    def left(self) -> Iterator[tuple[Path, Upload | None]]:
        """Every note a stopped daemon left, with its upload (None: a note that does not read as one)."""
        if not self._folder.is_dir():
            return
        for draft in self._folder.glob("*.draft"):  # a note being replaced when the daemon stopped
            draft.unlink(missing_ok=True)
        for note in sorted(self._folder.glob("*.json")):
            yield note, _read(note)


def _read(note: Path) -> Upload | None:
    try:
        fields = json.loads(note.read_text())
        folders = tuple(tuple(str(p) for p in folder) for folder in fields.get("folders", ()))
        folder = tuple(str(p) for p in fields["folder"])
        upload = Upload(str(fields["project_id"]), folder, str(fields["name"]), folders)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("upload_note_unreadable", note=str(note), error=str(exc)[:200])
        return None
    return upload if TEMP_NAME.fullmatch(upload.name) else None
