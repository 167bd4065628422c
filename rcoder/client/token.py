"""The token a client on the daemon's own host sends when not told one (docs/design/trust.md#no-calls-back), and
where that daemon answers.

A daemon with no ``auth_token`` keeps a generated one in ``<data_dir>/auth_token`` (0600), so
``make run`` and then ``rcoder chat`` in the same folder just work: the client looks for it where
the daemon's config says. What a person can read there, an agent cannot (its sandbox hides data_dir).
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rcoder.addresses import is_loopback

TOKEN_FILE = "auth_token"  # noqa: S105 (a file name) - the daemon's name for it (rcoder.api.access)
LOCK_RECORD = "daemon.lock"  # where the daemon holding a data_dir records its pid and address, as JSON
DEFAULT_DATA_DIR = ".rcoder"
DEFAULT_LISTEN = "127.0.0.1:50051"
# a daemon listening on every address is reached on loopback
WILDCARDS = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}  # noqa: S104 - read, not bound


@dataclass(frozen=True, slots=True)
class FoundToken:
    """A token and where it was found, or every place looked when none was: what a person is
    told when the daemon refuses the call (docs/clients.md#the-token)."""

    token: str
    source: str  # where ``token`` came from, e.g. "$RCODER_TOKEN" or a file's path; "" when none
    looked: tuple[str, ...]  # every place looked, in order
    local: bool = False  # the local daemon's own (its auth_token or data_dir file), not one given for this call
    withheld: str = ""  # where the local daemon's token was found, when it was not sent: the target is another
    address: str = ""  # where the daemon whose data_dir holds the token file serves, as it recorded it; "" unknown


def recorded_address(data_dir: Path) -> str:
    """The address the daemon that holds ``data_dir`` serves on, as it records it in its lock file
    (``daemon.lock``: its pid and address); "" when no live daemon recorded one there."""
    try:
        record = json.loads((data_dir / LOCK_RECORD).read_text("utf-8") or "{}")
        pid, listen = record.get("pid"), record.get("listen")
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(pid, int) or not isinstance(listen, str) or pid <= 0:
        return ""
    try:
        os.kill(pid, 0)  # a record left by a daemon that was killed names no daemon
    except ProcessLookupError:
        return ""
    except PermissionError:  # alive, as another user
        pass
    return listen


def on_this_host(target: str) -> bool:
    """Whether ``target``'s host is a loopback address (``localhost`` included)."""
    return is_loopback(target)


def same_daemon(target: str, local: str) -> bool:
    """Whether ``target`` is the address ``local_target`` says (``localhost`` as loopback)."""

    def norm(address: str) -> str:
        host, _, port = address.rpartition(":")
        host = {"localhost": "127.0.0.1", **WILDCARDS}.get(host, host)
        return f"{host}:{port}"

    return norm(target) == norm(local)


def find_token(environ: Mapping[str, str] | None = None, config_file: Path | None = None) -> str:
    """``RCODER_TOKEN``, else the daemon's ``auth_token`` (``RCODER_AUTH_TOKEN``, the config's, the
    defaults file's), else the file in the daemon's data_dir (``RCODER_DATA_DIR``, the config's,
    the defaults file's, else ``.rcoder``); the config is ``config_file``, else ``RCODER_CONFIG``,
    the defaults file ``RCODER_DEFAULTS``. "" when none of these says one."""
    return locate_token(os.environ if environ is None else environ, config_file).token


def locate_token(environ: Mapping[str, str], config_file: Path | None = None) -> FoundToken:
    """``find_token``'s token, with where it was found and where it was looked for."""
    looked = ["$RCODER_TOKEN"]
    if environ.get("RCODER_TOKEN"):
        return FoundToken(environ["RCODER_TOKEN"], "$RCODER_TOKEN", tuple(looked))
    layers = _layers(environ, config_file)
    looked += [_where(file, "auth_token") for _, file in layers]
    for table, file in layers:
        value = table.get("auth_token")
        if isinstance(value, str) and value:
            return FoundToken(value, _where(file, "auth_token"), tuple(looked), local=True)
    path = Path(_key(layers, "data_dir", path=True) or DEFAULT_DATA_DIR).absolute() / TOKEN_FILE
    looked.append(str(path))
    try:
        token = path.read_text("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        token = ""
    address = recorded_address(path.parent) if token else ""
    return FoundToken(token, str(path) if token else "", tuple(looked), local=bool(token), address=address)


def _where(file: Path | None, key: str) -> str:
    """How a place ``locate_token`` looked is said: a variable, or a key of a file."""
    return f"$RCODER_{key.upper()}" if file is None else f"{key} in {file}"


def local_target(environ: Mapping[str, str], config_file: Path | None = None) -> str:
    """Where this host's daemon answers: its listen address, a wildcard host as loopback."""
    listen = _key(_layers(environ, config_file), "listen") or DEFAULT_LISTEN
    host, _, port = listen.rpartition(":")
    return f"{WILDCARDS.get(host, host)}:{port}"


# a layer: its keys, and the file they were read from (None: the variables)
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
            layers.append((tomllib.loads(path.read_text("utf-8")), path))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            continue
    return layers


def _key(layers: list[Layer], key: str, path: bool = False) -> str:
    """The first non-empty string value of ``key``; a relative ``path`` against its file's folder."""
    for table, file in layers:
        value = table.get(key)
        if isinstance(value, str) and value:
            return str(file.parent / value) if path and file is not None else value
    return ""
