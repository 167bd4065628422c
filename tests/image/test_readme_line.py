"""The README's container line, run as written on this host (a nested one: runc, no raised
open-files limit), in a shell without ``CONTAINERS_CONF``: the line names it itself.

What is changed of the line: ``make image &&`` is left out (the image is the one the ``image``
fixture built with `make image`'s script), the container's name is this run's, and the host port
a free one instead of 50051 (another test may hold it). A container left by a start that failed
(created, never started) must not block the line, nor must a running one of the same name.
Without ``CONTAINERS_CONF`` the line ends in runc's "error setting rlimit type 7: operation not
permitted" here; without ``--replace``, in "that name is already in use"; without its named
volumes, the replacing container starts on an empty store (a new token). The volumes are this
run's too (named after its container).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.harness import ROOT
from tests.image.podman import BUILD_TIMEOUT, RUN, podman, serving
from tests.pg import free_port

START_TIMEOUT = 90.0  # a container to SERVING on a loaded two-core machine
MARK = "<!-- example: container -->"
VOLUMES = ("rcoder-data", "rcoder-workspace")  # the line's named volumes: the store's and the projects'

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 600)


def readme_line() -> str:
    found = re.search(rf"^{re.escape(MARK)}\n```sh\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.M | re.S)
    assert found, f"README.md has no block after {MARK}"
    return found.group(1).strip()


def as_run_here(line: str, name: str, port: int) -> str:
    command = line.removeprefix("make image && ")
    assert command != line, f"the line builds the image first: {line!r}"
    replaced = command.replace("--name rcoder ", f"--name {name} ").replace(
        "-p 127.0.0.1:50051:50051 ", f"-p 127.0.0.1:{port}:50051 "
    )
    for volume in VOLUMES:  # this run's volumes, never a user's
        replaced = replaced.replace(f"-v {volume}:", f"-v {name}-{volume}:")
    assert replaced.count(name) == 1 + len(VOLUMES) and str(port) in replaced, f"the line changed: {line!r}"
    return replaced


def run_line(command: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CONTAINERS_CONF"}
    env["ANTHROPIC_API_KEY"] = "sk-ant-not-used"
    return subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


async def test_the_readmes_container_line_runs_as_written_over_a_failed_start_and_again(image: str) -> None:
    name, port = f"{RUN}-readme", free_port()
    command = as_run_here(readme_line(), name, port)
    try:
        # what a failed start leaves: a container of that name, created and never started
        podman("create", "--name", name, "localhost/rcoder:latest")
        first = run_line(command)
        assert first.returncode == 0, (command, first.stdout, first.stderr)
        await serving(port, START_TIMEOUT)
        token = podman("exec", name, "cat", "/var/lib/rcoder/auth_token").stdout.strip()
        again = run_line(command)  # the same line once more, the first container running
        assert again.returncode == 0, (command, again.stdout, again.stderr)
        await serving(port, START_TIMEOUT)
        listed = podman("ps", "--all", "--filter", f"name=^{name}$", "--format", "{{.ID}}").stdout.split()
        assert len(listed) == 1, listed
        # the replaced container's store is the new one's: its token (made at the first start) kept
        assert token and podman("exec", name, "cat", "/var/lib/rcoder/auth_token").stdout.strip() == token
    finally:
        podman("rm", "--force", "--volumes", "--time", "0", name, check=False)
        for volume in VOLUMES:
            podman("volume", "rm", "--force", f"{name}-{volume}", check=False)
