"""podman as the image's tests run it: the project's containers.conf, bounded calls, and names
that say which test run made a container or volume."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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


# ---------------------------------------------------------------- a cgroup v1 host's grant

IMAGE_USER = 10001  # the image's rcoder, who runs the daemon
LIMITED = ("memory", "pids", "cpu", "cpuacct")  # the cgroup v1 hierarchies rcoder limits agents with


def cgroup_mounts() -> list[tuple[str, Path, set[str]]]:
    """The host's cgroup filesystems: type (cgroup, cgroup2), mount point, options."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount, _, fs = line.partition(" - ")
        fields = fs.split()
        if len(fields) >= 3 and fields[0] in ("cgroup", "cgroup2"):
            found.append((fields[0], Path(mount.split()[4]), set(fields[2].split(","))))
    return found


def v1_hierarchies() -> dict[str, Path]:
    """The host's cgroup v1 hierarchies: each controller to its mount."""
    return {c: mount for kind, mount, options in cgroup_mounts() if kind == "cgroup" for c in options & set(LIMITED)}


@contextlib.contextmanager
def v1_cgroup_grant(name: str) -> Iterator[list[str]]:
    """docs/container.md's grant on a cgroup v1 host, as podman run options: a cgroup folder of the
    host's per hierarchy, owned by the image's user, the container's cgroup parent and bound over its
    cgroup mounts, in a cgroup namespace of its own. Every folder under it is removed at the end
    (podman makes the parent in each hierarchy, the unified one too; a daemon killed with its container
    leaves its subtree)."""
    hierarchies = v1_hierarchies()
    options = ["--cgroupns", "private", "--cgroup-parent", f"/{name}"]
    try:
        for mount in dict.fromkeys(hierarchies[c] for c in LIMITED if c in hierarchies):
            folder = mount / name
            folder.mkdir(exist_ok=True)
            os.chown(folder, IMAGE_USER, IMAGE_USER)
            options += ["--volume", f"{folder}:/sys/fs/cgroup/{mount.name}"]
        yield options
    finally:
        left = [folder for _, mount, _ in cgroup_mounts() if not _removed(folder := mount / name)]
        assert not left, f"cgroup folders left: {left}"


def _removed(folder: Path) -> bool:
    """``folder`` and the cgroups below it removed, deepest first; tried again, bounded, while the
    kernel frees cgroups whose last processes (the container's, killed) are still being reaped."""
    for _ in range(100):
        if not folder.exists():
            return True
        below = sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        with contextlib.suppress(OSError):
            for cgroup in [*below, folder]:
                cgroup.rmdir()
            return True
        time.sleep(0.1)  # a bounded retry: the kernel frees a cgroup once reaped, and says so by no event
    return not folder.exists()


async def serving(port: int, timeout: float) -> None:
    """Until the daemon on ``port`` says SERVING (within ``timeout``): the health service's own
    stream of its status, watched again when the connection drops (a container that exited
    early is restarted meanwhile: by compose's restart policy, or by the test)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        async with asyncio.timeout(timeout):
            while True:
                try:
                    async for status in stub.Watch(health_pb2.HealthCheckRequest(), wait_for_ready=True):
                        if status.status == health_pb2.HealthCheckResponse.SERVING:
                            return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
