"""What an agent under its own uid must write is its uid's; what leads there, only traversable.

With ``agent_user`` in effect (``rcoder.agent.confinement.agent_user``), an agent's home and its project are
given to the agent's uid and gid (``give``: once, when the folder is not its yet: a new one, one
made before, or one migrated from ``@shared``; later files rcoder writes into them take the
folder's owner, ``safe_fs``). The folders above them (``data_dir``, ``data_dir/agents``, the
profile's homes) are the daemon's and traversable only (0711: no listing; nothing in them is
readable by another uid unless its own mode says so): ``reach`` makes them so, and ``blocked``
names a folder above them that the agents' uid cannot pass.

Every walk opens folders with ``O_NOFOLLOW`` and changes owners with ``lchown`` relative to an
open folder: an agent that planted a link in its home or project gets the link itself given,
never what it points to. A file with more than one hard link is not given at all (it may be
another name of a file elsewhere: the token, the store), and logged.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

from rcoder.agent.files.beneath import DIR_FLAGS, Beneath
from rcoder.domain import ChangeKind, FileChange
from rcoder.logs import get_logger

log = get_logger(__name__)

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def owned_by(path: Path, owner: tuple[int, int]) -> bool:
    """Whether ``path`` itself (not followed) belongs to ``owner`` (uid, gid)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    return (info.st_uid, info.st_gid) == owner


def give(root: Path, owner: tuple[int, int], keep: Iterable[Path] = ()) -> int:
    """Give ``root`` and everything below it to ``owner`` (uid, gid), no link followed, leaving
    out the paths in ``keep`` (rcoder's own: ``data_dir`` inside a project) and all below them;
    how many entries changed owner."""
    kept = {os.path.realpath(p) for p in keep}
    if os.path.realpath(root) in kept:
        return 0
    fd = os.open(root, _DIR)
    try:
        changed = _give_fd(fd, owner)
        return changed + _give_below(fd, str(root), owner, kept)
    finally:
        os.close(fd)


def _give_fd(fd: int, owner: tuple[int, int]) -> int:
    info = os.fstat(fd)
    if (info.st_uid, info.st_gid) == owner:
        return 0
    os.fchown(fd, *owner)
    return 1


def _give_below(dir_fd: int, where: str, owner: tuple[int, int], kept: set[str]) -> int:
    changed = 0
    with os.scandir(dir_fd) as entries:
        names = [(entry.name, entry.stat(follow_symlinks=False)) for entry in entries]
    for name, info in names:
        path = os.path.join(where, name)
        if path in kept:
            continue
        if stat.S_ISDIR(info.st_mode):
            try:
                child = os.open(name, _DIR, dir_fd=dir_fd)
            except OSError:  # swapped for a link meanwhile (O_NOFOLLOW), or gone
                continue
            try:
                changed += _give_fd(child, owner) + _give_below(child, path, owner, kept)
            finally:
                os.close(child)
        elif info.st_nlink > 1 and not stat.S_ISLNK(info.st_mode):
            # A hard link may be another name of a file outside the home (the store, the token,
            # /etc/shadow), so it is never given to the agents' user, whoever made it.
            if (info.st_uid, info.st_gid) != owner:
                log.warning("not_given_hard_link", path=path, links=info.st_nlink)
        elif (info.st_uid, info.st_gid) != owner:
            with contextlib.suppress(FileNotFoundError):
                os.chown(name, *owner, dir_fd=dir_fd, follow_symlinks=False)
                changed += 1
    return changed


def reach(folders: Iterable[Path], up_to: Path) -> None:
    """Make each of ``folders`` (rcoder's, at or under ``up_to``, its ``data_dir``) and the folders
    between it and ``up_to`` traversable by other uids, not readable: mode 0711 (whoever owns them:
    a container's volume may be another uid's than the daemon's)."""
    top = Path(os.path.realpath(up_to))
    for folder in folders:
        path = Path(os.path.realpath(folder))
        if path != top and top not in path.parents:
            continue
        for step in [path, *path.parents]:
            # PermissionError: a folder of another user's that this daemon may not change (blocked() names it)
            with contextlib.suppress(FileNotFoundError, PermissionError):
                info = os.lstat(step)
                if stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) != 0o711:
                    os.chmod(step, 0o711)  # noqa: S103 - search only, no read: what the agents' uid needs
            if step == top:
                break


def blocked(path: Path, owner: tuple[int, int]) -> Path | None:
    """The first folder from ``/`` down to ``path`` that ``owner`` (uid, gid, no supplementary
    groups) may not pass (search), or None when it can reach ``path``."""
    uid, gid = owner
    real = Path(os.path.realpath(path))
    for step in [*reversed(real.parents), real]:
        try:
            info = os.stat(step)
        except FileNotFoundError:
            return None  # made later, by rcoder, passable
        mode = stat.S_IMODE(info.st_mode)
        bit = 0o100 if info.st_uid == uid else 0o010 if info.st_gid == gid else 0o001
        if not mode & bit:
            return step
    return None


def give_back(project: Path, changes: Sequence[FileChange], beneath: Beneath | None = None) -> None:
    """What the rewind wrote belongs to the project folder's owner, as the rest of it does (a
    daemon run as root writes as root; its agents may run as a uid of their own).

    Each entry is reached from the project's folder descriptor through real folders only
    (``Beneath.exact``) and changed with ``fchownat`` relative to its folder, never followed:
    a folder the agent swapped for a link meanwhile is left alone, so nothing outside the project
    is ever given away (docs/files.md#the-daemons-own-work). A file with more than one hard link
    is not given (it may be another name of a file elsewhere), as the rest of this module does."""
    if os.geteuid() != 0:
        return
    beneath = beneath or Beneath()
    written: set[tuple[str, ...]] = set()
    for change in changes:
        if change.kind is ChangeKind.DELETED:
            continue
        parts = tuple(name for name in change.path.split("/") if name not in ("", "."))
        if not parts or ".." in parts:
            continue
        written.update(parts[:i] for i in range(1, len(parts) + 1))
    root = os.open(project, DIR_FLAGS | os.O_NOFOLLOW)
    try:
        owner = os.fstat(root)
        for parts in sorted(written):
            try:
                folder = beneath.exact(root, parts[:-1], DIR_FLAGS)
            except OSError:  # gone, or a name on the way is a link now: not followed
                continue
            try:
                info = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False)
                if (info.st_uid, info.st_gid) == (owner.st_uid, owner.st_gid):
                    continue
                if info.st_nlink > 1 and not stat.S_ISDIR(info.st_mode) and not stat.S_ISLNK(info.st_mode):
                    log.warning("not_given_hard_link", path="/".join(parts), links=info.st_nlink)
                    continue
                os.chown(parts[-1], owner.st_uid, owner.st_gid, dir_fd=folder, follow_symlinks=False)
            except FileNotFoundError:
                pass
            finally:
                os.close(folder)
    finally:
        os.close(root)
