"""Paths opened beneath a project (rcoder.agent.files.beneath): the kernel's openat2 and the walk that
stands in for it where the kernel lacks it answer alike, link by link."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rcoder.agent.files.beneath import Beneath, below, open_project, path_parts, remove_empty_folder
from rcoder.errors import InvalidArgument, NotFound, PermissionDenied

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)


@pytest.fixture(params=["openat2", "walk"])
def beneath(request: pytest.FixtureRequest) -> Beneath:
    kernel = request.param == "openat2"
    if kernel and not Beneath().kernel:
        pytest.skip("this kernel has no openat2")
    return Beneath(kernel=kernel)


@pytest.fixture
def root(tmp_path: Path) -> Iterator[int]:
    """A project with links of every sort, open as a descriptor."""
    project = tmp_path / "workspace" / "proj"
    (project / "src" / "pkg").mkdir(parents=True)
    (project / "src" / "pkg" / "mod.py").write_text("inside\n")
    (tmp_path / "outside.txt").write_text("outside\n")
    os.symlink("src/pkg", project / "pkg-link")  # inside, relative
    os.symlink("../src", project / "src" / "loop")  # inside, through '..'
    os.symlink("../..", project / "src" / "up-two")  # out, by '..' past the project
    os.symlink(tmp_path / "outside.txt", project / "abs-out")  # out, absolute
    os.symlink(project / "src", project / "abs-in")  # absolute, even pointing inside: refused as the kernel does
    os.symlink("chain-b", project / "chain-a")
    os.symlink("chain-a", project / "chain-b")  # a loop
    fd = open_project(tmp_path / "workspace", "proj")
    yield fd
    os.close(fd)


def read(beneath: Beneath, root: int, path: str, flags: int = os.O_RDONLY) -> str:
    fd = beneath.open(root, path_parts(path), flags)
    with os.fdopen(fd) as fh:
        return fh.read()


def errno_of(beneath: Beneath, root: int, path: str, flags: int = os.O_RDONLY) -> int:
    with pytest.raises(OSError) as caught:
        os.close(beneath.open(root, path_parts(path), flags))
    assert caught.value.errno is not None
    return caught.value.errno


def test_links_that_stay_inside_are_followed(beneath: Beneath, root: int) -> None:
    assert read(beneath, root, "pkg-link/mod.py") == "inside\n"
    assert read(beneath, root, "src/loop/loop/pkg/mod.py") == "inside\n"


def test_a_link_leading_out_is_exdev_however_it_leads_out(beneath: Beneath, root: int) -> None:
    for path in ("abs-out", "src/up-two/outside.txt", "abs-in/pkg/mod.py", "src/up-two"):
        assert errno_of(beneath, root, path) == errno.EXDEV, path


def test_a_link_as_the_last_name_is_refused_with_nofollow_and_a_loop_is_eloop(beneath: Beneath, root: int) -> None:
    assert errno_of(beneath, root, "pkg-link", os.O_RDONLY | os.O_NOFOLLOW) == errno.ELOOP
    assert errno_of(beneath, root, "chain-a") == errno.ELOOP
    assert errno_of(beneath, root, "src/missing/x") == errno.ENOENT


def test_the_daemons_own_work_follows_no_link_at_any_step_not_even_one_inside(beneath: Beneath, root: int) -> None:
    """``Beneath.exact`` (docs/files.md#the-daemons-own-work): real folders only."""
    fd = beneath.exact(root, path_parts("src/pkg/mod.py"), os.O_RDONLY)
    with os.fdopen(fd) as fh:
        assert fh.read() == "inside\n"
    os.close(beneath.exact(root, path_parts("src/pkg"), os.O_RDONLY | os.O_DIRECTORY))
    for path in ("pkg-link/mod.py", "src/loop/pkg/mod.py", "pkg-link", "abs-out", "src/up-two/outside.txt", "chain-a"):
        with pytest.raises(OSError) as caught:
            os.close(beneath.exact(root, path_parts(path), os.O_RDONLY))
        assert caught.value.errno in (errno.ELOOP, errno.EXDEV), (path, caught.value)
    with pytest.raises(FileNotFoundError):
        beneath.exact(root, path_parts("src/missing/x"), os.O_RDONLY)


def test_folders_are_made_beneath_and_never_through_a_link_out(beneath: Beneath, root: int, tmp_path: Path) -> None:
    fd = beneath.folder(root, ("pkg-link", "made", "deeper"), create=True)
    os.close(fd)
    assert (tmp_path / "workspace" / "proj" / "src" / "pkg" / "made" / "deeper").is_dir()
    with pytest.raises(OSError) as caught:
        beneath.folder(root, ("src", "up-two", "escaped"), create=True)
    assert caught.value.errno == errno.EXDEV
    assert not (tmp_path / "escaped").exists()


class Told:
    """A ``FolderNotes`` that keeps what it is told, as the project-relative path the kernel resolved."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.made: list[tuple[str, ...]] = []

    def making(self, dir_fd: int, name: str) -> None:
        self.made.append((*below(self.root, dir_fd), name))

    def not_made(self, dir_fd: int, name: str) -> None:
        self.made.remove((*below(self.root, dir_fd), name))


def test_each_folder_made_is_told_where_the_kernel_put_it_and_removed_only_while_empty_and_reached_so(
    beneath: Beneath, root: int, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    told = Told(root)
    os.close(beneath.folder(root, ("pkg-link", "made", "deeper"), create=True, notes=told))
    assert told.made == [("src", "pkg", "made"), ("src", "pkg", "made", "deeper")]  # the link resolved
    os.close(beneath.folder(root, ("src", "pkg", "made", "other"), create=True, notes=told))
    assert told.made[-1] == ("src", "pkg", "made", "other")  # only what was missing: "made" was there

    (project / "src" / "pkg" / "made" / "deeper" / "kept.txt").write_text("someone's\n")
    assert not remove_empty_folder(beneath, root, ("src", "pkg", "made", "deeper"))  # not empty: left
    assert not remove_empty_folder(beneath, root, ("pkg-link", "made", "other"))  # a link on the way: left
    assert not remove_empty_folder(beneath, root, ("pkg-link",))  # a link, not a folder: left
    assert (project / "pkg-link").is_symlink() and (project / "src" / "pkg" / "made" / "other").is_dir()
    assert remove_empty_folder(beneath, root, ("src", "pkg", "made", "other"))
    assert not (project / "src" / "pkg" / "made" / "other").exists()


@pytest.mark.parametrize("path", ["..", "a/../b", "/abs", "a\0b", "n" * 256, "a/" * 2049, ""])
def test_a_bad_path_is_invalid_argument(path: str) -> None:
    with pytest.raises(InvalidArgument):
        path_parts(path)


def test_a_path_keeps_its_names_without_dots_and_empty_ones() -> None:
    assert path_parts("./a//b/./c/") == ("a", "b", "c")
    assert path_parts("", required=False) == ()
    assert path_parts("é" * 127) == ("é" * 127,)  # 254 bytes: within a name's 255


def test_a_missing_project_is_not_found_and_a_linked_one_is_refused(tmp_path: Path) -> None:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with pytest.raises(NotFound):
        open_project(workspace, "nowhere")
    os.symlink(tmp_path, workspace / "linked")
    with pytest.raises(PermissionDenied):
        open_project(workspace, "linked")
