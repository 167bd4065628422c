"""The exec wrapper that confines an agent before it runs, on its own: rcoder/landlock.py run by
Python, and the same in C (rcoder/agent/confinement/confine.c, built by `make`), each test against both."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rcoder import landlock
from rcoder.agent.confinement.sandbox import HELPER, PYTHON_WRAPPER, SYSTEM_READ, WRAPPER, python_dirs, wrapper_command

pytestmark = pytest.mark.skipif(not landlock.abi(), reason="this kernel offers no Landlock")

WRAPPERS = {"python": list(PYTHON_WRAPPER), "c": [str(HELPER)]}


@pytest.fixture(params=sorted(WRAPPERS))
def wrapper(request: pytest.FixtureRequest) -> list[str]:
    if request.param == "c" and shutil.which("cc") is None:
        pytest.skip("no C compiler: the C helper is not built here, agents start through landlock.py")
    if request.param == "c" and not HELPER.exists():
        pytest.fail(f"{HELPER} is not built: `make helper` builds it (a C compiler is needed)")
    return WRAPPERS[request.param]


def wrapped(
    wrapper: list[str], *args: str, command: list[str], read: tuple[Path, ...] = ()
) -> subprocess.CompletedProcess[str]:
    grants = [a for path in (*SYSTEM_READ, *python_dirs(), *read) for a in ("--read", str(path))]
    argv = [*wrapper, *grants, *args, "--", *command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: agents start through landlock.py")
def test_where_a_c_compiler_is_the_helper_is_built_and_agents_start_through_it() -> None:
    assert wrapper_command() == [str(HELPER)], "`make helper` builds rcoder/agent/confinement/rcoder-confine"


def test_each_wrapper_grants_an_agent_its_own_proc_and_no_other_process_s(tmp_path: Path, wrapper: list[str]) -> None:
    # the reason the wrapper exists: /proc/self resolves in the agent's own process, after the fork
    script = "head -c 4 /proc/$$/status && echo; cat /proc/$PPID/environ >/dev/null 2>&1 && echo leaked || echo kept"
    done = wrapped(wrapper, "--read", "/proc/self", command=["/bin/sh", "-c", script])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Name", "kept"]


def test_the_wrapped_command_reads_and_writes_only_what_it_was_given(tmp_path: Path, wrapper: list[str]) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    for folder in (mine, other):
        folder.mkdir()
        (folder / "file").write_text(f"{folder.name}\n")
    script = 'cat "$1/file"; echo new > "$1/new" && echo wrote; cat "$2/file" || echo denied; touch "$2/new" || echo no'

    done = wrapped(wrapper, "--write", str(mine), command=["/bin/sh", "-c", script, "sh", str(mine), str(other)])

    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["mine", "wrote", "denied", "no"]
    assert "Permission denied" in done.stderr and not (other / "new").exists()


def test_a_path_that_does_not_exist_grants_nothing_and_is_no_failure(tmp_path: Path, wrapper: list[str]) -> None:
    done = wrapped(wrapper, "--read", str(tmp_path / "missing"), command=["/bin/true"])
    assert done.returncode == 0, done.stderr


def test_an_agent_whose_daemon_is_already_gone_is_not_started(tmp_path: Path, wrapper: list[str]) -> None:
    done = wrapped(wrapper, "--parent", "1", command=["/bin/sh", "-c", f"touch {tmp_path / 'ran'}"])
    assert done.returncode == landlock.EXIT_NOT_CONFINED
    assert "is gone" in done.stderr and not (tmp_path / "ran").exists()


def test_a_command_that_cannot_run_or_a_bad_argument_is_an_exit_code_and_a_line_on_stderr(wrapper: list[str]) -> None:
    missing = wrapped(wrapper, command=["/no/such/agent"])
    assert missing.returncode == landlock.EXIT_NOT_FOUND and "cannot run /no/such/agent" in missing.stderr
    bad = wrapped(wrapper, "--bogus", "x", command=["/bin/true"])
    assert bad.returncode == landlock.EXIT_NOT_CONFINED and "usage" in bad.stderr


def test_the_wrapper_needs_nothing_but_the_standard_library() -> None:
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", f"import runpy; runpy.run_path({str(WRAPPER)!r})"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={"PATH": os.defpath},
    )
    assert done.returncode == 0, done.stderr


def test_a_granted_path_that_became_a_link_since_it_was_resolved_grants_nothing(
    tmp_path: Path, wrapper: list[str]
) -> None:
    # rcoder grants resolved paths; an agent that may write the folder around one swaps it for a
    # link (to another project, data_dir) before the rule is bound: the rule must not follow it
    project, secret = tmp_path / "project", tmp_path / "secret"
    project.mkdir()
    secret.mkdir()
    (secret / "file").write_text("secret\n")
    (project / "sub").symlink_to(secret)
    script = 'cat "$1/file" || echo denied; touch "$1/new" || echo no'

    done = wrapped(wrapper, "--write", str(project / "sub"), command=["/bin/sh", "-c", script, "sh", str(secret)])

    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["denied", "no"]
    assert not (secret / "new").exists()
