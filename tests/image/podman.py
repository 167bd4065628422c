"""podman as the image's tests run it: the project's containers.conf, bounded calls, and names
that say which test run made a container or volume."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

from tests.harness import ROOT

BUILD_TIMEOUT = 3600.0  # a cold build on a loaded two-core machine: Debian's packages, Node, agents
RUN = f"rcoder-test-{secrets.token_hex(4)}"  # every container, volume and compose project of this run starts so


def podman_env() -> dict[str, str]:
    """As scripts/image.py runs podman: the project's containers.conf unless one is named."""
    return {"CONTAINERS_CONF": str(ROOT / "deploy" / "containers.conf"), **os.environ}


def podman(*args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout, check=False,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if check:
        assert done.returncode == 0, f"podman {' '.join(args)}: {done.returncode} {done.stderr}"
    return done


def build_image() -> str:
    """The image's id: built by `make image`'s script, or reused when its inputs are unchanged (a
    build `make test` started in the background is waited for: the script's lock)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "image.py")], capture_output=True, text=True,
        timeout=BUILD_TIMEOUT, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, f"scripts/image.py failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout.split()[-1]
