"""The token a client on the daemon's own host sends when not told one (docs/design/trust.md#no-calls-back), and
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
    """``RCODER_TOKEN``, else the daemon's ``auth_token`` (``RCODER_AUTH_TOKEN``, the config's, the
    defaults file's), else the file in the daemon's data_dir (``RCODER_DATA_DIR``, the config's,
    the defaults file's, else ``.rcoder``); the config is ``config_file``, else ``RCODER_CONFIG``,
    the defaults file ``RCODER_DEFAULTS``. "" when none of these says one."""
    environ = os.environ if environ is None else environ
    if environ.get("RCODER_TOKEN"):
        return environ["RCODER_TOKEN"]
    layers = _layers(environ, config_file)
    token = _key(layers, "auth_token")
    if token:
        return token
    data_dir = _key(layers, "data_dir", path=True) or DEFAULT_DATA_DIR
    try:
        return (Path(data_dir) / TOKEN_FILE).read_text("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def local_target(environ: Mapping[str, str], config_file: Path | None = None) -> str:
    """Where this host's daemon answers: its listen address, a wildcard host as loopback."""
    listen = _key(_layers(environ, config_file), "listen") or DEFAULT_LISTEN
    host, _, port = listen.rpartition(":")
    return f"{WILDCARDS.get(host, host)}:{port}"


# a layer: its keys, and the folder its relative paths start from (None: the variables)
Layer = tuple[Mapping[str, object], Path | None]


def _layers(environ: Mapping[str, str], config_file: Path | None) -> list[Layer]:
    """Where the daemon reads its keys, first the one that wins: ``RCODER_<KEY>`` variables, the
    config file, the defaults file (rcoder.config). A file that cannot be read says nothing."""
    variables = {
        name.removeprefix("RCODER_").lower(): value for name, value in environ.items() if name.startswith("RCODER_")
    }
    layers: list[Layer] = [(variables, None)]
    if config_file is None and environ.get("RCODER_CONFIG"):
        config_file = Path(environ["RCODER_CONFIG"])
    for path in (config_file, Path(environ["RCODER_DEFAULTS"]) if environ.get("RCODER_DEFAULTS") else None):
        if path is None:
            continue
        try:
            layers.append((tomllib.loads(path.read_text("utf-8")), path.parent))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            continue
    return layers


def _key(layers: list[Layer], key: str, path: bool = False) -> str:
    """The first non-empty string value of ``key``; a relative ``path`` against its file's folder."""
    for table, folder in layers:
        value = table.get(key)
        if isinstance(value, str) and value:
            return str(folder / value) if path and folder is not None else value
    return ""
