"""What one turn crosses inside the daemon, counted rather than felt (docs/design/turn.md#measured).

Starts the daemon in this process with the built-in ``echo`` agent, sends one turn to warm the
session up, then profiles the next (a live turn, the hot path) and a turn of a new session (whose
agent starts): from the moment ``Chat`` is called until ``completed`` arrives, every call into
rcoder's own code (``sys.setprofile``) and every task created (the loop's task factory). Prints:

- ``classes``: rcoder's classes whose methods ran for the turn;
- ``functions``: rcoder's functions and methods that ran;
- ``deepest``: the most rcoder frames on one stack at once;
- ``tasks``: the tasks created for the turn (a task hop each), with their names.

    .venv/bin/python scripts/turn_anatomy.py [--json FILE]

It runs against whatever ``rcoder`` is importable, so an older checkout can be measured the same
way (run it with that checkout's interpreter from that checkout's root).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import grpc

from rcoder.config import load_settings
from rcoder.daemon import Daemon
from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc

TOKEN = "anatomy"


class Recorder:
    """Calls into rcoder (not its generated protobuf modules) and tasks created, while ``on``."""

    def __init__(self, package_root: str) -> None:
        self._root = package_root
        self._generated = str(Path(package_root) / "v1")
        self.on = False
        self.functions: Counter[str] = Counter()
        self.classes: set[str] = set()
        self.tasks: list[str] = []
        self.deepest = 0

    def _ours(self, frame: FrameType) -> bool:
        name = frame.f_code.co_filename
        return name.startswith(self._root) and not name.startswith(self._generated)

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call" or not self._ours(frame):
            return
        code = frame.f_code
        module = Path(code.co_filename).relative_to(self._root).with_suffix("").as_posix().replace("/", ".")
        qualname = code.co_qualname
        self.functions[f"{module}.{qualname}"] += 1
        owner = qualname.rpartition(".")[0]
        if owner and "<locals>" not in owner and "<" not in owner:
            self.classes.add(f"{module}.{owner}")
        depth = 0
        walk: FrameType | None = frame
        while walk is not None:
            depth += self._ours(walk)
            walk = walk.f_back
        self.deepest = max(self.deepest, depth)

    def task_factory(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        code = getattr(coro, "cr_code", None)
        if self.on and code is not None and code.co_filename.startswith(self._root):  # grpc's own are not counted
            self.tasks.append(code.co_qualname)
        return task

    def summary(self) -> dict[str, Any]:
        layers = Counter(name.split(".")[0] if name.count(".") > 1 else "rcoder" for name in self.classes)
        return {
            "classes": len(self.classes),
            "classes_by_package": dict(sorted(layers.items())),
            "functions": len(self.functions),
            "calls": sum(self.functions.values()),
            "deepest": self.deepest,
            "tasks": len(self.tasks),
            "task_names": sorted(Counter(self.tasks).items()),
            "class_names": sorted(self.classes),
        }


async def turn(stub: pb_grpc.AgentRunnerStub, session_id: str, prompt: str) -> str:
    request = pb.ChatRequest(project_id="anatomy", session_id=session_id, prompt=prompt)
    call = stub.Chat(request, metadata=(("authorization", f"Bearer {TOKEN}"),))
    async for message in call:
        if message.HasField("completed"):
            return str(message.session_id)
    raise RuntimeError("the turn ended without completed")


async def measure(root: Path, extra: str) -> dict[str, Any]:
    config = root / "rcoder.toml"
    config.write_text(
        f'listen = "127.0.0.1:0"\ndata_dir = "{root / "data"}"\nworkspace_root = "{root / "workspace"}"\n'
        f'auth_token = "{TOKEN}"\ndefault_agent = "echo"\n{extra}\n'
    )
    settings = load_settings(config, {})
    daemon = Daemon(settings)
    await daemon.start()
    import rcoder

    recorder = Recorder(str(Path(rcoder.__file__).parent))
    loop = asyncio.get_running_loop()
    loop.set_task_factory(recorder.task_factory)
    results: dict[str, Any] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.server.port}") as channel:
            stub = pb_grpc.AgentRunnerStub(channel)
            session_id = await turn(stub, "", "warm up")
            for name, session in (("live_turn", session_id), ("new_session_turn", "")):
                recorder = Recorder(recorder._root)
                loop.set_task_factory(recorder.task_factory)
                sys.setprofile(recorder.profile)
                recorder.on = True
                try:
                    await turn(stub, session, "hello")
                finally:
                    recorder.on = False
                    sys.setprofile(None)
                results[name] = recorder.summary()
    finally:
        loop.set_task_factory(None)
        await daemon.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write every name to this file, as JSON")
    parser.add_argument("--config", default="", help='more top-level config, e.g. "checkpoints = false"')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rcoder-anatomy-") as folder:
        results = asyncio.run(measure(Path(folder), args.config))
    if args.json:  # a file: the daemon logs to standard output
        args.json.write_text(json.dumps(results, indent=2))
    for name, found in results.items():
        print(f"{name}: {found['classes']} classes, {found['functions']} functions ({found['calls']} calls), "
              f"deepest {found['deepest']} frames, {found['tasks']} tasks")  # fmt: skip
        print("  classes by package:", ", ".join(f"{k} {v}" for k, v in found["classes_by_package"].items()))
        print("  tasks:", ", ".join(f"{task} x{count}" for task, count in found["task_names"]))


if __name__ == "__main__":
    main()
