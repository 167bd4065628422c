"""A turn's config options (``ChatRequest.config_options``): checked against what the agent
offers, and only those that differ sent to it, before the prompt.

The values clients chose are kept with the session (``SessionRecord.chosen_options``), because an
agent process starts at its defaults: whenever the session opens in a new one (a restart, an
eviction, another host, a fallback), they are set again before the prompt. A live agent already
has them (and whatever it changed itself since, say a mode it left), so only the request's own are
set on it. A stored choice the new agent no longer offers is left out and logged: that turn was
not asked for it, so it does not fail for it.

A choice follows the agent afterwards: when the agent changes a chosen option itself (Claude
leaves plan mode), the session keeps the value the agent reports, not the one first chosen.
"""

from __future__ import annotations

from dataclasses import replace

from rcoder.domain import ConfigOption, SlashCommand
from rcoder.errors import InvalidArgument
from rcoder.logs import get_logger

log = get_logger(__name__)

Change = tuple[ConfigOption, str]


def wanted(requested: tuple[tuple[str, str], ...], stored: tuple[tuple[str, str], ...], fresh: bool) -> dict[str, str]:
    """The values the session's options must have this turn: the request's, over the stored
    choices when the agent process is new (``fresh``)."""
    values = dict(stored) if fresh else {}
    values.update(requested)
    return values


def changes(
    agent: str, options: tuple[ConfigOption, ...], want: dict[str, str], requested: tuple[tuple[str, str], ...]
) -> list[Change]:
    """The options to set, each with its value: those of ``want`` whose current value differs.

    An id or a value of the request (``requested``) that the agent does not offer is
    ``InvalidArgument`` naming what it offers, before anything is set; a stored one is skipped."""
    by_id = {o.id: o for o in options}
    asked = dict(requested)
    out: list[Change] = []
    for option_id, value in want.items():
        option = by_id.get(option_id)
        problem = ""
        if option is None:
            offered = ", ".join(by_id) or "none"
            problem = f"agent {agent!r} offers no config option {option_id!r} for this session (it offers: {offered})"
        elif not option.offers(value):
            values = ", ".join(v.value for v in option.values) or "none"
            problem = f"agent {agent!r} offers no value {value!r} for {option_id!r} (values offered: {values})"
        if problem and asked.get(option_id) == value:
            reason = "CONFIG_OPTION_UNKNOWN" if option is None else "CONFIG_VALUE_UNKNOWN"
            raise InvalidArgument(f"config_options.{option_id}", problem, reason=reason)
        if problem:
            log.warning("config_option_not_reapplied", agent=agent, config_id=option_id, value=value, why=problem)
        elif option is not None and option.current_value != value:
            out.append((option, value))
    return out


def chosen_after(
    stored: tuple[tuple[str, str], ...], requested: tuple[tuple[str, str], ...], options: tuple[ConfigOption, ...]
) -> tuple[tuple[str, str], ...]:
    """The session's choices after a turn: the stored ones and the request's, each at the value
    the agent now reports for it (sorted by id)."""
    values = dict(stored)
    values.update(requested)
    current = {o.id: o.current_value for o in options}
    return tuple(sorted((option_id, current.get(option_id, value)) for option_id, value in values.items()))


def marked(options: tuple[ConfigOption, ...], chosen: tuple[tuple[str, str], ...]) -> tuple[ConfigOption, ...]:
    """``options`` with ``chosen`` set on those clients chose."""
    ids = {option_id for option_id, _ in chosen}
    return tuple(replace(o, chosen=True) if o.id in ids else o for o in options)


def state_of(
    options: tuple[ConfigOption, ...],
    chosen: tuple[tuple[str, str], ...],
    commands: tuple[SlashCommand, ...] | None,
    stored_commands: tuple[SlashCommand, ...],
) -> tuple[tuple[ConfigOption, ...], tuple[tuple[str, str], ...], tuple[SlashCommand, ...]]:
    """What the store keeps of a session's options and commands (an agent that listed no
    commands yet keeps the stored list)."""
    return marked(options, chosen), chosen, stored_commands if commands is None else commands
