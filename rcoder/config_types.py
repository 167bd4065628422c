"""The value types of the config schema (rcoder.config): paths relative to the config file,
host:port addresses, store and collector URLs; and ``checked``, which turns pydantic's errors,
all of them, into one ConfigError naming each key's full path."""

from __future__ import annotations

import contextlib
import difflib
import ipaddress
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Annotated, TypeVar

from pydantic import Field, Strict, TypeAdapter, ValidationError
from pydantic.functional_validators import AfterValidator, BeforeValidator, WrapValidator
from pydantic_core.core_schema import ValidationInfo, ValidatorFunctionWrapHandler

from rcoder.errors import ConfigError

T = TypeVar("T")
# Strict everywhere but here: a TOML array becomes a tuple, a string a ResumeRoute or a Path.
Array = Annotated[tuple[T, ...], Strict(False)]
Count = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(ge=0)]


def _config_path(value: object, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Path:
    """A path; a relative one starts at the context's ``base_dir`` (the file's folder, else the cwd)."""
    if value == "":
        raise ValueError("expected a path, got ''")
    return Path((info.context or {}).get("base_dir", ""), handler(value))


def _optional_config_path(value: object, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> str:
    """ "" (none), or a path as a string; a relative one starts at the context's ``base_dir``."""
    text: str = handler(value)
    return text and str(Path((info.context or {}).get("base_dir", ""), text))


def _host_port(listen: str) -> str:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {listen!r}")
    return listen


def _store_url(url: str) -> str:
    # the problem names no part of the URL: it may hold a password
    if url and not url.startswith(("postgresql://", "postgres://")):
        raise ValueError('expected "" (SQLite in data_dir) or a postgresql:// (or postgres://) URL')
    return url


def _otlp_endpoint(url: str) -> str:
    if url and not url.startswith(("http://", "https://")):
        raise ValueError('expected "" (no traces exported) or an http:// (plaintext) or https:// (TLS) URL')
    return url


def _peer_host(pattern: str) -> str:
    with contextlib.suppress(ValueError):
        ipaddress.ip_network(pattern, strict=False)
        return pattern
    if not re.fullmatch(r"[A-Za-z0-9*?.-]+", pattern):
        raise ValueError(f"expected an IP network (10.0.0.0/8), an address or a host name pattern, got {pattern!r}")
    return pattern


_USER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}[$]?|[0-9]{1,10}:[0-9]{1,10}")


def _agent_user(value: str) -> str:
    if value and not _USER_NAME.fullmatch(value):
        raise ValueError(f'expected a user name (e.g. "rcoder-agent"), a numeric "UID:GID", or "", got {value!r}')
    return value


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B|[KMGTP]|B)?\s*", re.IGNORECASE)
# "G" alone is read as GiB, as memory sizes usually are
_UNITS = {"": 1, "b": 1, **{f"{u}ib": 1 << (10 * (i + 1)) for i, u in enumerate("kmgtp")},
          **{u: 1 << (10 * (i + 1)) for i, u in enumerate("kmgtp")},
          **{f"{u}b": 1000 ** (i + 1) for i, u in enumerate("kmgtp")}}  # fmt: skip


def parse_bytes(value: object) -> int:
    """A size: a whole number of bytes, or a string such as "10GiB", "512 MiB", "1.5GB" (KiB, MiB,
    GiB, TiB are powers of 1024; kB, MB, GB, TB of 1000)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number: float = value
    elif isinstance(value, str) and (match := _SIZE.fullmatch(value)):
        number = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    else:
        raise ValueError(f'expected a size in bytes or a string such as "10GiB", got {value!r}')
    if number < 0:
        raise ValueError(f"expected a size of 0 bytes or more, got {value!r}")
    return int(number)


def _advertise(address: str) -> str:
    return _host_port(address) if address else address


def check_project_pattern(pattern: str) -> str:
    """An fnmatch pattern over project ids ([A-Za-z0-9._-]): *, ?, [seq] and [!seq]; nothing the
    stores cannot match in SQL alike (rcoder.store)."""
    if not 1 <= len(pattern) <= 128:
        raise ValueError(f"expected a pattern of 1-128 characters, got {pattern[:40]!r}")
    if not _PATTERN.fullmatch(pattern):
        raise ValueError(
            f"expected an fnmatch pattern over project ids ([A-Za-z0-9._-] with *, ?, [seq], [!seq]), got {pattern!r}"
        )
    return pattern


_PATTERN = re.compile(r"(?:[A-Za-z0-9._*?-]|\[!?[A-Za-z0-9._-]+\])+")
_DIGEST = re.compile(r"[0-9a-fA-F]{64}")


def _token_digest(value: str) -> str:
    if value and not _DIGEST.fullmatch(value):
        raise ValueError('expected the token\'s SHA-256 as 64 hex digits (printf %s "$TOKEN" | sha256sum)')
    return value.lower()


# the smallest memory_max taken: below it an agent's interpreter cannot even start (docs/limits.md#keys)
MIN_MEMORY = 1 << 20


def _memory_size(size: int) -> int:
    if size < MIN_MEMORY:
        raise ValueError(f"expected at least 1 MiB ({MIN_MEMORY} bytes), got {size}")
    return size


# bytes: 1073741824, or "1GiB" (parse_bytes)
ByteSize = Annotated[int, BeforeValidator(parse_bytes)]
# a memory limit: a ByteSize of at least 1 MiB (rcoder.agent.confinement.limits)
MemorySize = Annotated[int, BeforeValidator(parse_bytes), AfterValidator(_memory_size)]
# a user name (a passwd entry), "UID:GID", or "" (agents as the daemon's user): rcoder.agent.confinement.agent_user
AgentUserName = Annotated[str, AfterValidator(_agent_user)]
ProjectPattern = Annotated[str, AfterValidator(check_project_pattern)]
TokenDigest = Annotated[str, AfterValidator(_token_digest)]
ClientName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
HostId = Annotated[str, Field(max_length=128, pattern=r"^[A-Za-z0-9._:-]*$")]
ConfigPath = Annotated[Path, Strict(False), WrapValidator(_config_path)]
# "" for none, else a ConfigPath kept as a string (jwt_jwks_file)
OptionalConfigPath = Annotated[str, WrapValidator(_optional_config_path)]
# "" is SQLite in data_dir; a postgresql:// URL the PostgreSQL store (rcoder.store.make_store);
# kept out of repr: it may hold a password
StoreUrl = Annotated[str, AfterValidator(_store_url), Field(repr=False)]
HostPort = Annotated[str, AfterValidator(_host_port)]
PeerHost = Annotated[str, AfterValidator(_peer_host)]  # "10.0.0.0/8", "::1", "rcoder-*.internal"
Advertise = Annotated[str, AfterValidator(_advertise)]  # "" or host:port
# OTLP/gRPC collector for traces (rcoder.tracing), e.g. "http://127.0.0.1:4317"; "" exports none
OtlpEndpoint = Annotated[str, AfterValidator(_otlp_endpoint)]


def checked(
    schema: TypeAdapter[T],
    data: object,
    base_dir: Path,
    strict: bool | None = None,
    key: Callable[[str], str] = str,
    known: Collection[str] = (),
    renamed: Mapping[str, str] | None = None,
) -> T:
    """``data`` checked against ``schema``: every problem in one ConfigError naming each key's path.

    An unknown key close to one of ``known`` (every key of the schema) is asked "did you mean",
    by its new name where a top-level key has one in ``renamed`` (``tls_cert``: ``tls.cert``);
    a required key reported missing beside an unknown key that spells it nearly is said once, as
    the misspelling (``comand``), not as a missing ``command``."""
    try:
        return schema.validate_python(data, strict=strict, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise _config_error(exc, key, known, renamed or {}) from exc


def _config_error(
    exc: ValidationError, key: Callable[[str], str], known: Collection[str], renamed: Mapping[str, str]
) -> ConfigError:
    errors = [(tuple(p for p in e["loc"] if p != "[key]"), e) for e in exc.errors(include_url=False)]
    missing = {loc for loc, error in errors if error["type"] == "missing"}
    # the key each unknown one is close to, and the required keys an unknown one misspells
    near: dict[tuple[object, ...], str] = {}
    for loc, error in errors:
        if error["type"] == "extra_forbidden" and loc and isinstance(loc[-1], str):
            near.update((loc, m) for m in difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.75))
    misspelt = {(*loc[:-1], meant) for loc, meant in near.items()} & missing
    problems: list[tuple[str, str]] = []
    for loc, error in errors:
        if loc in misspelt:
            continue  # said with the unknown key that misspells it
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).removeprefix(".")
        problem = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            meant = near.get(loc)
            required = " (a required key, missing)" if (*loc[:-1], meant) in misspelt else ""
            meant = renamed.get(meant, meant) if meant and len(loc) == 1 else meant
            guess = f": did you mean {meant!r}?{required}" if meant else ""
            problem = f"unknown key{guess} (see docs/configuration.md)"
        problems.append((key(path), problem))
    return ConfigError(*problems[0], more=tuple(problems[1:]))
