"""``rcoder serve``: argv and environment → Settings → the daemon; ``rcoder chat``, ``sessions``
and ``agents``: a client of a running daemon (``rcoder.client_cli``), ``rcoder files``
(``rcoder.files_cli``), ``rcoder runs|diff|rewind|fork|cancel|attach`` (``rcoder.runs_cli``); ``rcoder health``:
whether a daemon serves (``rcoder.health_check``); ``rcoder relay``: a process that owns agents for
daemons (``rcoder.relay``, docs/relay.md).

The only module that reads the environment or the config file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.metadata
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO, cast

from rcoder import __version__, client_args
from rcoder.errors import ConfigError, DataDirInUse, ListenFailed

# The base install is the client; the daemon's dependencies are this extra (pyproject.toml).
DAEMON_INSTALL = "pip install 'rcoder[daemon]'"
_DAEMON_EXTRA = re.compile(r"""extra\s*==\s*["']daemon["']""")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rcoder", description="Run coding agents (ACP) behind a gRPC API.")
    parser.add_argument("--version", action="version", version=f"rcoder {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", type=Path, help="TOML config file (default: $RCODER_CONFIG)")
    serve.add_argument("--listen", help="host:port to serve on (default 127.0.0.1:50051)")
    serve.add_argument("--data-dir", help="where the store and agent state live")
    serve.add_argument("--workspace-root", help="parent folder of every project's working directory")
    serve.add_argument("--default-agent", help="profile used when a request names none")
    serve.add_argument("--log-level", help="debug | info | warning | error")
    serve.add_argument("--log-format", help="auto | json | console")
    client_args.add_commands(commands)
    health = commands.add_parser("health", help="exit 0 when the daemon's health service says SERVING")
    health.add_argument(
        "--target", help="host:port (default: $RCODER_TARGET, else this host's daemon: the port of its listen)"
    )
    health.add_argument("--config", type=Path, help="the daemon's config, for its listen (default: $RCODER_CONFIG)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    relay = commands.add_parser("relay", help="own agents for daemons, served over gRPC (docs/relay.md)")
    relay.add_argument(
        "--state-dir", type=Path, required=True, help="the relay's own folder (mode 0700): its socket and its secret"
    )
    relay.add_argument("--listen", default="", help="host:port to serve on over TCP too, with TLS only")
    relay.add_argument("--tls-cert", type=Path, help="PEM certificate for --listen")
    relay.add_argument("--tls-key", type=Path, help="PEM private key for --listen")
    relay.add_argument(
        "--buffer-bytes", type=int, default=16 << 20, help="stdout kept per agent until acknowledged (default 16 MiB)"
    )
    relay.add_argument(
        "--stop-grace", type=float, default=2.0, help="seconds an agent gets after stdin closes, then after SIGTERM"
    )
    relay.add_argument("--secret-fd", type=int, help="read the secret from this descriptor instead of making one")
    relay.add_argument(
        "--secret-file", type=Path, help="read the secret from this file (mode 0600) instead of making one"
    )
    relay.add_argument(
        "--keep-exited", type=int, default=64, help="exited agents still listed, newest first (default 64)"
    )
    relay.add_argument(
        "--idle-exit", type=float, default=0.0,
        help="stop after this many seconds with no agent (running or attached) and no call (default 0: never)",
    )  # fmt: skip
    relay.add_argument(
        "--unattached-end", type=float, default=0.0,
        help="end an agent no stream has been attached to for this many seconds (default 0: never)",
    )  # fmt: skip
    relay.add_argument("--log-level", default="info", help="debug | info | warning | error")
    relay.add_argument("--log-format", default="auto", help="auto | json | console")
    relay.add_argument(
        "--log-file", type=Path, help="write the log to this file (and stdout, stderr), kept within a bound"
    )
    relay.add_argument(
        "--log-max-bytes", type=int, default=16 << 20,
        help="with --log-file: its size at which it is moved aside to FILE.1 (the one before dropped); default 16 MiB",
    )  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    env = dict(os.environ)
    if args.command in ("chat", "sessions", "agents"):
        from rcoder import client_cli  # the client, for these commands alone (rcoder/client_args.py)

        return client_cli.run(args, env, sys.stdin, sys.stdout, sys.stderr)
    if args.command in ("runs", "diff", "rewind", "fork", "cancel", "attach"):
        from rcoder import runs_cli

        return runs_cli.run(args, env, sys.stdout, sys.stderr)
    if args.command == "files":
        from rcoder import files_cli

        return files_cli.run(args, env, sys.stdin, sys.stdout, sys.stderr)
    if args.command == "health":
        from rcoder import health_check
        from rcoder.client.token import local_target

        target = args.target or env.get("RCODER_TARGET") or local_target(env, args.config)
        return health_check.check(target, args.timeout, sys.stdout, sys.stderr)
    if args.command == "relay":
        return _relay(args)
    try:
        # imported late: the daemon's modules and their dependencies (pydantic, structlog, the ACP
        # SDK, ...) are the daemon's alone; `rcoder --help` and the client commands run without them
        with _collector_paused():
            from rcoder import logs
            from rcoder.config import load_settings
            from rcoder.daemon import serve
    except ModuleNotFoundError:
        missing = missing_daemon_requirements()
        if not missing:
            raise
        print(
            f"rcoder: `rcoder serve` needs the daemon's dependencies, which this install lacks "
            f"(missing: {', '.join(missing)}): {DAEMON_INSTALL}",
            file=sys.stderr,
        )
        return 2

    config_file = args.config or (Path(env["RCODER_CONFIG"]) if env.get("RCODER_CONFIG") else None)
    defaults_file = Path(env["RCODER_DEFAULTS"]) if env.get("RCODER_DEFAULTS") else None
    overrides = {
        "listen": args.listen,
        "data_dir": args.data_dir,
        "workspace_root": args.workspace_root,
        "default_agent": args.default_agent,
        "log_level": args.log_level,
        "log_format": args.log_format,
    }
    try:
        settings = load_settings(config_file, env, overrides, defaults_file=defaults_file)
    except ConfigError as exc:
        print(f"rcoder: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    if settings.flat_keys:  # read for one more release (docs/configuration.md#tables-and-the-flat-names)
        logs.get_logger("rcoder.config").warning(
            "config_key_deprecated",
            keys=dict(settings.flat_keys),
            files=[str(file) for file in (settings.defaults_file, settings.config_file) if file is not None],
            fix="these flat names are read until the next release: write each in its table, as keys says "
            "(tls.cert is cert in [tls])",
        )

    try:
        return asyncio.run(serve(settings))
    except ConfigError as exc:  # what only the running daemon can find out (the store's access)
        print(f"rcoder: {exc}", file=sys.stderr)
        return 2
    except (DataDirInUse, ListenFailed) as exc:  # another daemon, or another program, got there first
        print(f"rcoder: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"rcoder: {exc}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The daemon's or the relay's modules imported with Python's cyclic garbage collector paused,
    then frozen. An import makes hundreds of thousands of objects and next to no garbage, and the
    collector's passes over them were about a tenth of a start's CPU (0.70 s of CPU to import the
    daemon, 0.64 s paused; every daemon and relay start pays it, and a test run starts hundreds).
    Frozen (``gc.freeze``), what the imports made is left out of every later full collection of
    the long-running process; it is never garbage."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.freeze()


def _relay(args: argparse.Namespace) -> int:
    """``rcoder relay`` (its modules imported late, as the daemon's are: they need its dependencies)."""
    try:
        with _collector_paused():
            from rcoder import logs
            from rcoder.relay import log_file, serve
    except ModuleNotFoundError:
        missing = missing_daemon_requirements()
        if not missing:
            raise
        print(f"rcoder: `rcoder relay` needs the daemon's dependencies, which this install lacks "
              f"(missing: {', '.join(missing)}): {DAEMON_INSTALL}", file=sys.stderr)  # fmt: skip
        return 2

    stream: TextIO | None = None
    if args.log_file is not None:
        if args.log_max_bytes < log_file.MIN_MAX_BYTES:
            print(f"rcoder relay: --log-max-bytes: {args.log_max_bytes}: at least {log_file.MIN_MAX_BYTES}",
                  file=sys.stderr)  # fmt: skip
            return 2
        try:
            stream = cast(TextIO, log_file.RotatingLog(args.log_file.absolute(), args.log_max_bytes))
        except OSError as exc:
            print(f"rcoder relay: --log-file: {exc}", file=sys.stderr)
            return 2
    logs.configure(args.log_level, os.environ.get("RCODER_LOG_FORMAT", args.log_format), stream)
    options = serve.RelayOptions(args.state_dir, args.listen, args.tls_cert, args.tls_key, args.buffer_bytes,
                           args.stop_grace, args.secret_fd, args.keep_exited, args.secret_file,
                           args.idle_exit, args.unattached_end)  # fmt: skip
    try:
        return asyncio.run(serve.serve(options))
    except ConfigError as exc:
        print(f"rcoder relay: {exc}", file=sys.stderr)
        return 2
    except (ListenFailed, OSError) as exc:
        print(f"rcoder relay: {exc}", file=sys.stderr)
        return 1


def missing_daemon_requirements() -> list[str]:
    """The distributions of the ``daemon`` extra that this install lacks, by name.

    Read from the installed metadata: every missing one is named at once, including those imported
    only on some paths (psycopg, for a PostgreSQL store). Asked only once an import has failed: the
    look-ups cost ~0.1 s, and a daemon's start should not pay them. A source tree run without being
    installed has no metadata: nothing is named.
    """
    try:
        requirements = importlib.metadata.requires("rcoder") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    missing = []
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        name = re.match(r"[A-Za-z0-9._-]+", spec.strip())
        if name is None or not _DAEMON_EXTRA.search(marker):
            continue
        try:
            importlib.metadata.distribution(name.group(0))
        except importlib.metadata.PackageNotFoundError:
            missing.append(name.group(0))
    return missing


if __name__ == "__main__":
    sys.exit(main())
