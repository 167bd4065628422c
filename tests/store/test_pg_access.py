"""A daemon whose PostgreSQL store lets an agent in without the password on any route refuses to
start, naming the route (rcoder.store.pg_access): the TCP route of its URL may ask a password
while the server's unix socket lets the same uid in by ``peer`` or ``trust``.

The open cluster below is a second server beside the shared one (``pg_cluster``, which asks a
password on every route): made once for the module, stopped at its end. Its socket is visible to
every daemon started meanwhile, by any test: a login there is not a login into their store, and
they must not count it (the last test)."""

from __future__ import annotations

import ipaddress
import os
import pwd
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from rcoder.store.pg_access import host_addresses, openings
from tests import agent_user_kit
from tests.conftest import DaemonFactory
from tests.harness import Daemon, FakeAgentSetup, write_config
from tests.pg import ROLE, SHARED_DB, PgCluster, missing_binaries

OWN_DB = "rcoder_local_own"  # a database of LOCAL_TRUSTED's, for a daemon that starts on it
LOCAL_TRUSTED = "rcoder_local"  # a role the open cluster's unix socket lets in with no password
OS_USER = pwd.getpwuid(os.getuid()).pw_name  # the daemon's, and so its agents', user


@pytest.fixture(scope="module")
def open_cluster() -> Iterator[PgCluster]:
    """A server whose socket admits the OS user's same-named role by ``peer`` and ``rcoder_local``
    by ``trust`` (its TCP routes ask a password)."""
    missing = missing_binaries()
    if missing:
        pytest.fail(missing, pytrace=False)
    cluster = PgCluster.create(local_auth="peer", hba_first=(f"local all {LOCAL_TRUSTED} trust",))
    try:
        with cluster.admin() as conn:
            conn.execute(f"CREATE ROLE {LOCAL_TRUSTED} LOGIN PASSWORD '{cluster.password}'")
        yield cluster
    finally:
        cluster.close()


def url_of(cluster: PgCluster, role: str) -> str:
    return f"postgresql://{role}:{cluster.password}@127.0.0.1:{cluster.port}/{SHARED_DB}"


async def refused_start(tmp_path: Path, fake: FakeAgentSetup, store_url: str, agent_user: str = "") -> str:
    """Start a daemon on ``store_url``: it must exit 2 before serving; what it said. Its agents
    run as its own user unless ``agent_user`` says otherwise."""
    config = write_config(
        tmp_path / "rcoder.toml", {"fake": fake.profile()}, store_url=store_url, auth_token="t",
        data_dir=str(tmp_path / "data"), workspace_root=str(tmp_path / "ws"), default_agent="fake",
        agent_user=agent_user,
    )  # fmt: skip
    refused = Daemon(config)
    with pytest.raises(RuntimeError, match="daemon exited before serving") as caught:
        await refused.start()
    assert refused.proc is not None and await refused.proc.wait() == 2
    return str(caught.value)


async def test_a_unix_socket_that_trusts_the_stores_role_refuses_the_start_naming_the_socket(
    open_cluster: PgCluster, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    said = await refused_start(tmp_path, fake, url_of(open_cluster, LOCAL_TRUSTED))  # its TCP route asks one

    assert f"the unix socket {open_cluster.socket}" in said, said
    assert "lets its user in without the password" in said and "scram-sha-256" in said and "'local' line" in said
    assert open_cluster.password not in said, "the URL's password stays out of the message"


async def test_peer_on_the_socket_for_the_daemons_own_user_refuses_the_start_naming_that_role(
    open_cluster: PgCluster, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    """Debian's default: ``peer`` lets the same-named role in; here it may act as the store's."""
    with open_cluster.admin() as conn:
        conn.execute(f'CREATE ROLE "{OS_USER}" LOGIN IN ROLE {ROLE}')
    try:
        said = await refused_start(tmp_path, fake, url_of(open_cluster, ROLE))
    finally:
        with open_cluster.admin() as conn:
            conn.execute(f'DROP ROLE "{OS_USER}"')

    assert f"the unix socket {open_cluster.socket}" in said, said
    assert f"lets role '{OS_USER}'" in said and "member of the store's role" in said


async def test_every_route_is_tried_and_a_role_that_cannot_touch_the_store_is_not_counted(
    open_cluster: PgCluster,
) -> None:
    found = await openings(url_of(open_cluster, LOCAL_TRUSTED), OS_USER)
    assert {(str(o.route), o.role) for o in found} == {(f"the unix socket {open_cluster.socket}", LOCAL_TRUSTED)}

    with open_cluster.admin() as conn:
        conn.execute(f'CREATE ROLE "{OS_USER}" LOGIN')  # peer lets it in, but it has no part in the store
    try:
        assert await openings(url_of(open_cluster, ROLE), OS_USER) == []
    finally:
        with open_cluster.admin() as conn:
            conn.execute(f'DROP ROLE "{OS_USER}"')


async def test_a_store_that_asks_a_password_on_every_route_starts_beside_a_server_that_does_not(
    open_cluster: PgCluster, make_daemon: DaemonFactory, pg_url: str
) -> None:
    assert open_cluster.running
    daemon, _ = await make_daemon(store_url=pg_url)

    assert daemon.logs("store_refused_to_agents")


async def test_a_server_that_trusts_a_host_address_is_found_there(fake: FakeAgentSetup) -> None:
    # loopback and the socket ask a password; the host's own address is trusted (a connect from
    # the host to it comes from it): an agent got in there while the check tried 127.0.0.1 and
    # ::1 alone
    ours = [a for a in host_addresses() if not ipaddress.ip_address(a).is_loopback]
    if not ours:
        pytest.skip("this host has no address but loopback")
    cluster = PgCluster.create(listen=f"127.0.0.1,{ours[0]}", hba_first=(f"host all all {ours[0]}/32 trust",))
    try:
        found = await openings(url_of(cluster, ROLE), OS_USER)
    finally:
        cluster.close()

    assert {str(o.route) for o in found} == {f"TCP {ours[0]}:{cluster.port}"}, found


@pytest.fixture
def open_root() -> Iterator[Path]:
    folder = agent_user_kit.open_root()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="agents under a uid of their own need a daemon that can switch")
async def test_with_agents_under_their_own_uid_the_logins_are_tried_as_that_uid(
    open_cluster: PgCluster, fake: FakeAgentSetup, open_root: Path
) -> None:
    """The socket trusts ``rcoder_local`` (as ``peer`` would trust a same-named user), but its
    folder lets only the server's user pass: refused to the agents' uid, so the daemon starts.
    Once that uid can pass the folder, the same socket lets it in: refused start, naming it."""
    with open_cluster.admin() as conn:
        conn.execute(f"CREATE DATABASE {OWN_DB} OWNER {LOCAL_TRUSTED} TEMPLATE template0")
    url = url_of(open_cluster, LOCAL_TRUSTED).rsplit("/", 1)[0] + f"/{OWN_DB}"
    config = write_config(
        open_root / "rcoder.toml", {"fake": fake.profile()}, store_url=url, auth_token="t",
        data_dir=str(open_root / "data"), workspace_root=str(open_root / "ws"), default_agent="fake",
        agent_user=agent_user_kit.AGENT_USER,
    )  # fmt: skip
    assert stat.S_IMODE(open_cluster.root.stat().st_mode) == 0o700
    daemon = await Daemon(config).start()
    await daemon.stop()
    assert daemon.logs("store_refused_to_agents")[0]["agents_uid"] == agent_user_kit.AGENT_UID

    (open_root / "again").mkdir()
    open_cluster.root.chmod(0o711)
    try:
        said = await refused_start(open_root / "again", fake, url, agent_user=agent_user_kit.AGENT_USER)
    finally:
        open_cluster.root.chmod(0o700)
    assert f"the unix socket {open_cluster.socket}" in said and "lets its user in without the password" in said, said
    assert f"they run as uid {agent_user_kit.AGENT_UID}" in said, said
