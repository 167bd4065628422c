"""The token a client on the daemon's own host sends when not told one (docs/design.md#no-calls-back), and
where that daemon answers.

A daemon with no ``auth_token`` keeps a generated one in ``<data_dir>/auth_token`` (0600), so
``make run`` and then ``rcoder chat`` in the same folder just work: the client looks for it where
the daemon's config says. What a person can read there, an agent cannot (its sandbox hides data_dir).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

TOKEN_FILE = "auth_token"  # noqa: S105 (a file name) - the daemon's name for it (rcoder.api.access)
DEFAULT_DATA_DIR = ".rcoder"
DEFAULT_LISTEN = "127.0.0.1:50051"
# a daemon listening on every address is reached on loopback
WILDCARDS = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}  # noqa: S104 - read, not bound


def find_token(environ: Mapping[str, str] | None = None, config_file: Path | None = None) -> str:
    """``RCODER_TOKEN``, else ``RCODER_AUTH_TOKEN``, else the config's ``auth_token``, else the file
    in the daemon's data_dir (``RCODER_DATA_DIR``, else the config's ``data_dir``, else ``.rcoder``);
    the config is ``config_file``, else ``RCODER_CONFIG``. "" when none of these says one."""
    environ = os.environ if environ is None else environ
    for name in ("RCODER_TOKEN", "RCODER_AUTH_TOKEN"):
        if environ.get(name):
            return environ[name]
    if config_file is None and environ.get("RCODER_CONFIG"):
        config_file = Path(environ["RCODER_CONFIG"])
    data_dir = Path(DEFAULT_DATA_DIR)
    if config_file is not None:
        try:
            config = tomllib.loads(config_file.read_text("utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            config = {}
        if isinstance(config.get("auth_token"), str) and config["auth_token"]:
            return str(config["auth_token"])
        if isinstance(config.get("data_dir"), str):
            data_dir = config_file.parent / config["data_dir"]  # relative to the file, as the daemon reads it
    if environ.get("RCODER_DATA_DIR"):
        data_dir = Path(environ["RCODER_DATA_DIR"])
    try:
        return (data_dir / TOKEN_FILE).read_text("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def local_target(environ: Mapping[str, str], config_file: Path | None = None) -> str:
    """Where this host's daemon answers: its listen address, a wildcard host as loopback."""
    listen = environ.get("RCODER_LISTEN", "")
    config = config_file or (Path(environ["RCODER_CONFIG"]) if environ.get("RCODER_CONFIG") else None)
    if not listen and config is not None:
        try:
            value = tomllib.loads(config.read_text("utf-8")).get("listen")
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            value = None
        listen = value if isinstance(value, str) else ""
    host, _, port = (listen or DEFAULT_LISTEN).rpartition(":")
    return f"{WILDCARDS.get(host, host)}:{port}"
