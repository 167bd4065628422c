"""Settings and agent profiles: TOML file < ``RCODER_*`` environment < flags.

Built once by ``cli`` and passed down; nothing below reads the environment or
files. Every problem is a ``ConfigError`` naming the key.
"""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rcoder.domain import ModelProvider, ResumeRoute
from rcoder.errors import ConfigError

# Variables an agent inherits from the daemon. Everything else (the daemon's
# own secrets, IS_SANDBOX, proxies...) stays out unless a profile names it.
BASE_AGENT_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "TERM",
)

# extra_meta keys any profile accepts: W3C trace context, reserved for it by ACP.
DEFAULT_META_KEYS = ("traceparent", "tracestate", "baggage")
MCP_KINDS = ("stdio", "http", "sse")

# ChatRequest.model_provider fields a profile can map to environment variables.
PROVIDER_FIELDS = ("base_url", "api_key", "model")

# What rcoder knows how to set up (profile key ``kind``; rcoder/agent/kinds.py).
AGENT_KINDS = ("generic", "claude", "claude-legacy", "codex", "gemini", "opencode")

# The pinned agents `make agents` installs, beside the rcoder package (not the cwd).
AGENTS_DIR = Path(__file__).resolve().parent.parent / "agents" / "node_modules"


@dataclass(frozen=True, slots=True)
class PermissionRule:
    """``{ kind = "execute", title = "rm *", action = "deny" }``: a tool kind ("*" for any),
    a glob over the tool call's title, and allow | deny | ask."""

    action: str
    kind: str = "*"
    title: str = "*"


PERMISSION_ACTIONS = ("allow", "deny", "ask")


@dataclass(frozen=True, slots=True)
class AgentProfile:
    """How to run one kind of agent (``[agents.<name>]``)."""

    name: str
    command: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    resume: ResumeRoute = ResumeRoute.AUTO
    warm_pool: int = 0
    # names of daemon environment variables passed through to the agent
    inherit_env: tuple[str, ...] = ()
    # model_provider field -> environment variable, e.g. {"api_key": "ANTHROPIC_API_KEY"}
    provider_env: Mapping[str, str] = field(default_factory=dict)
    # folder the config file lives in: relative commands resolve against it
    base_dir: Path = field(default_factory=Path.cwd)
    # operator rules for the agent's permission requests, first match wins
    permission_rules: tuple[PermissionRule, ...] = ()
    # what clients may set (DESIGN §6): extra_meta key paths, MCP server kinds,
    # stdio MCP commands, and whether a request may choose the model base URL
    allow_meta_keys: tuple[str, ...] = DEFAULT_META_KEYS
    allow_mcp: tuple[str, ...] = ()
    allow_mcp_commands: tuple[str, ...] = ()
    allow_client_base_url: bool = False
    # what rcoder knows about the agent (AGENT_KINDS): its home, config files, quirks
    kind: str = "generic"
    # model provider defaults; a request's non-empty model_provider fields win
    model_base_url: str = ""
    model_api_key: str = field(default="", repr=False)
    model: str = ""

    def model_provider(self, request: ModelProvider) -> ModelProvider:
        """The provider an agent of this profile runs with: the request's, else the profile's."""
        return ModelProvider(
            base_url=request.base_url or self.model_base_url,
            api_key=request.api_key or self.model_api_key,
            model=request.model or self.model,
        )

    def resolve_command(self, search_path: str) -> str | None:
        """The executable to run: a path (relative to the config file) or a name on PATH."""
        if os.sep in self.command:
            path = Path(self.command)
            path = path if path.is_absolute() else self.base_dir / path
            return str(path) if os.access(path, os.X_OK) and path.is_file() else None
        return shutil.which(self.command, path=search_path)


DEFAULT_DATA_DIR = Path(".rcoder")


@dataclass(frozen=True, slots=True)
class Settings:
    listen: str = "127.0.0.1:50051"
    data_dir: Path = DEFAULT_DATA_DIR
    workspace_root: Path = Path("workspace")
    default_agent: str = "claude"
    auth_token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    max_live_agents: int = 32
    idle_timeout: float = 600.0
    shutdown_grace: float = 30.0
    # bounds on agent start-up steps, seconds
    initialize_timeout: float = 30.0
    session_open_timeout: float = 60.0
    # agents spawning and initialising at the same moment, at most
    agent_start_concurrency: int = 4
    # each step of ending an agent (close stdin, SIGTERM, SIGKILL) waits this long
    agent_stop_grace: float = 3.0
    # stderr bytes kept per agent for error messages
    stderr_tail_bytes: int = 8192
    # max bytes of one line the agent may write on stdout
    agent_line_limit: int = 64 * 1024 * 1024
    # events kept per run for Subscribe replay; finished runs kept this many seconds
    run_buffer_events: int = 10000
    run_retention: float = 600.0
    # host:port for Prometheus /metrics; empty: not served
    metrics_listen: str = ""
    log_level: str = "info"
    log_format: str = "auto"  # auto | json | console
    # when a known session's agent lost it, prefix a summary of rcoder's transcript
    reseed_on_fallback: bool = True
    reseed_max_bytes: int = 16384
    # seconds an agent gets to end a cancelled turn before its process group is ended
    cancel_grace: float = 10.0
    # seconds a permission request waits for ResolvePermission before it is rejected
    permission_timeout: float = 300.0
    # seconds a turn's prompt may run, permission waits included, before it ends with an
    # AGENT_TIMEOUT error (a model API that never answers must not hold a session forever)
    turn_timeout: float = 3600.0
    # a heartbeat event after this many quiet seconds in a turn (0: none)
    heartbeat_interval: float = 15.0
    agents: Mapping[str, AgentProfile] = field(default_factory=dict)
    # the environment agents inherit (already filtered by the allow-list + inherit_env)
    daemon_env: Mapping[str, str] = field(default_factory=dict)

    def profile(self, name: str) -> AgentProfile | None:
        return self.agents.get(name)

    def agent_env(self, profile: AgentProfile, kind_env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment an agent of ``profile`` starts with (before model provider):
        inherited variables, then its kind's, then the profile's own ``env``."""
        names = BASE_AGENT_ENV + profile.inherit_env
        env = {k: self.daemon_env[k] for k in names if k in self.daemon_env}
        env.update(kind_env or {})
        env.update(profile.env)
        return env

    def agent_home(self, profile: AgentProfile) -> Path:
        """``<data_dir>/agents/<profile>``: the agent's HOME, stable across restarts."""
        return (self.data_dir / "agents" / profile.name).absolute()


def builtin_profiles(data_dir: Path = DEFAULT_DATA_DIR) -> dict[str, AgentProfile]:
    """Profiles available with no config file: the agents ``make agents`` installs, and
    ``echo`` (rcoder's own, no model needed), which keeps its sessions under ``data_dir``."""
    return {name: _profile(name, table, AGENTS_DIR) for name, table in _builtin_tables(data_dir).items()}


def _builtin_tables(data_dir: Path = DEFAULT_DATA_DIR) -> dict[str, dict[str, Any]]:
    def installed(relative: str, name: str) -> str:
        path = AGENTS_DIR / relative
        return str(path) if path.is_file() else name  # else a name on PATH

    anthropic = ["ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"]
    echo_home = Settings(data_dir=data_dir).agent_home(AgentProfile(name="echo", command=sys.executable))
    return {
        "echo": {  # rcoder/echo_agent.py; -P: the project's cwd never shadows the rcoder package
            "command": sys.executable,
            "args": ["-P", "-m", "rcoder.echo_agent", "--state-dir", str(echo_home)],
        },
        "claude": {
            "kind": "claude",
            "command": installed(".bin/claude-agent-acp", "claude-agent-acp"),
            "inherit_env": anthropic,
        },
        "claude-legacy": {
            "kind": "claude-legacy",
            "command": installed(".bin/claude-code-acp", "claude-code-acp"),
            "inherit_env": anthropic,
        },
        "codex": {
            "kind": "codex",
            "command": installed("@zed-industries/codex-acp-linux-x64/bin/codex-acp", "codex-acp"),
            "inherit_env": ["OPENAI_API_KEY"],
        },
        "gemini": {
            "kind": "gemini",
            "command": installed(".bin/gemini", "gemini"),
            "args": ["--acp"],
            "inherit_env": ["GEMINI_API_KEY"],
        },
        "opencode": {
            "kind": "opencode",
            "command": installed("opencode-linux-x64/bin/opencode", "opencode"),
            "args": ["acp", "--pure"],
        },
    }


_NUMBER_KEYS = {
    "max_live_agents": int,
    "idle_timeout": float,
    "shutdown_grace": float,
    "initialize_timeout": float,
    "session_open_timeout": float,
    "agent_stop_grace": float,
    "agent_start_concurrency": int,
    "stderr_tail_bytes": int,
    "agent_line_limit": int,
    "run_buffer_events": int,
    "run_retention": float,
    "reseed_max_bytes": int,
    "cancel_grace": float,
    "permission_timeout": float,
    "turn_timeout": float,
    "heartbeat_interval": float,
}
_BOOL_KEYS = {"reseed_on_fallback"}
_STRING_KEYS = {
    "listen", "metrics_listen", "default_agent", "auth_token", "tls_cert", "tls_key", "log_level", "log_format",
}  # fmt: skip
_PATH_KEYS = {"data_dir", "workspace_root"}
_PROFILE_KEYS = {"command", "args", "env", "resume", "warm_pool", "inherit_env", "provider_env", "permission_rules"}
_PROFILE_KEYS |= {"kind", "model_base_url", "model_api_key", "model"}
_PROFILE_KEYS |= {"allow_meta_keys", "allow_mcp", "allow_mcp_commands", "allow_client_base_url"}


def load_settings(
    config_file: Path | None,
    environ: Mapping[str, str],
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build Settings from a TOML file, ``RCODER_<KEY>`` variables and flag overrides."""
    raw: dict[str, Any] = {}
    base_dir = Path.cwd()
    if config_file is not None:
        raw = _read_toml(config_file)
        base_dir = config_file.resolve().parent
    agents_raw = raw.pop("agents", {})
    values: dict[str, Any] = {}
    for key, value in raw.items():
        values[key] = _convert(key, value, base_dir)
    for key in _NUMBER_KEYS.keys() | _STRING_KEYS | _PATH_KEYS | _BOOL_KEYS:
        env_value = environ.get(f"RCODER_{key.upper()}")
        if env_value is not None:
            values[key] = _convert(f"RCODER_{key.upper()}", env_value, Path.cwd(), name=key)
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = _convert(key, value, Path.cwd())
    data_dir = values.get("data_dir", DEFAULT_DATA_DIR)
    agents = builtin_profiles(data_dir)
    if not isinstance(agents_raw, dict):
        raise ConfigError("agents", "must be a table of [agents.<name>] profiles")
    builtin = _builtin_tables(data_dir)
    for name, table in agents_raw.items():
        # a table named like a built-in profile changes only the keys it sets
        merged = {**builtin[name], **table} if name in builtin and isinstance(table, dict) else table
        agents[name] = _profile(name, merged, base_dir)
    settings = Settings(**values, agents=agents)
    daemon_env = _agent_visible_env(environ, agents.values())
    settings = replace(settings, daemon_env=daemon_env)
    _check(settings)
    return settings


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("--config", f"file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", f"{path} is not valid TOML: {exc}") from None


def _convert(key: str, value: Any, base_dir: Path, name: str | None = None) -> Any:
    name = name or key
    if name in _NUMBER_KEYS:
        kind = _NUMBER_KEYS[name]
        try:
            number = kind(value)
        except (TypeError, ValueError):
            raise ConfigError(key, f"expected a number, got {value!r}") from None
        if isinstance(value, bool) or number < 0:
            raise ConfigError(key, f"expected a non-negative number, got {value!r}")
        return number
    if name in _BOOL_KEYS:
        if isinstance(value, str) and value.lower() in {"true", "1", "yes", "false", "0", "no"}:
            return value.lower() in {"true", "1", "yes"}
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
        return value
    if name in _STRING_KEYS:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    if name in _PATH_KEYS:
        if not isinstance(value, str | Path) or not str(value):
            raise ConfigError(key, f"expected a path, got {value!r}")
        path = Path(value)
        return path if path.is_absolute() else (base_dir / path)
    raise ConfigError(key, "unknown key (see README, Configuration)")


def _profile(name: str, table: Any, base_dir: Path) -> AgentProfile:
    where = f"agents.{name}"
    if not isinstance(table, dict):
        raise ConfigError(where, "must be a table")
    unknown = set(table) - _PROFILE_KEYS
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}", "unknown key (see README, Agent profiles)")
    command = table.get("command")
    if not isinstance(command, str) or not command:
        raise ConfigError(f"{where}.command", "required: the agent's executable (a name on PATH or a path)")
    args = _string_list(table.get("args", []), f"{where}.args")
    inherit = _string_list(table.get("inherit_env", []), f"{where}.inherit_env")
    env = _string_table(table.get("env", {}), f"{where}.env")
    provider_env = _string_table(table.get("provider_env", {}), f"{where}.provider_env")
    for key in provider_env:
        if key not in PROVIDER_FIELDS:
            raise ConfigError(f"{where}.provider_env.{key}", f"must be one of {', '.join(PROVIDER_FIELDS)}")
    try:
        resume = ResumeRoute(table.get("resume", "auto"))
    except ValueError:
        choices = " | ".join(r.value for r in ResumeRoute)
        raise ConfigError(f"{where}.resume", f"expected {choices}, got {table.get('resume')!r}") from None
    warm = table.get("warm_pool", 0)
    if not isinstance(warm, int) or isinstance(warm, bool) or warm < 0:
        raise ConfigError(f"{where}.warm_pool", f"expected a non-negative integer, got {warm!r}")
    rules = _permission_rules(table.get("permission_rules", []), f"{where}.permission_rules")
    trust = _trust(table, where)
    kind = table.get("kind", "generic")
    if kind not in AGENT_KINDS:
        raise ConfigError(f"{where}.kind", f"expected {' | '.join(AGENT_KINDS)}, got {kind!r}")
    model = {key: table.get(key, "") for key in ("model_base_url", "model_api_key", "model")}
    for key, value in model.items():
        if not isinstance(value, str):
            raise ConfigError(f"{where}.{key}", "expected a string")
    return AgentProfile(
        name=name,
        permission_rules=rules,
        **trust,
        kind=kind,
        **model,
        command=command,
        args=tuple(args),
        env=env,
        resume=resume,
        warm_pool=warm,
        inherit_env=tuple(inherit),
        provider_env=provider_env,
        base_dir=base_dir,
    )


def _trust(table: dict[str, Any], where: str) -> dict[str, Any]:
    """The profile's allow-lists for client-supplied settings."""
    meta = _string_list(table.get("allow_meta_keys", list(DEFAULT_META_KEYS)), f"{where}.allow_meta_keys")
    mcp = _string_list(table.get("allow_mcp", []), f"{where}.allow_mcp")
    for kind in mcp:
        if kind not in MCP_KINDS:
            raise ConfigError(f"{where}.allow_mcp", f"expected kinds from {', '.join(MCP_KINDS)}, got {kind!r}")
    commands = _string_list(table.get("allow_mcp_commands", []), f"{where}.allow_mcp_commands")
    base_url = table.get("allow_client_base_url", False)
    if not isinstance(base_url, bool):
        raise ConfigError(f"{where}.allow_client_base_url", f"expected true or false, got {base_url!r}")
    return {
        "allow_meta_keys": tuple(meta),
        "allow_mcp": tuple(mcp),
        "allow_mcp_commands": tuple(commands),
        "allow_client_base_url": base_url,
    }


def _permission_rules(value: Any, key: str) -> tuple[PermissionRule, ...]:
    if not isinstance(value, list):
        raise ConfigError(key, "expected a list of { kind, title, action } tables")
    rules = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(item, dict) or set(item) - {"kind", "title", "action"}:
            raise ConfigError(where, "expected a table with kind, title and action")
        action = item.get("action")
        if action not in PERMISSION_ACTIONS:
            raise ConfigError(f"{where}.action", f"expected allow | deny | ask, got {action!r}")
        kind, title = item.get("kind", "*"), item.get("title", "*")
        if not isinstance(kind, str) or not isinstance(title, str):
            raise ConfigError(where, "kind and title must be strings")
        rules.append(PermissionRule(action=action, kind=kind, title=title))
    return tuple(rules)


def _string_list(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(key, f"expected a list of strings, got {value!r}")
    return list(value)


def _string_table(value: Any, key: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ConfigError(key, f"expected a table of strings, got {value!r}")
    return dict(value)


def _agent_visible_env(environ: Mapping[str, str], profiles: Any) -> dict[str, str]:
    names = set(BASE_AGENT_ENV)
    for profile in profiles:
        names.update(profile.inherit_env)
    return {k: environ[k] for k in names if k in environ}


def _check(settings: Settings) -> None:
    host, sep, port = settings.listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError("listen", f"expected host:port, got {settings.listen!r}")
    if settings.default_agent not in settings.agents:
        known = ", ".join(sorted(settings.agents))
        raise ConfigError("default_agent", f"no profile named {settings.default_agent!r} (profiles: {known})")
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ConfigError(
            "tls_cert" if not settings.tls_cert else "tls_key", "set both tls_cert and tls_key, or neither"
        )
    if settings.log_format not in {"auto", "json", "console"}:
        raise ConfigError("log_format", f"expected auto | json | console, got {settings.log_format!r}")
    if settings.max_live_agents < 1:
        raise ConfigError("max_live_agents", "must be at least 1")
