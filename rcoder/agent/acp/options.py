"""A session's config options and slash commands, as its agent reports them over the Agent Client Protocol.

An agent offers config options (``configOptions``) in its answer to session/new, load, resume
and fork, changes them with ``config_option_update`` (the whole list each time) and answers
``session/set_config_option`` with the whole list. An older agent offers ``modes`` instead
(``session/set_mode``, ``current_mode_update``); where it offers no "mode" config option of its
own, its modes are shown as one, id "mode", type ``OPTION_MODE``, so a client sees one list and
sets either the same way. Slash commands come only with ``available_commands_update``, at any
time (Claude's adapter sends them just after session/new, before any prompt).

``SessionState`` holds what one agent process said of its one session; ``acp_options`` and
``acp_commands`` turn the SDK's models into domain types.
"""

from __future__ import annotations

from typing import Any

from acp import schema as acp

from rcoder.domain import (
    OPTION_BOOLEAN,
    OPTION_MODE,
    OPTION_SELECT,
    ConfigOption,
    ConfigValue,
    SlashCommand,
)

MODE_ID = "mode"
_BOOLEAN_VALUES = (ConfigValue("true", "true"), ConfigValue("false", "false"))

AcpOption = acp.SessionConfigOptionSelect | acp.SessionConfigOptionBoolean


def acp_options(options: list[AcpOption] | None) -> tuple[ConfigOption, ...]:
    """The agent's config options in our terms (grouped values flattened, in the agent's order)."""
    return tuple(_option(o) for o in options or ())


def _option(option: AcpOption) -> ConfigOption:
    category = option.category if isinstance(option.category, str) else ""
    if isinstance(option, acp.SessionConfigOptionBoolean):
        current = "true" if option.current_value else "false"
        return ConfigOption(option.id, option.name, current, _BOOLEAN_VALUES, category,
                            option.description or "", OPTION_BOOLEAN)  # fmt: skip
    values: list[ConfigValue] = []
    for item in option.options:
        group = item.options if isinstance(item, acp.SessionConfigSelectGroup) else [item]
        values.extend(ConfigValue(v.value, v.name, v.description or "") for v in group)
    return ConfigOption(option.id, option.name, option.current_value, tuple(values), category,
                        option.description or "", OPTION_SELECT)  # fmt: skip


def mode_option(modes: acp.SessionModeState) -> ConfigOption:
    """An agent's session modes as the option "mode"."""
    values = tuple(ConfigValue(m.id, m.name, m.description or "") for m in modes.available_modes)
    return ConfigOption(MODE_ID, "Mode", modes.current_mode_id, values, "mode", "", OPTION_MODE)


def acp_commands(commands: list[acp.AvailableCommand]) -> tuple[SlashCommand, ...]:
    return tuple(
        SlashCommand(c.name, c.description, c.input.root.hint if c.input is not None else "") for c in commands
    )


class SessionState:
    """The config options and slash commands one agent process reported for its session."""

    def __init__(self) -> None:
        self._config: tuple[ConfigOption, ...] = ()
        self._modes: ConfigOption | None = None  # the agent's modes, shown as "mode" where it has no such option
        self.commands: tuple[SlashCommand, ...] | None = None  # None: the agent never listed any
        # commands listed outside a turn, not yet told to a turn's stream
        self.commands_untold = False
        self.version = 0  # counts changes: what a turn stored of them is known by it (no comparing)

    @property
    def options(self) -> tuple[ConfigOption, ...]:
        """Its config options, with its modes as "mode" where none of them is a mode."""
        modes = self._modes
        if modes is None or any(o.id == MODE_ID or o.category == "mode" for o in self._config):
            return self._config
        return (*self._config, modes)

    def opening(self) -> None:
        """A session is being opened: nothing is known of it yet. (Its commands may come before
        the answer that opens it is read: Claude sends them right after.)"""
        self._config, self._modes = (), None
        self.commands, self.commands_untold = None, False
        self.version += 1

    def opened(self, response: Any) -> None:
        """What the answer that opened the session offers (new, load, resume, fork; None: nothing)."""
        self._config = acp_options(getattr(response, "config_options", None))
        modes = getattr(response, "modes", None)
        self._modes = mode_option(modes) if isinstance(modes, acp.SessionModeState) else None
        self.version += 1

    def set_config(self, options: tuple[ConfigOption, ...]) -> None:
        """The whole list, as ``config_option_update`` or ``set_config_option``'s answer has it."""
        self._config = options
        self.version += 1

    def set_mode(self, mode_id: str) -> bool:
        """The agent's mode is now ``mode_id`` (``current_mode_update``, ``set_mode``'s success).
        Whether that changed the options shown."""
        modes = self._modes
        if modes is None or modes.current_value == mode_id:
            return False
        self._modes = ConfigOption(modes.id, modes.name, mode_id, modes.values, modes.category, modes.description,
                                   modes.type)  # fmt: skip
        self.version += 1
        return self.options[-1] is self._modes

    def set_commands(self, commands: tuple[SlashCommand, ...], in_turn: bool) -> None:
        self.commands = commands
        self.commands_untold = not in_turn
        self.version += 1

    def take_untold_commands(self) -> tuple[SlashCommand, ...] | None:
        """Commands listed since the last turn, once (a turn's stream starts with them)."""
        if not self.commands_untold or self.commands is None:
            return None
        self.commands_untold = False
        return self.commands
