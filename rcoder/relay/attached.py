"""A relayed agent as the daemon owns it: a ``Child`` (``rcoder.agent.processes.process``) whose
stdio is the relay's Attach stream (docs/relay.md#attach), so the whole ACP layer runs over it
unchanged (docs/relay.md#placement).

Its ``stdout`` is a real pipe of the daemon's own, its reading end an asyncio stream: the ACP
transport reads it as it does a local agent's, and a full pipe holds the stream back as it holds a
local agent (a turn's pacing, ``rcoder.agent.acp.transport``). The follower task attaches, writes
every stdout frame into that pipe, acknowledges what the pipe took (while a turn's events are
stored, only the frames whose events are: ``hold_acks``), and, when the stream drops (the relay
restarted its listener, a cut), attaches again from the frame after the last one written, with a
bounded backoff: nothing lost, nothing repeated. The agent's exit, after its last frame, is the
child's exit: its code, and its stderr's end on ``stderr``.

Its ``stdin`` is a ``StreamWriter`` on ``StdinFrames`` (``rcoder.relay.stdin_frames``): what the
transport writes is numbered into frames, kept until a re-attach's ``ready`` says the relay wrote
them, and sent on the stream open now at once, by the writer's own ``drain`` (or a task started
right after the write, for a writer that does not drain): no pipe and no reader of one between
(docs/benchmarks.md#the-relay-placement). Its end (``AgentProcess`` closing it) is
``close_stdin``, after the frames. After a re-attach the frames the relay has not written are
sent again; a writer waits while more than a pipe's worth is not on a stream. A writer cancelled
in the middle of a frame's write cancels the stream (grpc's write does): the follower takes that
as a drop and attaches again, and the frame goes on the next stream.

A live session's before snapshot is asked on the same stream (``snapshot_before_stdin``), in
stdin's order: the relay takes it before it writes the frames after it, and answers on the stream
(docs/relay.md#the-before-snapshot-on-the-stream). An ask not answered when the stream drops is
sent again after the re-attach if the relay has not written the frame it came before, and fails
otherwise; the agent's exit and a detach fail every one not answered.

Signals (``AgentProcess``'s SIGTERM and SIGKILL after its grace) are ``Signal`` calls to the
agent's whole group. Every wait is bounded: a relay that cannot be reached for ``REATTACH_FOR``
seconds, or whose process is gone (its agents die with it), or that no longer knows the agent, or a
newer owner's generation, ends the child as an exit the daemon reports like a local agent's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
from collections import deque
from pathlib import Path
from typing import Any

import grpc

from rcoder.agent.processes.relayed import RelayPlace
from rcoder.logs import get_logger
from rcoder.relay.stdin_frames import StdinFrames, StdinWriter
from rcoder.relay.v1 import relay_pb2 as pb
from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc
from rcoder.relay.v1 import workspace_pb2 as workspace_pb

log = get_logger("rcoder.relay.attached")

ACK_EVERY = 16  # frames written into the pipe between acknowledgements (and at every pause)
REATTACH_FOR = 30.0  # seconds a dropped stream is attached again before the agent counts as lost
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 1.0
_ENDS_KEPT = 1 << 16  # frame ends kept for ``frame_at``: more than the pipe and a read can hold unread
_STDIN_KEPT = 4 << 20  # bytes of stdin frames kept before a Status call trims what the relay wrote
# the exit code of an agent whose relay was lost: what a shell reports for a SIGKILLed process
LOST_EXIT = -int(signal.SIGKILL)
# what ends the attaching: the relay forgot the agent, a newer owner holds its session, the secret
_FINAL = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
          grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED}  # fmt: skip

Metadata = tuple[tuple[str, str], ...]


class AttachedAgent:
    """One agent of a relay, attached: the ``Child`` an ``AgentProcess`` owns. ``open`` makes it."""

    def __init__(self, stub: pb_grpc.RelayServiceStub, metadata: Metadata, agent: pb.Agent, place: RelayPlace,
                 generation: int, stop_grace: float) -> None:  # fmt: skip
        self._stub, self._metadata = stub, metadata
        self._agent_id, self._generation = agent.agent_id, generation
        self._name = agent.name
        self._stop_grace = stop_grace
        self.place = place
        self.pid = agent.pid
        self._loop = loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[None] = loop.create_future()
        # the relay took a stream of ours (its first ``ready``): it fences every older generation from then
        self._taken: asyncio.Future[None] = loop.create_future()
        self._lost_why = ""  # why the agent counts as lost, when it does
        self._returncode: int | None = None
        self.stderr = asyncio.StreamReader()  # the exit's stderr tail, fed at the exit
        self._written = 0  # the last stdout frame written into the pipe
        self._acked = 0
        self._ack_limit: int | None = None  # while held (``hold_acks``): acknowledged up to it at most
        self._piped = 0  # bytes written into the stdout pipe
        self._ends: deque[tuple[int, int]] = deque()  # (bytes piped through its end, seq) of each frame
        # numbered on from the last stdin frame the relay wrote (a re-attached agent's go on)
        self._stdin = StdinFrames(agent.stdin_seq, self._send_soon)
        self.stdin: asyncio.StreamWriter = StdinWriter(self._stdin, self._send_stdin, loop)
        self._sending = False  # a sender of stdin frames runs (it sends what is written meanwhile too)
        # snapshots asked on the stream (``snapshot_before_stdin``), by id, until answered; those not
        # yet on the stream open now go in stdin's order, each before the frame it names
        self._snapshots_on_stream = False  # the relay's last ready said it takes them
        self._snapshots_in_frames = False  # ... and in the stdin frame they come before
        self._asks: dict[int, tuple[pb.SnapshotAsk, asyncio.Future[pb.SnapshotTaken]]] = {}
        self._unsent_asks: deque[pb.SnapshotAsk] = deque()
        self._ask_ids = itertools.count(1)
        self._trimming = False  # a Status call trims the stdin frames kept
        self._call: Any = None  # the Attach stream now open, while it is
        self._write_lock = asyncio.Lock()  # one writer on the stream at a time, stdin frames in order
        self._let_go = False
        self._detached = False  # left running to the next daemon (``detach``): nothing more sent
        self._tasks: set[asyncio.Task[Any]] = set()
        # set by ``open``
        self.stdout: asyncio.StreamReader
        self._stdout_writer: asyncio.StreamWriter
        self._stdout_read: asyncio.ReadTransport
        self._follower: asyncio.Task[None]

    @classmethod
    async def open(cls, stub: pb_grpc.RelayServiceStub, metadata: Metadata, agent: pb.Agent, place: RelayPlace,
                   generation: int, stop_grace: float, after_frame: int = 0) -> AttachedAgent:  # fmt: skip
        """The agent, its stdout pipe made and its stream attached from the frame after ``after_frame``
        (0: one just spawned; more: one another daemon read up to there, docs/relay.md#re-attach)."""
        self = cls(stub, metadata, agent, place, generation, stop_grace)
        self._written = self._acked = after_frame
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        try:
            # the reader stops reading while it holds unread data (limit 1), as a local agent's
            # (``rcoder.agent.processes.process._PIPE_BUFFER``): the rest waits in the pipe, then here
            self.stdout = asyncio.StreamReader(limit=1)
            read_transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(self.stdout), os.fdopen(out_r, "rb", 0)
            )
            self._stdout_read = read_transport
            self._stdout_writer = await _writer(loop, os.fdopen(out_w, "wb", 0))
        except BaseException:
            for fd in (out_r, out_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        self._follower = loop.create_task(self._follow(), name=f"relayed-stdout-{self.pid}")
        return self

    # ------------------------------------------------------------ Child

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def signal_group(self, sig: signal.Signals) -> None:
        """The signal to the agent's whole group, by the relay (sent in the background: the caller
        waits for the exit, bounded, as it does for a local agent)."""
        if self._returncode is None and not self._detached:
            self._spawn(self._signal(sig), f"relayed-signal-{self.pid}")

    def let_go(self) -> None:
        """SIGKILL the group, end stdin and close our end of the stdout pipe (the readers see
        their end), waiting for nothing; the exit still comes from the relay, or, ``stop_grace``
        on, is taken as lost."""
        self.signal_group(signal.SIGKILL)
        self._let_go = True
        if not self.stdin.transport.is_closing():
            self.stdin.transport.abort()
        self._stdout_read.close()
        if not self.exited.done():
            self._spawn(self._lost_after(self._stop_grace), f"relayed-letgo-{self.pid}")

    async def taken(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, until the relay has taken this agent's stream (its
        first ``ready``). An owner that takes a turn over holds it only then: until its generation
        has reached the relay, the old owner's writes still reach the agent (docs/relay.md#fencing).
        ``ConnectionError`` saying why when the relay refused the stream, or did not take it in time."""
        await asyncio.wait({self._taken, self.exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not self._taken.done():
            raise ConnectionError(self._lost_why or f"the relay did not take its stream within {timeout:g} s")

    def abandon(self) -> None:
        """The agent is not this daemon's after all (``taken`` failed, or the session's lease was
        lost): nothing sent to it, not even a signal or the end of its stdin (``detach``), and our
        end of its stdout pipe closed."""
        self.detach()
        self._stdout_read.close()
        self._stdout_writer.close()
        self.stderr.feed_eof()  # no exit comes to feed it: what reads it here ends too

    def pipe_inodes(self) -> set[int]:
        return set()  # the agent's own pipes are the relay's, on its side

    def detach(self) -> None:
        """rcoder stops and leaves the agent running in its relay for the next daemon
        (docs/relay.md#re-attach): the stream closed, acknowledging nothing more (the relay keeps
        every frame past what was acknowledged, which the store has), no signal and no stdin sent
        from now on. The exit never comes: nothing here waits for it any more."""
        self._detached = True
        self._stdin.forget()
        self._fail_asks("rcoder stops: the agent was left to the next daemon")
        self._follower.cancel()  # its end cancels the call
        for task in list(self._tasks):
            task.cancel()

    # ------------------------------------------------------------ frames and their acknowledgement

    def frame_at(self, position: int) -> int:
        """The frame whose bytes reach ``position`` of what the stdout pipe carried (the frame of
        the line the transport handled through there); positions are asked in order."""
        ends = self._ends
        while len(ends) > 1 and ends[0][0] < position:
            ends.popleft()
        return ends[0][1] if ends else self._written

    def hold_acks(self, frame: int) -> None:
        """From now on acknowledge no frame past ``frame`` until ``ack_through`` says (a turn whose
        events are stored from its frames: the relay keeps what the store has not)."""
        self._ack_limit = frame

    def ack_through(self, frame: int) -> None:
        """The events of the frames up to ``frame`` are stored: they may be acknowledged."""
        if self._ack_limit is not None and frame > self._ack_limit:
            self._ack_limit = frame
            self._ack_soon()

    def release_acks(self) -> None:
        """The turn is over: every frame written is acknowledged again."""
        self._ack_limit = None
        self._ack_soon()

    def _ack_soon(self) -> None:
        call = self._call
        if call is not None and self._ackable() > self._acked and not self.exited.done() and not self._detached:
            self._spawn(self._ack(call), f"relayed-ack-{self.pid}")

    def _ackable(self) -> int:
        limit = self._ack_limit
        return self._written if limit is None else min(self._written, limit)

    # ------------------------------------------------------------ the stream

    async def _follow(self) -> None:
        """Attach, and attach again after every drop, until the agent's exit (or it is lost)."""
        backoff, since = _BACKOFF_FIRST, asyncio.get_running_loop().time()
        why = ""
        while not self.exited.done():
            call = self._stub.Attach(metadata=self._metadata)
            try:
                await self._opened(call)
                backoff, since = _BACKOFF_FIRST, asyncio.get_running_loop().time()
                while (response := await call.read()) is not grpc.aio.EOF:
                    if await self._took(call, response):
                        return
                why = "the relay ended the stream"
            except grpc.aio.AioRpcError as exc:
                why = f"{exc.code().name}: {exc.details()}"
                if exc.code() in _FINAL:
                    self._lost(f"the relay refused the agent's stream ({why})")
                    return
            except (asyncio.InvalidStateError, grpc.aio.UsageError, ConnectionError) as exc:
                why = str(exc) or type(exc).__name__
            except asyncio.CancelledError:
                # grpc cancels the stream under a write whose task is cancelled (a writer of stdin
                # given up on mid-frame, ``_send_stdin``), and reading it then raises this: a drop
                if not call.cancelled() or _cancelling():
                    raise
                why = "a write on the stream was cancelled"
            finally:
                self._call = None
                call.cancel()
            waited = asyncio.get_running_loop().time() - since
            # its agents died with it (their death signal); another host's relay (pid 0, reached over
            # TCP) is alive while it answers: REATTACH_FOR bounds the wait for it
            if self.place.relay_pid and not _alive(self.place.relay_pid):
                self._lost(f"the relay (pid {self.place.relay_pid}) is gone ({why})")
                return
            if waited > REATTACH_FOR:
                self._lost(f"the relay could not be reached for {waited:.0f} s ({why})")
                return
            log.info("relayed_agent_reattaching", agent=self._name, pid=self.pid, agent_id=self._agent_id,
                     from_seq=self._acked + 1, why=why)  # fmt: skip
            await asyncio.sleep(backoff)  # a retry's pace, not a synchronisation: the relay is away
            backoff = min(backoff * 2, _BACKOFF_MAX)

    async def _opened(self, call: Any) -> None:
        """Open ``call`` from the frame after the last one acknowledged (those written since come
        again and are skipped: an attach counts the frames before it acknowledged, and while a
        turn runs only what is stored may be, docs/relay.md#re-attach); once ready, the stdin
        frames the relay has not written are sent again (and the end of stdin, when it came)."""
        opening = pb.AttachOpen(agent_id=self._agent_id, generation=self._generation, from_seq=self._acked + 1)
        # nothing written before the relay's headers: a write racing its refusal would turn the
        # refusal into grpc's own INTERNAL (docs/relay.md#attach)
        await call.initial_metadata()
        if call.done():
            await call.read()  # raises the refusal as it was sent
            raise ConnectionError("the relay ended the stream before it opened")
        await call.write(pb.AttachRequest(open=opening))
        first = await call.read()
        if first is grpc.aio.EOF or first.WhichOneof("message") != "ready":
            raise ConnectionError("the relay's stream did not start with ready")
        async with self._write_lock:
            self._stdin.rewind(first.ready.stdin_seq)
            self._snapshots_on_stream = first.ready.snapshots_on_stream
            self._snapshots_in_frames = first.ready.snapshots_in_frames
            self._ask_again(first.ready.stdin_seq)
            await self._send_unsent(call)  # a broken stream raises: attached again
            self._call = call
        if not self._taken.done():
            self._taken.set_result(None)

    async def _took(self, call: Any, response: pb.AttachResponse) -> bool:
        """One message of the relay's; True at the agent's exit."""
        kind = response.WhichOneof("message")
        if kind == "frame":
            frame = response.frame
            if frame.seq <= self._written:
                return False  # never sent twice by a relay; kept out all the same
            if not self._let_go:
                self._piped += len(frame.data)
                self._ends.append((self._piped, frame.seq))
                if len(self._ends) > _ENDS_KEPT:  # nobody asks (no turn stores from frames): bounded
                    self._ends.popleft()
                try:
                    self._stdout_writer.write(frame.data)
                    await self._stdout_writer.drain()  # a full pipe: the reader is paced, the relay keeps it
                except ConnectionError:
                    self._let_go = True  # our reading end is closed: the agent is being let go
            self._written = frame.seq
            if self._ackable() - self._acked >= ACK_EVERY or self._let_go:
                await self._ack(call)
        elif kind == "snapshot":
            asked = self._asks.pop(response.snapshot.id, None)
            if asked is not None and not asked[1].done():
                asked[1].set_result(response.snapshot)
        elif kind == "lagged":
            lagged = response.lagged
            if lagged.next_seq - 1 > self._written:  # not only frames written already, sent again
                log.error("relayed_agent_lagged", agent=self._name, pid=self.pid, agent_id=self._agent_id,
                          dropped_frames=lagged.dropped_frames, next_seq=lagged.next_seq,
                          why="the relay's buffer dropped frames before the daemon read them")  # fmt: skip
                self._written = lagged.next_seq - 1
        elif kind == "exit":
            self._ack_limit = None  # the agent's end: nothing more is kept for a turn
            await self._ack(call)
            async with self._write_lock:  # our half closed: the relay ends the stream then, not before
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                    await call.done_writing()
            self._exit(response.exit.exit_code, response.exit.stderr_tail)
            return True
        return False

    async def _ack(self, call: Any) -> None:
        seq = self._ackable()
        if seq > self._acked and not self._detached:
            self._acked = seq
            async with self._write_lock:
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                    await call.write(pb.AttachRequest(ack=seq))

    # ------------------------------------------------------------ stdin

    def _send_soon(self) -> None:
        """Something was written on stdin (or it was closed): sent from a task of its own unless a
        sender runs, or the writer's ``drain`` starts one before this comes round."""
        if not self._loop.is_closed():  # a writer closed by the garbage collector, after the loop
            self._loop.call_soon(self._send_if_idle)

    def _send_if_idle(self) -> None:
        stdin = self._stdin
        unsent = stdin.next_unsent() is not None or self._unsent_asks
        if not self._sending and (unsent or (stdin.ended and not stdin.end_sent)):
            self._spawn(self._send_stdin(), f"relayed-stdin-{self.pid}")

    async def _send_stdin(self) -> None:
        """What was written on stdin and is not yet on the stream open now, sent (the end of stdin
        after it); with no stream open, or a broken one, the next attach sends it all again."""
        if self._sending or self._detached:
            return  # the sender running sends what was written meanwhile too
        self._sending = True
        try:
            async with self._write_lock:
                if (call := self._call) is not None:
                    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                        await self._send_unsent(call)
        finally:
            self._sending = False
        if self._stdin.kept_bytes > _STDIN_KEPT and not self._trimming:
            self._spawn(self._trim_by_status(), f"relayed-stdin-trim-{self.pid}")

    async def _send_unsent(self, call: Any) -> None:
        """On ``call`` (the write lock held): every stdin frame unsent on it, in order, then the end
        of stdin once it came; written meanwhile goes too."""
        stdin, asks = self._stdin, self._unsent_asks
        while True:
            frame = stdin.next_unsent()  # looked at again after every write: one may come meanwhile
            if asks and (frame is None or asks[0].before_seq <= frame.seq):
                ask = asks.popleft()
                if frame is None or ask.before_seq != frame.seq or not self._snapshots_in_frames:
                    await call.write(pb.AttachRequest(snapshot=ask))
                    continue
                # in the frame it comes before: one message, one write, so the frame does not wait
                # for the ask's write to complete (grpc takes one write at a time), nor the relay
                # for a second read (docs/benchmarks.md#the-ask-in-the-prompts-frame); the frame
                # kept for a resend stays plain (a new stream asks again on its own)
                frame = pb.StdinFrame(seq=frame.seq, data=frame.data, snapshot_before=ask)
            if frame is None:
                break
            await call.write(pb.AttachRequest(stdin=frame))
            stdin.sent(frame.seq)
        if stdin.ended and not stdin.end_sent:
            await call.write(pb.AttachRequest(close_stdin=True))
            stdin.sent_end()

    async def _trim_by_status(self) -> None:
        """Forget the stdin frames the relay says it wrote (a long-lived stream's, which no
        re-attach's ``ready`` trims)."""
        self._trimming = True
        try:
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                status = await self._stub.Status(pb.StatusRequest(agent_id=self._agent_id), metadata=self._metadata,
                                                 timeout=self._stop_grace)  # fmt: skip
                self._stdin.written(status.agent.stdin_seq)
        finally:
            self._trimming = False

    # ------------------------------------------------------------ snapshots asked on the stream

    def snapshot_before_stdin(
        self, metadata: Metadata, request: workspace_pb.SnapshotRequest
    ) -> asyncio.Future[pb.SnapshotTaken] | None:
        """Ask the relay for the snapshot ``request`` before the next frame written on stdin reaches
        the agent (docs/relay.md#the-before-snapshot-on-the-stream): sent on the stream, in stdin's
        order, with no call of its own. Its answer, or ``ConnectionError`` when none can come (the
        stream dropped after the relay wrote that frame, the agent's exit, a detach). None when it
        cannot be asked so: the store is another relay's (``metadata``, which carries a relay's own
        secret, is not this one's), the relay did not say it takes them, or stdin is over."""
        if metadata != self._metadata or not self._snapshots_on_stream or self._detached:
            return None
        if self.exited.done() or self._stdin.is_closing():
            return None
        ask = pb.SnapshotAsk(id=next(self._ask_ids), before_seq=self._stdin.last_seq + 1, request=request)
        answer: asyncio.Future[pb.SnapshotTaken] = self._loop.create_future()
        self._asks[ask.id] = (ask, answer)
        self._unsent_asks.append(ask)
        self._send_soon()
        return answer

    def _ask_again(self, written: int) -> None:
        """A new stream, whose ``ready`` says the relay wrote stdin up to ``written``: a snapshot not
        answered whose frame it came before is not written yet is asked again on it (one the relay
        took meanwhile is taken anew: the agent has read nothing after it); one whose frame the
        relay wrote has lost its answer with the stream, and fails."""
        self._unsent_asks.clear()
        for ask_id, (ask, answer) in list(self._asks.items()):
            if answer.done():
                del self._asks[ask_id]
            elif ask.before_seq <= written or not self._snapshots_on_stream:
                del self._asks[ask_id]
                why = (f"the relay's stream dropped before the snapshot's answer, and stdin frame {ask.before_seq} "
                       "was written since" if self._snapshots_on_stream else "the relay takes no snapshot asked on "
                       "its stream")  # fmt: skip
                answer.set_exception(ConnectionError(why))
            else:
                self._unsent_asks.append(ask)

    def _fail_asks(self, why: str) -> None:
        self._unsent_asks.clear()
        for _, answer in self._asks.values():
            if not answer.done():
                answer.set_exception(ConnectionError(why))
        self._asks.clear()

    async def _signal(self, sig: signal.Signals) -> None:
        request = pb.SignalRequest(agent_id=self._agent_id, generation=self._generation, signal=int(sig))
        try:
            await self._stub.Signal(request, metadata=self._metadata, timeout=self._stop_grace)
        except grpc.aio.AioRpcError as exc:  # gone already, or the relay is away: its exit says the rest
            log.info("relayed_agent_signal_failed", agent=self._name, pid=self.pid, signal=sig.name,
                     code=exc.code().name, details=exc.details())  # fmt: skip
        except grpc.aio.UsageError as exc:  # the daemon is stopping: its channel to the relay is closed
            log.info("relayed_agent_signal_failed", agent=self._name, pid=self.pid, signal=sig.name, details=str(exc))

    async def _lost_after(self, grace: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.exited), grace)
            return
        self._follower.cancel()
        self._lost(f"no exit came from the relay {grace} s after the agent was let go")

    # ------------------------------------------------------------ the end

    def _exit(self, code: int, stderr_tail: str) -> None:
        """The agent's exit: its code, its stderr's end, the end of its stdout (after what was written)."""
        if self.exited.done():
            return
        self._returncode = code
        if stderr_tail:
            self.stderr.feed_data(stderr_tail.encode())
        self.stderr.feed_eof()
        self._stdout_writer.close()
        # a writer's drain raises from now on, as on a local agent's closed pipe
        self._stdin.lost(BrokenPipeError(f"the agent (pid {self.pid}) exited"))
        self._fail_asks(f"the agent (pid {self.pid}) exited")
        self.exited.set_result(None)

    def _lost(self, why: str) -> None:
        self._lost_why = why
        log.warning("relayed_agent_lost", agent=self._name, pid=self.pid, agent_id=self._agent_id, why=why,
                    relay=self.place.socket)  # fmt: skip
        self._exit(LOST_EXIT, f"rcoder: {why}")

    def _spawn(self, coroutine: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _cancelling() -> bool:
    """Whether the task running is being cancelled (not merely handed a ``CancelledError``)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (a relay on this host) still runs: not gone, not a zombie."""
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    except (PermissionError, OSError, IndexError):
        return True  # there, though not ours to read: counted as running
    return state != "Z"


async def _writer(loop: asyncio.AbstractEventLoop, pipe: Any) -> asyncio.StreamWriter:
    """A stream writer on our end of a pipe (asyncio's own flow control: ``drain`` waits while the
    pipe is full)."""
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, pipe)
    return asyncio.StreamWriter(transport, protocol, None, loop)
