"""A small client of the Docker Engine API on its unix socket (docs/relay.md#containers).

Docker's ``/var/run/docker.sock``, or podman's compatible one (``podman system service``). Only what
a relay's container needs: a named volume made and inspected, a container created, started,
inspected, listed by label, waited for, stopped and removed, and the end of its log. The standard library's
``http.client`` over ``AF_UNIX``: no dependency for six calls. Each call is blocking and bounded by
its timeout (a new connection per call: nothing held between calls); callers in the event loop run
it in a thread.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rcoder import errors

API_VERSION = "v1.41"  # Docker 20.10's, served by Docker since and by podman 4's compatible service
DEFAULT_SOCKET = Path("/var/run/docker.sock")
CALL_TIMEOUT = 60.0  # a create pulls nothing (the image is local); a stop waits its grace on top
_LOG_TAIL = 40


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 to the engine's unix socket."""

    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self._path))
        except OSError:
            sock.close()
            raise
        self.sock = sock


class Engine:
    """The Docker Engine API at ``socket_path``. Every failure is a ``ContainerEngineError`` that
    says the call, the engine's status and its message."""

    def __init__(self, socket_path: Path = DEFAULT_SOCKET, timeout: float = CALL_TIMEOUT) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Any = None, query: Mapping[str, str] | None = None,
              timeout: float | None = None, allowed: tuple[int, ...] = ()) -> tuple[int, bytes]:  # fmt: skip
        """The status and body of one call; a status of 400 or more not in ``allowed`` raises."""
        target = f"/{API_VERSION}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        connection = _UnixConnection(self.socket_path, timeout or self.timeout)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            connection.request(method, target, None if body is None else json.dumps(body), headers)
            response = connection.getresponse()
            status, data = response.status, response.read()
        except FileNotFoundError as exc:
            why = f"no container engine socket at {self.socket_path}: start one (Docker, or podman's: " \
                  "`podman system service --time=0 unix://PATH`)"  # fmt: skip
            raise errors.ContainerEngineError(f"{method} {path}", 0, why) from exc
        except OSError as exc:
            why = f"the engine at {self.socket_path}: {exc}"
            raise errors.ContainerEngineError(f"{method} {path}", 0, why) from exc
        finally:
            connection.close()
        if status >= 400 and status not in allowed:
            raise errors.ContainerEngineError(f"{method} {path}", status, _message(data))
        return status, data

    def _json(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        _, data = self._call(method, path, body, **kwargs)
        return json.loads(data) if data.strip() else None

    def ping(self) -> None:
        self._call("GET", "/_ping")

    # ---------------------------------------------------------------- volumes

    def create_volume(
        self, name: str, labels: Mapping[str, str], options: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """The named volume, made (the engine answers an existing one as it is); ``options``: its
        driver's (``DriverOpts``)."""
        body: dict[str, Any] = {"Name": name, "Labels": dict(labels)}
        if options:
            body["DriverOpts"] = dict(options)
        made: dict[str, Any] = self._json("POST", "/volumes/create", body)
        return made

    def inspect_volume(self, name: str) -> dict[str, Any] | None:
        status, data = self._call("GET", f"/volumes/{_quote(name)}", allowed=(404,))
        return None if status == 404 else dict(json.loads(data))

    def remove_volume(self, name: str) -> bool:
        """Whether it was there to remove."""
        status, _ = self._call("DELETE", f"/volumes/{_quote(name)}", query={"force": "true"}, allowed=(404,))
        return status != 404

    # ---------------------------------------------------------------- containers

    def create_container(self, name: str, body: Mapping[str, Any]) -> str:
        """The new container's id."""
        made = self._json("POST", "/containers/create", dict(body), query={"name": name})
        return str(made["Id"])

    def start_container(self, ident: str) -> None:
        self._call("POST", f"/containers/{_quote(ident)}/start")  # 304: started already

    def inspect_container(self, ident: str) -> dict[str, Any] | None:
        status, data = self._call("GET", f"/containers/{_quote(ident)}/json", allowed=(404,))
        return None if status == 404 else dict(json.loads(data))

    def wait_container(self, ident: str, timeout: float) -> int:
        """Its exit code, once it is not running (within ``timeout``)."""
        done = self._json("POST", f"/containers/{_quote(ident)}/wait", query={"condition": "not-running"},
                          timeout=timeout)  # fmt: skip
        return int(done["StatusCode"])

    def stop_container(self, ident: str, grace: int) -> None:
        """SIGTERM (the image's stop signal), then SIGKILL after ``grace`` seconds."""
        self._call("POST", f"/containers/{_quote(ident)}/stop", query={"t": str(grace)},
                   timeout=self.timeout + grace, allowed=(404,))  # fmt: skip

    def remove_container(self, ident: str) -> bool:
        """Removed, running or not (its anonymous volumes too, never a named one); whether it was there."""
        status, _ = self._call("DELETE", f"/containers/{_quote(ident)}", query={"force": "true", "v": "true"},
                               allowed=(404,))  # fmt: skip
        return status != 404

    def list_containers(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Every container (running or not) that carries each of ``labels``."""
        filters = json.dumps({"label": [f"{key}={value}" for key, value in labels.items()]})
        found = self._json("GET", "/containers/json", query={"all": "true", "filters": filters})
        return [dict(row) for row in found or []]

    def log_tail(self, ident: str, lines: int = _LOG_TAIL) -> str:
        """The end of its stdout and stderr, for a person (empty when it has gone)."""
        query = {"stdout": "true", "stderr": "true", "tail": str(lines)}
        status, data = self._call("GET", f"/containers/{_quote(ident)}/logs", query=query, allowed=(404,))
        return "" if status == 404 else _demultiplexed(data).decode(errors="replace")


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def _message(data: bytes) -> str:
    try:
        return str(json.loads(data).get("message", "")) or data.decode(errors="replace")[:500]
    except (ValueError, AttributeError):
        return data.decode(errors="replace")[:500]


def _demultiplexed(data: bytes) -> bytes:
    """A log without a TTY comes in frames (a byte for the stream, three zeros, a big-endian length);
    anything else is taken as it is."""
    out = bytearray()
    at = 0
    while at + 8 <= len(data) and data[at] in (0, 1, 2) and data[at + 1 : at + 4] == b"\0\0\0":
        size = int.from_bytes(data[at + 4 : at + 8], "big")
        out += data[at + 8 : at + 8 + size]
        at += 8 + size
    return bytes(out) if at == len(data) else data
