"""The limit keys of a profile (docs/limits.md#keys): their values, their bad values as ConfigErrors
naming the key, and ``limits = "required"`` where no mechanism holds. The cgroup2 logic, which
cannot run for real on a host whose unified hierarchy has no controllers, runs against a folder
laid out as the cgroup filesystem (the root is a parameter of ``Cgroups``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rcoder.agent.confinement.limits import Cgroups, Mechanism, Values, _self_and_ancestors, check_limits, subtree_name
from rcoder.config import load_settings
from rcoder.errors import ConfigError

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)


def write(tmp_path: Path, keys: str) -> Path:
    path = tmp_path / "rcoder.toml"
    path.write_text(f'default_agent = "x"\n[agents.x]\ncommand = "/bin/true"\n{keys}\n')
    return path


def test_the_defaults_are_4_gib_1024_processes_and_no_cpu_bound(tmp_path: Path) -> None:
    profile = load_settings(write(tmp_path, ""), {}).agents["x"]
    assert (profile.memory_max, profile.pids_max, profile.cpu_max, profile.limits) == (4 << 30, 1024, 0.0, "auto")


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ('"2GiB"', 2 << 30),
        ('"256 MiB"', 256 << 20),
        ('"1.5G"', 3 << 29),
        ('"500MB"', 500 * 10**6),
        ("268435456", 1 << 28),
    ],
)
def test_memory_max_takes_bytes_or_a_size_with_its_unit(tmp_path: Path, value: str, size: int) -> None:
    assert load_settings(write(tmp_path, f"memory_max = {value}"), {}).agents["x"].memory_max == size


@pytest.mark.parametrize(
    ("keys", "key", "words"),
    [
        ('memory_max = "lots"', "agents.x.memory_max", 'such as "10GiB"'),
        ("memory_max = -1", "agents.x.memory_max", "0 bytes or more"),
        ("memory_max = 1000", "agents.x.memory_max", "at least 1 MiB"),
        ('memory_max = "-2GiB"', "agents.x.memory_max", "expected a size"),
        ("memory_max = true", "agents.x.memory_max", "expected a size"),
        ("pids_max = -5", "agents.x.pids_max", "greater than or equal to 1"),
        ("pids_max = 0", "agents.x.pids_max", "greater than or equal to 1"),
        ("cpu_max = -1.5", "agents.x.cpu_max", "greater than or equal to 0"),
        ('cpu_max = "two"', "agents.x.cpu_max", "valid number"),
        ('limits = "sometimes"', "agents.x.limits", "'auto' or 'required'"),
    ],
)
def test_a_bad_limit_is_a_config_error_naming_the_key(tmp_path: Path, keys: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, keys), {})
    assert caught.value.key == key
    assert words in caught.value.message


def empty_host(tmp_path: Path) -> Cgroups:
    """A host with no cgroup filesystem at all (an empty folder as its root)."""
    (tmp_path / "cgroupfs").mkdir()
    own = tmp_path / "self-cgroup"
    own.write_text("0::/\n")
    return Cgroups(tmp_path / "cgroupfs", tmp_path / "data", own)


def test_required_limits_where_none_hold_are_a_config_error_naming_the_key(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, 'limits = "required"'), {})
    mechanism = empty_host(tmp_path).probe()
    assert mechanism.kind == "none" and "cgroup2: " in mechanism.why and "cgroup1: " in mechanism.why
    with pytest.raises(ConfigError) as caught:
        check_limits(settings, mechanism)
    assert caught.value.key == "agents.x.limits"
    assert "delegate the cgroup controllers" in caught.value.message


def test_auto_limits_where_none_hold_only_warn(tmp_path: Path) -> None:
    check_limits(load_settings(write(tmp_path, ""), {}), empty_host(tmp_path).probe())


def test_required_with_cpu_max_needs_the_cpu_controller(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, 'limits = "required"\ncpu_max = 1.5'), {})
    check_limits(settings, Mechanism("cgroup1", ("memory", "pids", "cpu", "cpuacct")))
    with pytest.raises(ConfigError, match="no cpu controller"):
        check_limits(settings, Mechanism("cgroup1", ("memory", "pids")))


# ---------------------------------------------------------------- cgroup2, against a folder


def cgroupfs_v2(tmp_path: Path, offered: str, where: str = "") -> tuple[Path, Path, Path]:
    """A cgroup2 layout: the root (or ``<root>/<where>``, a hybrid's unified), the daemon's cgroup
    ``/rcoder.slice/daemon.scope`` offering ``offered``, and the daemon's /proc/self/cgroup."""
    root = tmp_path / "cgroupfs"
    unified = root / where if where else root
    mine = unified / "rcoder.slice" / "daemon.scope"
    mine.mkdir(parents=True)
    (unified / "cgroup.controllers").write_text("cpu memory pids hugetlb\n")
    (mine / "cgroup.controllers").write_text(offered + "\n")
    (mine / "cgroup.subtree_control").write_text("")
    own = tmp_path / "self-cgroup"
    own.write_text("0::/rcoder.slice/daemon.scope\n")
    return root, mine, own


@pytest.mark.parametrize("where", ["", "unified"])
def test_cgroup2_with_delegated_controllers_gives_each_agent_its_limits(tmp_path: Path, where: str) -> None:
    root, mine, own = cgroupfs_v2(tmp_path, "cpu memory pids", where)
    cgroups = Cgroups(root, tmp_path / "data", own)
    assert cgroups.probe() == Mechanism("cgroup2", ("memory", "pids", "cpu"))
    base = mine / subtree_name(tmp_path / "data")
    assert (mine / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"

    cgroup = cgroups.place("x", os.getpid(), Values(256 << 20, 64, 1.5))
    assert cgroup is not None
    folder = base / f"agent-{os.getpid()}"
    assert cgroup.folders == [folder]
    written = {name: (folder / name).read_text() for name in ("memory.max", "pids.max", "cpu.max", "cgroup.procs")}
    assert written == {"memory.max": str(256 << 20), "pids.max": "64", "cpu.max": "150000 100000",
                       "cgroup.procs": str(os.getpid())}  # fmt: skip

    (folder / "memory.current").write_text("1048576\n")
    (folder / "memory.peak").write_text("2097152\n")
    (folder / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\n")
    used = cgroup.usage()
    assert (used.memory_current, used.memory_peak, used.cpu_seconds) == (1 << 20, 2 << 20, 2.5)
    assert cgroup.limit_reached() == ""
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\n")
    assert cgroup.limit_reached() == "the agent was stopped: memory limit 256 MiB reached"
    assert cgroups.per_profile()["x"] == (1 << 20, 2 << 20, 2.5, 1)

    # a folder is no cgroupfs: the interface files keep it from going, but the kill was asked
    (folder / "cgroup.kill").write_text("")
    assert not cgroup.try_remove()
    assert (folder / "cgroup.kill").read_text() == "1"


def test_cgroup2_without_the_controllers_delegated_falls_to_cgroup1_then_none(tmp_path: Path) -> None:
    root, _, own = cgroupfs_v2(tmp_path, "hugetlb", "unified")
    mechanism = Cgroups(root, tmp_path / "data", own).probe()
    assert mechanism.kind == "none"
    assert "has no memory, pids controller delegated (it has: hugetlb)" in mechanism.why
    assert "no memory hierarchy" in mechanism.why


def test_each_daemon_has_a_subtree_of_its_own_the_same_across_restarts(tmp_path: Path) -> None:
    assert subtree_name(tmp_path / "a") == subtree_name(tmp_path / "a")
    assert subtree_name(tmp_path / "a") != subtree_name(tmp_path / "b")


def test_sweep_removes_only_this_daemons_leftovers(tmp_path: Path) -> None:
    root, mine, own = cgroupfs_v2(tmp_path, "memory pids")
    cgroups = Cgroups(root, tmp_path / "data", own)
    cgroups.probe()
    left = mine / subtree_name(tmp_path / "data") / "agent-4242"
    other = mine / subtree_name(tmp_path / "other") / "agent-4242"
    left.mkdir()
    other.mkdir(parents=True)
    assert cgroups.sweep() == 0  # nothing runs in them
    assert not left.exists()
    assert other.exists()


def test_the_daemon_leaves_its_cgroup_for_a_leaf_with_the_ancestors_that_share_it() -> None:
    """cgroup2's "no internal processes": in a container the init (tini, the daemon's parent) is in
    the daemon's cgroup too, and goes into the leaf with it; a process that is no ancestor stays."""
    me, parent = os.getpid(), os.getppid()
    assert _self_and_ancestors({me, parent, 1_000_000}) == [me, parent]
    assert _self_and_ancestors({me}) == [me]
    assert _self_and_ancestors(set()) == [me]  # the daemon itself, whatever its cgroup lists


def test_a_container_in_the_hosts_cgroup_namespace_finds_its_cgroup_at_the_mounts_root(tmp_path: Path) -> None:
    """runc on cgroup v1, in the host's cgroup namespace: /proc/self/cgroup names the host's path,
    but only the container's own cgroup folder is mounted, as the hierarchy's root (mountinfo's)."""
    root = tmp_path / "cgroupfs"
    for hierarchy in ("memory", "pids", "cpu", "cpuacct"):
        (root / hierarchy).mkdir(parents=True)
    own = tmp_path / "self-cgroup"
    own.write_text(
        "".join(f"{n}:{h}:/libpod_parent/libpod-1\n" for n, h in enumerate(["memory", "pids", "cpu,cpuacct"]))
    )
    mountinfo = tmp_path / "self-mountinfo"
    mountinfo.write_text("".join(f"{30 + n} 29 0:{40 + n} /libpod_parent/libpod-1 {root / h} ro,nosuid - cgroup cgroup "
                                 f"rw,{h}\n" for n, h in enumerate(["memory", "pids", "cpu", "cpuacct"])))  # fmt: skip

    cgroups = Cgroups(root, tmp_path / "data", own, mountinfo)
    assert cgroups.probe() == Mechanism("cgroup1", ("memory", "pids", "cpu", "cpuacct"))
    name = subtree_name(tmp_path / "data")
    assert list(cgroups.folders()) == [root / h / name for h in ("memory", "pids", "cpu", "cpuacct")]
    # the same host without the mounts' roots: the host's path, which is not there
    assert Cgroups(root, tmp_path / "other", own, tmp_path / "none").probe().kind == "none"
