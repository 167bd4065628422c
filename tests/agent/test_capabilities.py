"""An agent holds no capability, whatever uid it runs as (issue 53 item 2; docs/confinement.md#security):
empty bounding, permitted, effective, inheritable and ambient sets and ``no_new_privs`` on every
start path (the confining thread, the exec wrapper in C, the wrapper in Python, unconfined with
setpriv), read from ``/proc/<agent>/status`` by the test; and so no device node and no packet
socket, as root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rcoder import landlock
from rcoder.agent.confinement.sandbox import HELPER, PYTHON_WRAPPER, SYSTEM_READ, Confinement, python_dirs
from rcoder.agent.processes.process import AgentProcess
from tests.agent.test_process import read_line
from tests.harness import ROOT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="what a root daemon's agents keep")

NONE = "0" * 16
HELD = {"CapInh": NONE, "CapPrm": NONE, "CapEff": NONE, "CapBnd": NONE, "CapAmb": NONE, "NoNewPrivs": "1"}
# as root: a character device node and an AF_PACKET socket, each refused or not
PROBE = (
    "import os, socket, sys\n"
    "try:\n    os.mknod(sys.argv[1], 0o600 | 0o020000, os.makedev(1, 3)); print('mknod-made')\n"
    "except OSError as exc: print('mknod-refused', exc.errno)\n"
    "try:\n    socket.socket(socket.AF_PACKET, socket.SOCK_RAW); print('packet-opened')\n"
    "except OSError as exc: print('packet-refused', exc.errno)\n"
    "sys.stdout.flush(); sys.stdin.read()\n"
)


def status_of(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines) if k in HELD}


@pytest.mark.parametrize("path", ["thread", "wrapper", "unconfined"])
async def test_an_agent_holds_no_capability_on_each_start_path(tmp_path: Path, path: str) -> None:
    if path != "unconfined" and not landlock.abi():
        pytest.skip("this kernel offers no Landlock")
    read = (*map(Path, SYSTEM_READ), *python_dirs(), *((Path("/proc/self"),) if path == "wrapper" else ()))
    confinement = Confinement(read=read, write=(tmp_path,), abi=landlock.abi()) if path != "unconfined" else None
    assert confinement is None or confinement.own_proc == (path == "wrapper")  # own /proc: the wrapper's path
    agent = await AgentProcess.spawn(
        [sys.executable, "-c", PROBE, str(tmp_path / "null")], cwd=str(tmp_path), env={}, name="caps",
        stderr_tail_bytes=4096, stop_grace=0.3, confinement=confinement,
    )  # fmt: skip
    try:
        said = (await read_line(agent.stdout)).split("\n")
        if len(said) < 2:
            said.append(await read_line(agent.stdout))
        assert status_of(agent.pid) == HELD
    finally:
        await agent.aclose()
    assert said[0].startswith("mknod-refused") and not (tmp_path / "null").exists()
    assert said[1].startswith("packet-refused")


@pytest.mark.parametrize("wrapper", ["c", "python"])
@pytest.mark.parametrize("user", ["", "65534:65534"])
def test_each_wrapper_leaves_no_capability_under_any_uid_nor_a_device_node(
    tmp_path: Path, wrapper: str, user: str
) -> None:
    if not landlock.abi():
        pytest.skip("this kernel offers no Landlock")
    if wrapper == "c" and not HELPER.exists():
        pytest.skip("the C helper is not built here")
    command = [str(HELPER)] if wrapper == "c" else list(PYTHON_WRAPPER)
    grants = [a for path in (*SYSTEM_READ, *python_dirs(), ROOT / "rcoder") for a in ("--read", str(path))]
    os.chmod(tmp_path, 0o777)  # the other uid writes its probe here
    switch = ["--user", user] if user else []
    script = "grep -E '^(Cap|NoNewPrivs)' /proc/$$/status; mknod \"$1\" c 1 3 && echo made || echo refused"
    argv = [*command, *switch, *grants, "--read", "/proc/self", "--write", str(tmp_path), "--",
            "/bin/sh", "-c", script, "sh", str(tmp_path / "null")]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    status = {k: v.strip() for k, _, v in (line.partition(":") for line in lines if ":" in line)}
    assert status == HELD and "refused" in lines and not (tmp_path / "null").exists()


@pytest.mark.parametrize("wrapper", ["c", "python"])
def test_a_kept_capability_is_the_only_one_held(tmp_path: Path, wrapper: str) -> None:
    if not landlock.abi():
        pytest.skip("this kernel offers no Landlock")
    if wrapper == "c" and not HELPER.exists():
        pytest.skip("the C helper is not built here")
    command = [str(HELPER)] if wrapper == "c" else list(PYTHON_WRAPPER)
    grants = [a for path in (*SYSTEM_READ, *python_dirs()) for a in ("--read", str(path))]
    script = "grep -E '^(Cap|NoNewPrivs)' /proc/$$/status"
    argv = [*command, "--cap", "dac_read_search", *grants, "--read", "/proc/self", "--", "/bin/sh", "-c", script]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    status = {k: v.strip() for k, _, v in (line.partition(":") for line in done.stdout.splitlines())}
    one = f"{1 << 2:016x}"
    assert status == {**HELD, "CapPrm": one, "CapEff": one, "CapBnd": one}
    bad = subprocess.run([*command, "--cap", "sys_admin", "--", "/bin/true"], capture_output=True, text=True)
    assert bad.returncode == landlock.EXIT_NOT_CONFINED and "sys_admin" in bad.stderr
