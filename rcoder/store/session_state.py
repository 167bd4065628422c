"""A session's config options, chosen values and slash commands as the stores keep them: JSON
text, one column each (``sessions.config_options``, ``chosen_options``, ``commands``).

Compact keys, fields in a fixed order; what a column cannot be read as (written by a newer
rcoder, or damaged) reads as empty rather than failing every read of the session.
"""

from __future__ import annotations

import json
from typing import Any

from rcoder.domain import ConfigOption, ConfigValue, SessionRecord, SlashCommand

EMPTY_LIST = "[]"
EMPTY_OBJECT = "{}"


def options_json(options: tuple[ConfigOption, ...]) -> str:
    if not options:
        return EMPTY_LIST
    return json.dumps(
        [
            {"id": o.id, "name": o.name, "current": o.current_value, "category": o.category,
             "description": o.description, "type": o.type, "chosen": o.chosen,
             "values": [[v.value, v.name, v.description] for v in o.values]}
            for o in options
        ],
        separators=(",", ":"),
    )  # fmt: skip


def options_of(text: str | None) -> tuple[ConfigOption, ...]:
    try:
        return tuple(
            ConfigOption(
                id=str(o["id"]), name=str(o["name"]), current_value=str(o["current"]),
                values=tuple(ConfigValue(str(v[0]), str(v[1]), str(v[2])) for v in o["values"]),
                category=str(o["category"]), description=str(o["description"]), type=str(o["type"]),
                chosen=bool(o["chosen"]),
            )
            for o in _load(text, list)
        )  # fmt: skip
    except (KeyError, IndexError, TypeError):
        return ()


def chosen_json(chosen: tuple[tuple[str, str], ...]) -> str:
    return json.dumps(dict(chosen), separators=(",", ":")) if chosen else EMPTY_OBJECT


def chosen_of(text: str | None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in _load(text, dict).items()))


def commands_json(commands: tuple[SlashCommand, ...]) -> str:
    if not commands:
        return EMPTY_LIST
    return json.dumps([[c.name, c.description, c.input_hint] for c in commands], separators=(",", ":"))


def commands_of(text: str | None) -> tuple[SlashCommand, ...]:
    try:
        return tuple(SlashCommand(str(c[0]), str(c[1]), str(c[2])) for c in _load(text, list))
    except (IndexError, TypeError):
        return ()


def state_params(record: SessionRecord) -> tuple[str, str, str]:
    """The record's three columns, in table order."""
    return options_json(record.config_options), chosen_json(record.chosen_options), commands_json(record.commands)


def _load(text: str | None, kind: type) -> Any:
    try:
        value = json.loads(text) if text else kind()
    except ValueError:
        return kind()
    return value if isinstance(value, kind) else kind()
