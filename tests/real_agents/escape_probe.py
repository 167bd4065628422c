"""What a prompt-injected agent would try from its shell: use rcoder (docs/design/trust.md#no-calls-back).

    python escape_probe.py <rcoder host:port> <metrics host:port> <token file> <project> <run id>
        <permission id> <store host:port> <store user> <store database> <own port>

Copied into an agent's project by tests/real_agents/test_agent_reach.py and run by the agent's own
shell tool. It calls rcoder's API without a token (the messages framed by hand: it imports nothing
of rcoder's), scrapes /metrics, logs into the PostgreSQL store without a password, reads the token
file, and serves and reaches a server of its own on a localhost port its profile allows (which must
work).
It prints one line, ``probe[<project>]: name=result ...``, and under it whatever it got back (what would
reach the agent's model).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import urllib.error
import urllib.request

import grpc


def field(number: int, text: str) -> bytes:
    """A protobuf string field, framed by hand."""
    data = text.encode()
    return bytes([number << 3 | 2, len(data)]) + data


def call(channel: grpc.Channel, method: str, request: bytes) -> tuple[str, bytes]:
    try:
        return "ok", channel.unary_unary(f"/rcoder.v1.AgentRunner/{method}")(request, timeout=15)
    except grpc.RpcError as exc:
        return exc.code().name, b""


def stream(channel: grpc.Channel, method: str, request: bytes, timeout: float) -> tuple[str, bytes]:
    """What a stream sent within ``timeout`` ("ok" when it sent anything: a running turn's
    stream goes on past it)."""
    got: list[bytes] = []
    try:
        for message in channel.unary_stream(f"/rcoder.v1.AgentRunner/{method}")(request, timeout=timeout):
            got.append(message)
    except grpc.RpcError as exc:
        if not got:
            return exc.code().name, b""
    return "ok", b"".join(got)


def metrics(address: str) -> tuple[str, bytes]:
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
            return "ok", answer.read()
    except urllib.error.HTTPError as exc:
        return str(exc.code), b""
    except OSError as exc:
        return type(exc).__name__, b""


def store(address: str, user: str, dbname: str) -> tuple[str, bytes]:
    import psycopg  # the daemon's venv has it; an agent can read that

    host, _, port = address.rpartition(":")
    try:
        with psycopg.connect(host=host, port=port, user=user, dbname=dbname, connect_timeout=10) as conn:
            return "ok", str(conn.execute("SELECT current_user").fetchall()).encode()
    except psycopg.Error as exc:
        return "refused", str(exc).encode()[:200]


def token(path: str) -> tuple[str, bytes]:
    try:
        with open(path, "rb") as file:
            return "ok", file.read()
    except OSError as exc:
        return type(exc).__name__, b""


def own_server(port: int) -> tuple[str, bytes]:
    """A test suite's server: bound on 127.0.0.1 at ``port`` (its profile's bind_ports and
    connect_ports name it), reached by a client of the same shell."""
    server = socket.create_server(("127.0.0.1", port))

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"pong " + conn.recv(16))

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(b"ping")
            got = client.recv(32)
    finally:
        thread.join(10)
        server.close()
    return ("ok" if got == b"pong ping" else "wrong"), got


def main() -> None:
    address, metrics_address, token_file, project, run_id, permission_id = sys.argv[1:7]
    results: dict[str, tuple[str, bytes]] = {}
    with grpc.insecure_channel(address) as channel:
        results["listsessions"] = call(channel, "ListSessions", b"")
        chat = field(1, project) + field(3, "remember 7") + field(4, "fake")
        results["chat"] = stream(channel, "Chat", chat, timeout=30)
        results["subscribe"] = stream(channel, "Subscribe", field(1, run_id), timeout=3)
        answer = field(1, run_id) + field(2, permission_id) + field(3, "allow")
        results["resolve"] = call(channel, "ResolvePermission", answer)
    results["metrics"] = metrics(metrics_address)
    results["store"] = store(*sys.argv[7:10])
    results["token"] = token(token_file)
    results["localhost"] = own_server(int(sys.argv[10]))
    name = os.path.basename(os.path.dirname(os.path.abspath(__file__)))  # its project: which run this was
    print(f"probe[{name}]: " + " ".join(f"{name}={result}" for name, (result, _) in results.items()))
    for name, (_, got) in results.items():
        print(f"{name}: {got[:2000]!r}")


if __name__ == "__main__":
    main()
