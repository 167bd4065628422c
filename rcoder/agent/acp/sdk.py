"""The ACP SDK's import, made quick.

The SDK's models (``acp.schema``, ~280 pydantic models) ask pydantic for attribute docstrings
(``use_attribute_docstrings``): pydantic then finds and tokenizes each class's source, which is
half the import's CPU (~0.7 of ~1.4 s here) and paid by every process that speaks ACP - the
daemon at each start, and each agent written in Python. The docstrings only become JSON-schema
``description``s, which nothing here asks for; validation and dumping are the same without them.

Most of the other half builds each model's validator, and a process uses a few dozen of the
models: they are built at their first use instead (pydantic's ``defer_build``), ~0.2 s less.

``import_acp`` imports the SDK once so, and restores pydantic as it was, so no other model is
touched. Imports nothing of rcoder's: agents shipped with rcoder use it too.
"""

from __future__ import annotations

import importlib
import sys


def import_acp() -> None:
    """Import ``acp`` (and its schema) without field docstrings; a no-op once it is imported, or
    where pydantic's internals are not the ones this knows (then the import is the usual one)."""
    if "acp" in sys.modules:
        return
    try:
        from pydantic._internal import _config, _fields
    except ImportError:  # pragma: no cover - another pydantic: the usual import
        importlib.import_module("acp")
        return
    usual = getattr(_fields, "_update_fields_from_docstrings", None)
    if usual is None:  # pragma: no cover - another pydantic: the usual import
        importlib.import_module("acp")
        return
    _fields._update_fields_from_docstrings = _skip
    defaults = _config.config_defaults
    deferred = defaults.get("defer_build", False)
    defaults["defer_build"] = True  # each model is built at its first use: a process uses a few dozen
    try:
        importlib.import_module("acp")
    finally:
        _fields._update_fields_from_docstrings = usual
        defaults["defer_build"] = deferred


def _skip(*args: object, **kwargs: object) -> None:
    return None
