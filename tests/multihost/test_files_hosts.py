"""A project's files on two hosts sharing PostgreSQL and the workspace (docs/files.md#several-hosts):
any host serves them, and a turn running on one host keeps the other's writes out unless they say
``while_busy``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import error_info
from tests.multihost.conftest import AUTH_MD, Hosts, first_events

MakeHosts = Callable[..., contextlib.AbstractAsyncContextManager[Hosts]]


def chunk(path: str, data: bytes, **head: object) -> list[pb.WriteFileChunk]:
    return [pb.WriteFileChunk(project_id="proj", path=path, data=data, **head)]  # type: ignore[arg-type]


async def test_a_turn_on_one_host_keeps_the_other_hosts_writes_out_unless_while_busy(make_hosts: MakeHosts) -> None:
    async with make_hosts() as hosts:
        a, b = await hosts.start("a", "b")
        call = a.stub.Chat(pb.ChatRequest(project_id="proj", prompt="hang"), metadata=AUTH_MD, timeout=60)
        (started,) = await first_events(call, 1)
        run_id = started.run_id

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await b.stub.WriteFile(iter(chunk("notes.txt", b"from b\n")), metadata=AUTH_MD, timeout=30)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(caught.value).metadata["run_id"] == run_id  # the store named a's turn
        done = await b.stub.WriteFile(iter(chunk("notes.txt", b"from b\n", while_busy=True)), metadata=AUTH_MD)
        assert done.size == 7
        # a's workspace is b's: a reads what b wrote
        read = [c async for c in a.stub.ReadFile(pb.ReadFileRequest(project_id="proj", path="notes.txt"),
                                                 metadata=AUTH_MD, timeout=30)]  # fmt: skip
        assert read[0].data == b"from b\n"

        await b.stub.Cancel(pb.CancelRequest(run_id=run_id), metadata=AUTH_MD, timeout=30)
        async for _ in call:  # to its completed
            pass
        again = await b.stub.WriteFile(iter(chunk("notes.txt", b"after\n")), metadata=AUTH_MD, timeout=30)
        assert again.size == 6
