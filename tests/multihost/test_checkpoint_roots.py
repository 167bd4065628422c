"""Two hosts on one PostgreSQL store with a host-local ``checkpoint_root`` each (the default,
``<data_dir>/checkpoints``): they say so at start (the one that starts later at once, the other
when it next looks), in ``ListHosts``, and in the ``NO_CHECKPOINT`` answer for the other's runs,
which names the host holding them (docs/design/hosts.md#checkpoint-roots). With one shared
``checkpoint_root`` nothing of it is said."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from rcoder.session.hosts.checkpoint_sharing import CHECK_EVERY
from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import completed, error_info
from tests.multihost.conftest import AUTH_MD, LEASE_TTL, Hosts, chat

MakeHosts = Callable[..., contextlib.AbstractAsyncContextManager[Hosts]]


async def test_host_local_checkpoint_roots_are_said_at_start_in_list_hosts_and_in_no_checkpoint(
    make_hosts: MakeHosts,
) -> None:
    async with make_hosts() as hosts:
        (a,) = await hosts.start("a")
        (b,) = await hosts.start("b")
        (said,) = await b.daemon.wait_log("checkpoint_root_not_shared", host="host-a")
        assert said["checkpoint_root"] == str(hosts.root / "data-b" / "checkpoints")
        assert "NO_CHECKPOINT" in said["effect"] and "checkpoints.root" in said["effect"]

        events, _ = await chat(a, prompt="shell echo made on a > a.txt")
        assert [c.path for c in completed(events).changes] == ["a.txt"]  # a has its snapshots
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await b.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=events[0].run_id), metadata=AUTH_MD)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        info = error_info(caught.value)
        assert info.reason == "NO_CHECKPOINT" and info.metadata["host_id"] == "host-a"
        assert "ran on host host-a" in (caught.value.details() or "")

        listed = await b.stub.ListHosts(pb.ListHostsRequest(), metadata=AUTH_MD)
        assert {h.host_id: h.shares_checkpoint_root for h in listed.hosts} == {"host-a": False, "host-b": True}

        # a started first, alone: it says so when it next looks at the hosts
        await a.daemon.wait_log("checkpoint_root_not_shared", host="host-b", timeout=CHECK_EVERY * LEASE_TTL + 20)

        # a gone, b serves a's session: its rewind is refused the same way, before anything changes
        assert await a.daemon.stop() == 0
        request = pb.RewindSessionRequest(session_id=events[0].session_id, run_id=events[0].run_id)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await b.stub.RewindSession(request, metadata=AUTH_MD, timeout=30)
        assert error_info(caught.value).reason == "NO_CHECKPOINT"
        assert error_info(caught.value).metadata["host_id"] == "host-a"
        assert (hosts.root / "workspace" / "proj" / "a.txt").read_text() == "made on a\n"


async def test_one_shared_checkpoint_root_is_said_shared(make_hosts: MakeHosts, tmp_path: Path) -> None:
    async with make_hosts(checkpoint_root=str(tmp_path / "checkpoints")) as hosts:
        (a,) = await hosts.start("a")
        (b,) = await hosts.start("b")
        listed = await b.stub.ListHosts(pb.ListHostsRequest(), metadata=AUTH_MD)
        assert {h.host_id: h.shares_checkpoint_root for h in listed.hosts} == {"host-a": True, "host-b": True}
        events, _ = await chat(a, prompt="shell echo made on a > a.txt")
        found = await b.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=events[0].run_id), metadata=AUTH_MD)
        assert "+made on a" in found.diff
        assert not b.daemon.logs("checkpoint_root_not_shared") and not a.daemon.logs("checkpoint_root_not_shared")
