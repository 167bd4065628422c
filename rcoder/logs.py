"""structlog set-up: JSON when not on a terminal, context bound via contextvars.

``bind_context(run_id=..., session_id=..., project_id=...)`` tags every line
logged in that task. Secrets never reach the output: values under keys that
look like credentials are replaced, whatever logged them.

rcoder's own lines take structlog's native path (filtered by level before any
work, rendered and written in one call): through stdlib ``logging`` a line cost
~130 µs against ~45 µs, and a turn logs on its hot path. What other libraries
log through stdlib (the ACP SDK, grpc) is rendered by the same processors into
the same stream.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

_SECRET_MARKERS = ("api_key", "apikey", "token", "authorization", "secret", "password")


@functools.lru_cache(maxsize=1024)
def _is_secret(key: str) -> bool:
    """Whether values under ``key`` are redacted (keys repeat: decided once per key)."""
    lowered = key.lower()
    return any(marker in lowered for marker in _SECRET_MARKERS)


def _redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in [k for k in event if _is_secret(k)]:
        if event[key]:
            event[key] = "<redacted>"
    return event


def configure(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    """Route structlog and stdlib logging (the ACP SDK, grpc) to one renderer."""
    out = stream or sys.stderr
    as_json = fmt == "json" or (fmt == "auto" and not out.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _redact,
    ]
    renderer: Any = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        logger_factory=_NamedWriteLoggerFactory(out),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


class _NamedWriteLogger(structlog.WriteLogger):
    """A ``WriteLogger`` that knows the name it was asked for (the ``logger`` field)."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


class _NamedWriteLoggerFactory:
    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: Any) -> _NamedWriteLogger:
        return _NamedWriteLogger(self._file, str(args[0]) if args else "rcoder")


def _add_logger_name(logger: Any, _: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    record = event.get("_record")
    name = record.name if record is not None else getattr(logger, "name", None)
    if name is not None:
        event["logger"] = name
    return event


def bind_context(**values: str) -> None:
    structlog.contextvars.bind_contextvars(**{k: v for k, v in values.items() if v})
