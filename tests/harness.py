"""Test harness: the real daemon as a subprocess, real gRPC clients, the fake agent.

Nothing of rcoder's is patched: tests write a config file, start
``python -m rcoder serve`` on a loopback port, and talk to it over gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
from google.rpc import error_details_pb2, status_pb2

from rcoder.client.token import find_token
from rcoder.config import load_settings
from rcoder.config_groups import GROUPED_NAME
from rcoder.errors import ConfigError
from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
FAKE_AGENT = ROOT / "tests" / "fakes" / "fake_agent.py"
# what a confined fake agent reads: its script, and rcoder's package for the SDK's quick import
# (rcoder.agent.acp.sdk), which its first lines make
FAKE_AGENT_READS = (str(FAKE_AGENT.parent), str(ROOT / "rcoder"))
START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str | Path):
        return json.dumps(str(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


@dataclass
class FakeAgentSetup:
    """State shared by every fake agent process of one test: its memory and its request log."""

    root: Path

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)

    @property
    def folder(self) -> Path:
        """Everything the fake agents write: their one folder outside their project."""
        return self.root / "fake-agent"

    @property
    def state_dir(self) -> Path:
        return self.folder / "state"

    @property
    def record(self) -> Path:
        return self.folder / "requests.jsonl"

    def profile(self, *flags: str, **keys: Any) -> dict[str, Any]:
        """The fake agent's profile; confined (the default sandbox), it reads its script and
        rcoder's package (``FAKE_AGENT_READS``) and writes its state and record besides its project."""
        args = [str(FAKE_AGENT), "--state-dir", str(self.state_dir), "--record", str(self.record), *flags]
        reach = {"read_paths": list(FAKE_AGENT_READS), "write_paths": [str(self.folder)]}
        return {"command": sys.executable, "args": args, **reach, **keys}

    def requests(self, method: str | None = None) -> list[dict[str, Any]]:
        """Every JSON-RPC message the fake agents received, oldest first."""
        if not self.record.exists():
            return []
        rows = [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]
        messages = [row["message"] for row in rows]
        return [m for m in messages if method is None or m.get("method") == method]

    def pids(self) -> set[int]:
        return (
            {json.loads(line)["pid"] for line in self.record.read_text().splitlines()}
            if self.record.exists()
            else set()
        )


def write_config(
    path: Path, profiles: dict[str, dict[str, Any]], *, clients: Sequence[dict[str, Any]] = (), **top: Any
) -> Path:
    """A config file: ``top`` settings (by their flat names, each written in its table:
    ``tls_cert`` as ``cert`` in ``[tls]``), ``[agents.<name>]`` tables, ``[[clients]]`` entries."""
    lines = [f"{k} = {toml_value(v)}" for k, v in top.items() if k not in GROUPED_NAME]
    tables: dict[str, list[str]] = {}
    for setting, value in top.items():
        if setting in GROUPED_NAME:
            table, key = GROUPED_NAME[setting].split(".")
            tables.setdefault(table, []).append(f"{key} = {toml_value(value)}")
    for table, settings in tables.items():
        lines += [f"\n[{table}]", *settings]
    for name, keys in profiles.items():
        lines.append(f"\n[agents.{name}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in keys.items())
    for client in clients:
        lines.append("\n[[clients]]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in client.items())
    path.write_text("\n".join(lines) + "\n")
    return path


def config_error(tmp_path: Path, text: str) -> ConfigError:
    """The error a config file holding ``text`` is refused with (none is a failure)."""
    config = tmp_path / "rcoder.toml"
    config.write_text(text)
    try:
        load_settings(config, {})
    except ConfigError as exc:
        return exc
    raise AssertionError(f"accepted, though it should be refused: {text!r}")


async def eventually(check: Callable[[], Awaitable[bool] | bool], timeout: float = 20.0) -> None:
    """Until ``check()`` holds, bounded: for what has no doorbell to wait on (a file or a row
    another process writes, the /proc of a process)."""
    async with asyncio.timeout(timeout):
        while True:
            result = check()
            if result if isinstance(result, bool) else await result:
                return
            await asyncio.sleep(0.02)


def processes_mentioning(marker: str) -> list[int]:
    """Pids of live processes whose command line contains ``marker`` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


@functools.cache
def die_with_the_test() -> tuple[str, ...]:
    """The argv prefix that gives a daemon ``PR_SET_PDEATHSIG=SIGKILL`` (util-linux ``setpriv``), so
    that it ends with the test process that started it, even one killed with no cleanup (a pytest
    worker killed, a timeout's ``os._exit``); its agents then end with it, by their own death signal.
    The signal follows the thread that spawned it: the event loop's, which lives as long as the
    test process. ``()`` where ``setpriv`` lacks ``--pdeathsig`` (util-linux older than 2.33)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ()
    usage = subprocess.run([setpriv, "--help"], capture_output=True, timeout=10, check=False).stdout
    return (setpriv, "--pdeathsig", "KILL", "--") if b"--pdeathsig" in usage else ()


@dataclass(eq=False)
class Daemon:
    """``rcoder serve`` in its own process group, reporting the address it bound; it dies with
    the test process (``die_with_the_test``)."""

    config: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | None = None
    address: str = ""
    log_lines: list[str] = field(default_factory=list)
    _stderr_task: asyncio.Task[None] | None = None
    _logged: asyncio.Event = field(default_factory=asyncio.Event)
    checked: int = 0  # log lines already looked at for unhandled failures (``unhandled_failures``)
    wrap: tuple[str, ...] = ()  # what runs the daemon's command (e.g. in a mount namespace of its own)
    listen: str = "127.0.0.1:0"  # a port chosen in advance, where an agent's connect_ports must name it

    async def start(self) -> Daemon:
        STARTED.append(self)  # its log is read for unhandled failures after every test (conftest)
        env = {**os.environ, **self.env, "RCODER_LOG_FORMAT": "json"}
        self.proc = await asyncio.create_subprocess_exec(
            *die_with_the_test(), *self.wrap,
            sys.executable, "-m", "rcoder", "serve", "--config", str(self.config), "--listen", self.listen,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, env=env, cwd=str(self.config.parent),
        )  # fmt: skip
        ready = asyncio.get_running_loop().create_future()
        self._stderr_task = asyncio.create_task(self._read_stderr(ready))
        try:
            async with asyncio.timeout(START_TIMEOUT):
                self.address = await ready
        except BaseException:
            await self.kill()
            raise
        return self

    async def _read_stderr(self, ready: asyncio.Future[str]) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            text = line.decode(errors="replace").rstrip()
            self.log_lines.append(text)
            self._logged.set()
            self._logged = asyncio.Event()
            if not ready.done() and '"event": "serving"' in text:
                ready.set_result(json.loads(text)["address"])
        if not ready.done():
            ready.set_exception(RuntimeError("daemon exited before serving:\n" + "\n".join(self.log_lines[-30:])))

    def logs(self, event: str | None = None) -> list[dict[str, Any]]:
        rows = []
        for line in self.log_lines:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if event is None or row.get("event") == event:
                    rows.append(row)
        return rows

    async def wait_log(self, event: str, count: int = 1, timeout: float = 20.0, **fields: Any) -> list[dict[str, Any]]:
        """Wait (bounded) until the daemon has logged ``event`` (with ``fields``) ``count`` times.

        A field's value may be a predicate on the logged value instead of the value itself."""

        def matches(row: dict[str, Any]) -> bool:
            return all(v(row.get(k)) if callable(v) else row.get(k) == v for k, v in fields.items())

        async with asyncio.timeout(timeout):
            while True:
                logged = self._logged
                rows = [r for r in self.logs(event) if matches(r)]
                if len(rows) >= count:
                    return rows
                await logged.wait()

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the daemon and wait for it to exit; returns its exit code."""
        assert self.proc is not None
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                async with asyncio.timeout(STOP_TIMEOUT):
                    await self.proc.wait()
            except TimeoutError:
                await self.kill()
                raise
        await self._drain()
        return self.proc.returncode or 0

    async def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()
        await self._drain()

    async def _drain(self) -> None:
        if self._stderr_task is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await self._stderr_task

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the daemon was started"
        return self.proc.pid

    @property
    def token(self) -> str:
        """The token its clients send: as ``rcoder chat`` finds it (the config's ``auth_token``,
        ``RCODER_AUTH_TOKEN``, else the one the daemon keeps in its data_dir)."""
        return find_token(self.env, self.config)

    def channel(self) -> grpc.aio.Channel:
        """A plaintext channel whose calls carry the daemon's token (none when it asks none)."""
        token = self.token
        if not token:
            return grpc.aio.insecure_channel(self.address)
        return grpc.aio.secure_channel(self.address, bearer_credentials(token))

    def stub(self, channel: grpc.aio.Channel) -> pb_grpc.AgentRunnerStub:
        """A stub on a plaintext ``channel`` whose calls carry the token as static metadata: no
        per-call credentials plugin (a thread hop) in what a benchmark measures."""
        stub = pb_grpc.AgentRunnerStub(channel)
        token = self.token
        if not token:
            return stub
        return cast(pb_grpc.AgentRunnerStub, _WithMetadata(stub, (("authorization", f"Bearer {token}"),)))

    def sync_channel(self) -> grpc.Channel:
        """``channel`` for a synchronous client."""
        token = self.token
        if not token:
            return grpc.insecure_channel(self.address)
        return grpc.secure_channel(self.address, bearer_credentials(token))


class _WithMetadata:
    def __init__(self, stub: pb_grpc.AgentRunnerStub, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub = stub
        self._metadata = metadata

    def __getattr__(self, name: str) -> Any:
        return functools.partial(getattr(self._stub, name), metadata=self._metadata)


def bearer_credentials(token: str) -> grpc.ChannelCredentials:
    """Plaintext on loopback (local credentials: no TLS) with ``authorization: Bearer <token>`` on every call."""
    local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    return grpc.composite_channel_credentials(local, grpc.access_token_call_credentials(token))


@dataclass
class Client:
    """A real gRPC client of one daemon."""

    channel: grpc.aio.Channel

    @property
    def stub(self) -> pb_grpc.AgentRunnerStub:
        return pb_grpc.AgentRunnerStub(self.channel)

    async def chat(self, timeout: float = 60.0, metadata: Any = None, **fields: Any) -> list[pb.ChatStream]:
        fields.setdefault("project_id", "proj")
        events = []
        async with asyncio.timeout(timeout):
            async for event in self.stub.Chat(pb.ChatRequest(**fields), metadata=metadata):
                events.append(event)
        return events

    async def chat_error(self, timeout: float = 60.0, metadata: Any = None, **fields: Any) -> grpc.aio.AioRpcError:
        try:
            events = await self.chat(timeout=timeout, metadata=metadata, **fields)
        except grpc.aio.AioRpcError as exc:
            return exc
        raise AssertionError(f"expected an error status, got {len(events)} events: {events[-1:]}")


# log events that mean rcoder's own code failed (on what an agent wrote, or on a request)
OWN_FAILURES = {
    "agent_update_failed", "turn_failed_unexpectedly", "run_end_not_stored", "run_end_never_stored",
    "agent_not_reaped", "permission_decider_failed",
}  # fmt: skip
# ... and what asyncio and grpc log for an exception nobody handled
UNHANDLED = ("Task exception was never retrieved", "raised by servicer method", "Exception in callback")


# every daemon a test started, in this test process (module-scoped ones included)
STARTED: list[Daemon] = []


def unhandled_failure(row: dict[str, Any]) -> bool:
    """A log line that says an exception went unhandled, or that a request failed INTERNAL: a bug
    of ours whichever test was running (``tests/conftest.py`` fails that test)."""
    event = str(row.get("event"))
    return (
        any(text in event for text in UNHANDLED)
        or event in {"turn_end_step_failed", "background_task_failed"}
        or (event == "request_refused" and row.get("code") == "INTERNAL")
    )


def unhandled_failures() -> list[str]:
    """What every daemon started here logged of ``unhandled_failure`` since last asked, with its
    traceback; daemons that have exited are forgotten once read."""
    found = []
    for daemon in list(STARTED):
        lines, start = daemon.log_lines, daemon.checked
        daemon.checked = len(lines)
        for line in lines[start:]:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict) and unhandled_failure(row):
                    found.append(f"daemon {daemon.proc.pid if daemon.proc else '?'}: {line[:4000]}")
        if daemon.proc is None or daemon.proc.returncode is not None:
            STARTED.remove(daemon)
    return found


def assert_daemon_healthy(daemon: Daemon) -> None:
    """The daemon is up and has logged no failure of its own code."""
    assert daemon.proc is not None and daemon.proc.returncode is None, "the daemon is still up"
    bad = [
        r for r in daemon.logs()
        if r.get("level") == "critical" or r.get("event") in OWN_FAILURES
        or any(text in str(r.get("event")) for text in UNHANDLED)
    ]  # fmt: skip
    assert not bad, bad[:3]


def text_of(events: Sequence[pb.ChatStream]) -> str:
    return "".join(e.agent_message.text for e in events if e.WhichOneof("event") == "agent_message")


def started(events: Sequence[pb.ChatStream]) -> pb.RunStarted:
    assert events and events[0].WhichOneof("event") == "started", events[:1]
    return events[0].started


def completed(events: Sequence[pb.ChatStream]) -> pb.RunCompleted:
    assert events and events[-1].WhichOneof("event") == "completed", events[-1:]
    return events[-1].completed


def error_info(exc: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo detail of a failed call (fails the test if there is none)."""
    raw = dict(exc.trailing_metadata() or ()).get("grpc-status-details-bin")
    assert raw, f"no rich status on {exc.code()}: {exc.details()}"
    status = status_pb2.Status.FromString(raw)
    assert status.code == exc.code().value[0]
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info
    raise AssertionError(f"no ErrorInfo on {exc.code()}: {exc.details()}")


async def call_rpc(
    channel: grpc.aio.Channel, method: str, request: Any, metadata: Any = None, timeout: float = 30.0
) -> grpc.aio.AioRpcError | None:
    """One AgentRunner call by its name, whatever its shape (a stream read to its end; a
    client-streaming one sent ``request`` alone): its error, or None when it succeeded."""
    described = pb.DESCRIPTOR.services_by_name["AgentRunner"].methods_by_name[method]
    path = f"/{described.containing_service.full_name}/{method}"
    send, receive = type(request).SerializeToString, None
    try:
        if described.client_streaming:
            await channel.stream_unary(path, send, receive)(iter([request]), metadata=metadata, timeout=timeout)
        elif described.server_streaming:
            async for _ in channel.unary_stream(path, send, receive)(request, metadata=metadata, timeout=timeout):
                pass
        else:
            await channel.unary_unary(path, send, receive)(request, metadata=metadata, timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return exc
    return None
