"""Settings and agent profiles: defaults file < TOML file < ``RCODER_*`` environment < flags.

The defaults file (``RCODER_DEFAULTS``, settings only, no profiles) is the lowest layer: what an
installation sets for everyone, as the container image sets its ``listen``, ``data_dir`` and
``workspace_root``, so that a config file mounted by its user still has the last word over them.

A file writes most settings in tables (``[tls] cert``); the model keeps each as one flat attribute
(``tls_cert``), named as its variable is (``RCODER_TLS_CERT``): rcoder.config_groups maps the two,
and reads the old flat names for one more release (docs/configuration.md).

Built once by ``cli`` and passed down; nothing below reads the environment or files.
The pydantic models are the schema (strict types, unknown keys refused); every problem
is a ``ConfigError`` naming the key's full path, e.g. ``agents.codex.warm_pool``.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import ipaddress
import os
import re
import shutil
import tomllib
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, Strict, TypeAdapter

from rcoder import landlock
from rcoder.addresses import is_loopback
from rcoder.builtin_agents import AGENTS_DIR as AGENTS_DIR  # public here too
from rcoder.builtin_agents import builtin_tables
from rcoder.config_groups import GROUPED_NAME, GROUPS, TABLE_OF, ungroup
from rcoder.config_types import (
    Advertise,
    AgentUserName,
    Array,
    ByteSize,
    ClientName,
    ConfigPath,
    Count,
    HostId,
    HostPort,
    MemorySize,
    OptionalConfigPath,
    OtlpEndpoint,
    PeerHost,
    ProjectPattern,
    Seconds,
    StoreUrl,
    TokenDigest,
    checked,
)
from rcoder.config_types import check_project_pattern as check_project_pattern  # public here too (rcoder.api)
from rcoder.domain import ResumeRoute
from rcoder.errors import ConfigError

# What an agent inherits from the daemon; the rest (secrets, IS_SANDBOX, proxies) only if its profile says so.
BASE_AGENT_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "TERM")
# The variable each kind's agent reads its model key from (a generic profile names its own in
# provider_env.api_key): what an agent's refused key and ListAgents name (docs/configuration.md).
KIND_KEY_VARIABLES = {
    "claude": "ANTHROPIC_API_KEY",
    "claude-legacy": "ANTHROPIC_API_KEY",
    "codex": "OPENAI_API_KEY",
    "gemini": "GEMINI_API_KEY",
}
# What rcoder knows how to set up (profile key ``kind``; rcoder/agent/profiles/kinds.py).
KindName = Literal["generic", "claude", "claude-legacy", "codex", "gemini", "opencode"]
AGENT_KINDS: tuple[str, ...] = get_args(KindName)
DEFAULT_DATA_DIR = Path(".rcoder")
# names the defaults file: the lowest layer, below the config file (set by the container image)
DEFAULTS_VARIABLE = "RCODER_DEFAULTS"
# top-level keys that are tables: set in a file only, never by a variable
FILE_ONLY = frozenset({"budgets"})


class _Schema(BaseModel):
    # The docstring under each key is its description: the configuration reference is made from it
    # (``key_descriptions``). Not pydantic's ``use_attribute_docstrings``: that reads and parses this
    # file's source at every import, ~30 ms of every daemon's start, for text only the docs show.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # "8" is no number, 1 no boolean


class PermissionRule(_Schema):
    """``{ kind = "execute", title = "rm *", action = "deny" }``; the first that matches answers."""

    action: Literal["allow", "deny", "ask"]
    """what a matching permission request gets: allow | deny | ask"""
    kind: str = "*"
    """a tool kind (read, edit, execute...), "*" for any"""
    title: str = "*"
    """a glob over the tool call's title; "*" for any"""


# docs/budgets.md: an amount of US dollars (finite, 0 or more) and a count of tokens; 0 is no cap
Dollars = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class BudgetKeys(_Schema):
    """The ``[budgets]`` table: caps on what agents report they spent (docs/budgets.md); 0: no cap."""

    session_max_cost_usd: Dollars = 0.0
    """the most one session may cost over all its turns, in USD as its agent reports it (0: no cap)"""
    session_max_tokens: Count = 0
    """the most tokens one session may use over all its turns (0: no cap)"""
    project_max_cost_usd_per_day: Dollars = 0.0
    """the most a project's turns may cost in one UTC day, in USD (0: no cap)"""
    project_max_tokens_per_day: Count = 0
    """the most tokens a project's turns may use in one UTC day (0: no cap)"""
    turn_hold_usd: Dollars = 0.0
    """what a turn with no max_cost_usd holds against the cost caps while it runs, in USD: an
    estimate of one turn's cost (0: it holds nothing)"""


class ProfileBudgetKeys(_Schema):
    """An ``[agents.<name>.budgets]`` table: the profile's own caps, each unset key as ``[budgets]`` says."""

    session_max_cost_usd: Dollars | None = None
    """as [budgets] session_max_cost_usd, for this profile's turns (unset: the [budgets] value)"""
    session_max_tokens: Count | None = None
    """as [budgets] session_max_tokens, for this profile's turns (unset: the [budgets] value)"""
    project_max_cost_usd_per_day: Dollars | None = None
    """as [budgets] project_max_cost_usd_per_day, for this profile's turns (unset: the [budgets] value)"""
    project_max_tokens_per_day: Count | None = None
    """as [budgets] project_max_tokens_per_day, for this profile's turns (unset: the [budgets] value)"""
    turn_hold_usd: Dollars | None = None
    """as [budgets] turn_hold_usd, for this profile's turns (unset: the [budgets] value)"""


# what a snapshot leaves out unless a profile says otherwise (docs/checkpoints.md): folders a tool
# makes again from the project's own files, often tens of thousands of files each
DEFAULT_CHECKPOINT_EXCLUDE = ("node_modules/", ".venv/", "__pycache__/")


class ProfileKeys(_Schema):
    """The keys of an ``[agents.<name>]`` table."""

    command: Annotated[str, Field(min_length=1)]
    """argv[0]: a name on PATH, or a path relative to the config file"""
    args: Array[str] = ()
    """arguments passed to command"""
    env: Mapping[str, str] = Field(default_factory=dict)
    """added to the agent's environment (after what its kind sets)"""
    resume: Annotated[ResumeRoute, Strict(False)] = ResumeRoute.AUTO
    """auto | resume | load | meta | none"""
    warm_pool: Count = 0
    """initialised agents (with a session opened ahead) kept waiting for the next new session"""
    inherit_env: Array[str] = ()
    """names of the daemon's environment variables passed through to the agent"""
    # model_provider field -> environment variable, e.g. {"api_key": "ANTHROPIC_API_KEY"}
    provider_env: Mapping[Literal["base_url", "api_key", "model"], str] = Field(default_factory=dict)
    """model_provider field -> variable, e.g. { api_key = "MY_KEY" } (generic agents)"""
    permission_rules: Array[PermissionRule] = ()
    """for the agent's permission requests, the first that matches answers; see Permissions"""
    # what clients may set (docs/design/trust.md#trust-boundaries): extra_meta keys, MCP servers, the model's base URL
    allow_meta_keys: Array[str] = ("traceparent", "tracestate", "baggage")
    """extra_meta key paths clients may set (by default the W3C trace context, which ACP reserves)"""
    allow_mcp: Array[Literal["stdio", "http", "sse"]] = ()
    """MCP server kinds clients may pass: stdio | http | sse"""
    allow_mcp_commands: Array[str] = ()
    """the stdio MCP commands clients may pass (exact paths)"""
    allow_client_base_url: bool = False
    """may a request's model_provider.base_url choose where prompts go?"""
    kind: KindName = "generic"
    """what rcoder knows about the agent (its home, config files, quirks): claude | claude-legacy |
    codex | gemini | opencode | generic (knows nothing, changes nothing)"""
    model_base_url: str = ""
    """the model provider's default base URL; a request's non-empty model_provider.base_url wins"""
    model_api_key: str = Field(default="", repr=False)
    """the model provider's default API key; a request's non-empty model_provider.api_key wins"""
    model: str = ""
    """the model provider's default model; a request's non-empty model_provider.model wins"""
    # How the agent is confined (docs/design/trust.md#confinement). "auto" means Landlock where the kernel has
    # it and none otherwise (which is logged); "landlock" refuses to run on a kernel without it; "none" lets
    # the agent reach everything the daemon's user may reach.
    sandbox: Literal["auto", "landlock", "none"] = "auto"
    """auto (landlock where the kernel has it) | landlock | none; see What an agent can reach"""
    # Where its agents run (docs/relay.md#placement): "local", the daemon's own child; "relay", a child of
    # `rcoder relay`, a process per project on this host that the daemon starts and that outlives it;
    # "container", a child of a relay in a container per project and profile (docs/relay.md#containers).
    placement: Literal["local", "relay", "container"] = "local"
    """local (a child of the daemon) | relay (a child of a relay per project on this host, started by
    the daemon and outliving it) | container (a child of a relay in a container of the project's, from
    containers.image; command is then the program's absolute path in the image); see Relay"""
    read_paths: Array[ConfigPath] = ()
    """more folders (or files) the agent may read and execute: toolchains, SDKs"""
    write_paths: Array[ConfigPath] = ()
    """more folders the agent may read and write (made when missing)"""
    # docs/confinement.md#security: from Landlock ABI 4 a confined agent's TCP connects and binds are
    # limited to these ports on every address, so never the store's or the daemon's
    connect_ports: Array[Annotated[int, Field(ge=1, le=65535)]] = (443,)
    """TCP ports the agent may connect to, on any address (Landlock ABI 4+); the port of model_base_url
    is added. Default: 443 (HTTPS). See What an agent can reach"""
    bind_ports: Array[Annotated[int, Field(ge=0, le=65535)]] = ()
    """TCP ports the agent may bind (Landlock ABI 4+; 0: any port the kernel picks); default none"""
    # Each agent process runs in a cgroup of its own (docs/limits.md). Where the kernel gives the daemon
    # no cgroups, "auto" runs agents unlimited (and logs it) and "required" refuses to start.
    limits: Literal["auto", "required"] = "auto"
    """auto (cgroup limits where the kernel gives them, else none, logged) | required; see Limits"""
    memory_max: MemorySize = 4 << 30
    """the most memory an agent and all it starts may use: bytes, or "2GiB", "512MiB"; past it the
    kernel kills it and the turn ends with an error saying so"""
    pids_max: Annotated[int, Field(ge=1)] = 1024
    """the most processes and threads an agent and all it starts may have at once"""
    cpu_max: Annotated[float, Field(ge=0)] = 0.0
    """the CPU cores an agent and all it starts may use together, e.g. 1.5 (0: no bound)"""
    # docs/limits.md#disk: checked after each turn and every disk_check_interval while one runs
    workspace_max_bytes: ByteSize = 0
    """the most a project's folder may hold (bytes, or "10GiB"); past it the running turn is stopped
    and the next refused (RESOURCE_EXHAUSTED); 0: no bound. See Disk"""
    budgets: ProfileBudgetKeys = Field(default_factory=ProfileBudgetKeys)
    """this profile's own budget caps, a table with the keys of [budgets]; a key it leaves unset is
    the [budgets] one. See Budgets"""
    # docs/checkpoints.md: left out of every snapshot besides what the project's .gitignore files leave out
    checkpoint_exclude: Array[str] = DEFAULT_CHECKPOINT_EXCLUDE
    """gitignore patterns a turn's snapshots leave out, besides the project's .gitignore files
    (default: node_modules/, .venv/, __pycache__/); see Checkpoints"""


class AgentProfile(ProfileKeys):
    """How to run one kind of agent: its ``[agents.<name>]`` table, named."""

    name: str
    base_dir: Path = Field(default_factory=Path.cwd)  # the config file's folder: relative commands start there

    def resolve_command(self, search_path: str) -> str | None:
        """The executable to run: a path (relative to the config file) or a name on PATH."""
        if os.sep in self.command:
            path = self.base_dir / self.command  # an absolute command stays as it is
            return str(path) if os.access(path, os.X_OK) and path.is_file() else None
        return shutil.which(self.command, path=search_path)

    @property
    def key_variable(self) -> str:
        """The environment variable its agent reads its model key from; "" when rcoder knows none."""
        return self.provider_env.get("api_key") or KIND_KEY_VARIABLES.get(self.kind, "")


class ClientKeys(_Schema):
    """A ``[[clients]]`` entry: a scoped caller (docs/access.md#tenants)."""

    name: ClientName
    """who the caller is in logs, metrics and the audit trail"""
    token_sha256: TokenDigest = ""
    """the hex SHA-256 of its bearer token (the token itself is never in the config)"""
    token_file: ConfigPath | None = None
    """or a file holding the token, read at start (kept out of every agent's reach)"""
    projects: Annotated[tuple[ProjectPattern, ...], Strict(False), Field(min_length=1)]
    """fnmatch patterns over project_id (*, ?, [seq], [!seq]): the projects it sees and drives"""
    role: Literal["reader", "operator", "admin"]
    """reader: reads; operator: reads, turns, cancels, permissions, forks, closes, deletes; admin: all, everywhere"""
    agents: Annotated[tuple[str, ...], Strict(False)] | None = None
    """the profiles it may name (unset: every profile that is confined; a sandbox = "none" one only when listed)"""


class SettingsKeys(_Schema):
    """The settings: in a file at the top level or in their table (rcoder.config_groups), as
    ``RCODER_<KEY>`` variables, some as flags."""

    listen: HostPort = "127.0.0.1:50051"
    """the host:port the gRPC server listens on"""
    data_dir: ConfigPath = DEFAULT_DATA_DIR
    """SQLite store (WAL, mode 0600), kept across restarts"""
    store_url: StoreUrl = ""
    """"": the SQLite store in data_dir; "postgresql://user:pw@host/db": PostgreSQL"""
    # Several hosts on one PostgreSQL store (docs/design/hosts.md#the-host-registry): this daemon's name, the
    # host:port the other hosts dial to reach it, and how long a session's lease lasts.
    host_id: HostId = ""
    """this daemon's name among several hosts ("": <hostname>:<port>); see Several hosts"""
    advertise_address: Advertise = ""
    """host:port other hosts reach this one at ("": the listen address as bound)"""
    lease_ttl: Annotated[float, Field(gt=0)] = 15.0
    """seconds a session's lease lasts unrenewed (renewed every third of it)"""
    # without TLS, the hosts (IP networks, host name patterns) another host's address may name for
    # a forwarded call, which carries the caller's request in plaintext (rcoder.api.forwarding)
    peer_hosts: Array[PeerHost] = ("127.0.0.0/8", "::1", "localhost")
    """without TLS, the only hosts a call is forwarded to (see Several hosts)"""
    workspace_root: ConfigPath = Path("workspace")
    """a project's cwd is <workspace_root>/<project_id>, created on first use"""
    # docs/checkpoints.md: a snapshot of the project's files before and after every turn
    checkpoints: bool = True
    """snapshot a project's files before and after every turn (changes, GetRunChanges, RewindSession)"""
    checkpoint_root: str = ""
    """where each project's checkpoint store (a bare git repository) lives ("": <data_dir>/checkpoints);
    on several hosts sharing a workspace, shared storage beside it. See Checkpoints"""
    # 1 MiB: with the changes listed beside it, well within the 4 MiB a gRPC client receives by default
    max_diff_bytes: Annotated[int, Field(ge=1024)] = 1 << 20
    """the most bytes of diff GetRunChanges answers (1 MiB); past it the diff is cut, visibly"""
    # docs/checkpoints.md#bounds: what a snapshot and a project's store may hold, in apparent sizes
    checkpoint_max_file_bytes: ByteSize = 100 << 20
    """a file longer than this (its length: a sparse file counts whole) is listed by its size and
    times, not stored (100 MiB). See Checkpoints"""
    checkpoint_max_snapshot_bytes: ByteSize = 2 << 30
    """the most bytes of files one snapshot stores (2 GiB); the files past it, in path order, are
    listed, not stored"""
    checkpoint_store_max_bytes: ByteSize = 10 << 30
    """the most a project's checkpoint store may hold on disk (10 GiB); a turn that finds it full
    takes no snapshot and says so in completed.checkpoint_error"""
    # docs/checkpoints.md#lifetime: what a project's store keeps, and how long its gc may take
    checkpoint_retention: Annotated[float, Field(ge=0)] = 30.0
    """days a snapshot is kept (30); an older one goes unless a run started within them names it
    (0: kept whatever its age)"""
    checkpoint_keep: Count = 500
    """the most distinct snapshots a project's store keeps (500); past it the oldest go, but one a
    run started since the kept ones were taken names (0: no bound)"""
    checkpoint_gc_timeout: Annotated[float, Field(gt=0)] = 120.0
    """seconds one gc pass of a project's store may take (120); cut there, the next pass goes on
    from where it stopped"""
    checkpoint_snapshot_timeout: Annotated[float, Field(gt=0)] = 10.0
    """seconds a turn's end waits for its after snapshot; past it the snapshot is cut and
    completed.checkpoint_error says so"""
    default_agent: str = "claude"
    """the profile a request that names no agent runs"""
    auth_token: str = ""
    """every RPC but health (and /metrics) needs it; "": one made at first start into
    <data_dir>/auth_token (0600) and kept"""
    # Set to true, this lets anyone who reaches the port, agents included, drive the daemon without a token
    # when auth_token is empty and read /metrics, and it skips the check that the store asks a password
    # (docs/design/trust.md#no-calls-back).
    open_to_agents: bool = False
    """true: no token asked when auth_token is "", no store password check (see Access)"""
    # Reflection must read a request to answer it, and grpc reads a message whole (up to
    # max_request_bytes) before its size is seen: served to strangers, it is what one can make the
    # daemon hold (rcoder.api.reflection, docs/access.md). Unset, it is served to strangers only on a
    # loopback listen address, where the stranger is a local user and grpcurl's first call needs no -H.
    open_reflection: bool | Literal["loopback"] = "loopback"
    """reflection without the token: "loopback", only when listen is a loopback address; false: it
    needs the token as every RPC but health (a stranger then costs no read; grpcurl without -H cannot
    list or resolve); true: always (see Access)"""
    # scoped callers besides the admin token (rcoder.api.callers): JWTs from the platform's identity provider
    jwt_jwks_file: OptionalConfigPath = ""
    """a JWKS file (relative: beside the config file): bearer JWTs signed by its keys are scoped callers
    ("": none); re-read when it changes, and every JWT refused while it is empty, unreadable or missing"""
    jwt_issuer: str = ""
    """the iss a JWT must carry (required with jwks_file)"""
    jwt_audience: str = ""
    """the aud a JWT must carry (required with jwks_file)"""
    # who agents run as where the daemon can switch uid (rcoder.agent.confinement.agent_user): a user name, or
    # "UID:GID"; "" runs them as the daemon's user
    agent_user: AgentUserName = "rcoder-agent"
    """who agents run as where the daemon can switch uid: a user, "UID:GID", or "" (the daemon's
    user); see What an agent can reach"""
    tls_cert: str = ""
    """PEM certificate file; TLS when both cert and key are set"""
    tls_key: str = ""
    """PEM private key file; TLS when both cert and key are set"""
    max_live_agents: Annotated[int, Field(ge=1)] = 32
    """live agent processes; idle ones are closed least-recently-used first"""
    idle_timeout: Seconds = 600.0
    """seconds an idle live agent is kept"""
    shutdown_grace: Seconds = 30.0
    """seconds running turns get to end on SIGTERM before their agents are ended (relayed: left running)"""
    initialize_timeout: Seconds = 30.0
    """seconds for the agent to answer initialize"""
    session_open_timeout: Seconds = 60.0
    """... and session/new, load or resume"""
    agent_start_concurrency: Count = 4
    """agents spawning + initialising at once (a burst waits its turn)"""
    agent_stop_grace: Seconds = 3.0
    """each step of ending an agent: close stdin, SIGTERM group, SIGKILL group"""
    stderr_tail_bytes: Count = 8192
    """agent stderr kept for error messages"""
    # DeleteSession: how long an agent's own delete command (OpenCode's `session delete`) may run
    agent_erase_timeout: Seconds = 30.0
    """seconds DeleteSession gives an agent's own delete command (OpenCode's); see A session's runs, and erasing one"""
    agent_line_limit: Count = 64 * 1024 * 1024
    """longest stdout line accepted from an agent"""
    run_buffer_events: Count = 10000
    """events kept per run for Subscribe"""
    run_buffer_bytes: Count = 8 << 20
    """bytes of events kept per run (8 MiB; 4x while a client lags behind)"""
    run_event_bytes: Count = 1 << 20
    """the largest event (1 MiB): longer strings are cut, with a marker"""
    runs_total_bytes: Count = 256 << 20
    """bytes all runs hold together (256 MiB): finished runs evicted past it"""
    run_max_followers: Count = 64
    """Chat and Subscribe streams on one run at once"""
    # turns waiting behind a session's running turn (ChatRequest.busy QUEUE or INTERRUPT), at most:
    # each holds its whole request until it runs; 0 refuses both policies
    max_queued_turns: Count = 4
    """turns waiting per session (ChatRequest.busy QUEUE/INTERRUPT); 0: none"""
    max_concurrent_rpcs: Count = 1024
    """AgentRunner calls in progress at once (health checks not counted)"""
    # the largest request grpc reads: what a ChatRequest may carry (prompt 1 MiB, system prompt 256 KiB,
    # attachments 16 MiB, extra_meta 64 KiB) and its ids, MCP servers and framing
    max_request_bytes: Annotated[int, Field(ge=4096)] = 19 << 20
    """the largest request read (19 MiB: prompt, system prompt, attachments, extra_meta, framing)"""
    # bytes all requests in flight hold together: a call reserves max_request_bytes while its request
    # is read, then its size until it ends; past it calls wait, then RESOURCE_EXHAUSTED
    max_request_bytes_in_flight: Count = 256 << 20
    """bytes all requests in flight hold together (256 MiB); see Access"""
    # docs/files.md: ReadFile refuses a larger file, WriteFile one whose stream passes it (nothing left behind)
    max_file_bytes: ByteSize = 256 << 20
    """the largest file ReadFile sends and WriteFile writes (bytes, or "1GiB"; 256 MiB)"""
    run_retention: Seconds = 600.0
    """seconds a finished run stays in memory (Subscribe then reads it from the store)"""
    # How long a run's stored events are kept, and how many bytes of them one run may store
    # (docs/design/history.md#deleting-and-retention). Past that bound the run stores a note saying so,
    # then nothing more but its completed event.
    history_retention: Annotated[float, Field(ge=0)] = 0.0
    """days a run's stored events are kept (0: forever); see History"""
    history_max_bytes_per_run: Count = 8 << 20
    """stored bytes of one run's events (8 MiB; past it a note, then only completed)"""
    # the `container` placement (docs/relay.md#containers): the engine a project's relay container is
    # asked of, the image it runs, the engine network it joins
    container_engine_socket: str = ""
    """the Docker Engine API's unix socket (Docker's, or podman's `podman system service`); "": the
    first of /run/podman/podman.sock and /var/run/docker.sock that is there; see Relay"""
    container_image: str = ""
    """the image a relay's container runs (rcoder's own, which `make image` builds); "":
    localhost/rcoder:<this version>"""
    container_network: str = "none"
    """the engine network a relay's container joins: "none" (loopback only) or a network's name
    (never "host"); with [relays] listen_host, its relay serves TCP with TLS at its address there"""
    # where other machines reach a container's relay (docs/relay.md#published-on-the-host): a port of
    # this host's the engine forwards to it, since its address on the engine's network is this machine's
    # alone
    container_publish_host: str = ""
    """the address other machines reach this host at (e.g. "10.0.0.5"): each relay's container
    serving TCP has its relay's port published on this host, on a port the engine picks, and a turn
    there is reached at this address and that port; "": at the container's address on its network,
    which only this machine reaches. Needs [relays] listen_host and a network; see Relay"""
    container_project_volumes: bool = False
    """each project's files on a named volume of the project, mounted in its containers at the
    project's path, never on this host's disk (every profile then placement = "container", the
    built-in ones left out); false: the project's folder is bound in; see Relay"""
    # a `relay` placement's relays over TCP with TLS (docs/relay.md#re-attach): the host other hosts
    # reach them at, and the key their secrets are derived from (the same on every host of a store)
    relays_listen_host: str = ""
    """the address each relay also serves TCP with TLS on, which other hosts reach (e.g. "10.0.0.5");
    "": its unix socket only. A relay's container on a network serves TCP at its own address (or at a
    port of this host: [containers] publish_host). Needs key_file; see Relay"""
    relays_key_file: OptionalConfigPath = ""
    """a file of at least 32 random bytes, the same on every host of a store (mode 0600, owned by the
    daemon's user): each relay's secret is derived from it; needed to take over another host's turn
    over TCP"""
    # how long a `relay` placement's relay lives on with no agent (docs/relay.md#placement): its
    # memory against the cold start of the next one
    relays_idle_exit: Seconds = 300.0
    """seconds a relay the daemon started lives on with no agent (running or attached) and no call,
    then stops itself; the project's next agent or file call starts a new one. 0: never"""
    # how long an agent of such a relay lives with no daemon attached to it (docs/relay.md#placement):
    # past a restart or another host's takeover, so only the agents of a host that never came back
    relays_unattached_end: Seconds = 600.0
    """seconds an agent of a relay the daemon started lives with no daemon attached to it, then its
    relay ends it (and idle_exit follows); 0: never, else at least twice [hosts] lease_ttl"""
    metrics_listen: str = ""
    """host:port for Prometheus /metrics (e.g. "127.0.0.1:9464"); empty: off"""
    # OTLP/gRPC collector for traces (rcoder.tracing), e.g. "http://127.0.0.1:4317"; empty: none exported
    otlp_endpoint: OtlpEndpoint = ""
    """OTLP/gRPC collector for traces (e.g. "http://127.0.0.1:4317"); empty: none (see Traces)"""
    log_level: str = "info"
    """the least level logged: debug | info | warning | error"""
    log_format: Literal["auto", "json", "console"] = "auto"
    """auto (JSON unless on a terminal) | json | console"""
    reseed_on_fallback: bool = True
    """when an agent lost a known session, prefix its first prompt with a summary of rcoder's transcript"""
    reseed_max_bytes: Count = 16384
    """bound on that summary"""
    cancel_grace: Seconds = 10.0
    """seconds a cancelled turn gets before its agent is ended by group"""
    permission_timeout: Seconds = 300.0
    """seconds an ASK permission request waits before it is rejected"""
    turn_timeout: Seconds = 3600.0
    """seconds a turn may run before it ends with AGENT_TIMEOUT (permission waits included)"""
    # docs/limits.md#disk: a check costs about 0.2 s of du on 100,000 files, so one project is
    # checked at most every max(this, 20 x its last check's time) while turns run in it
    disk_check_interval: Annotated[float, Field(gt=0)] = 10.0
    """seconds between checks of a project's size while a turn runs in it (workspace_max_bytes)"""
    heartbeat_interval: Seconds = 15.0
    """a heartbeat event after this many quiet seconds in a turn (0: none)"""
    budgets: BudgetKeys = Field(default_factory=BudgetKeys)
    """caps on what agents report they spent, per session and per project and UTC day (a table, file
    only); see Budgets"""


class Settings(SettingsKeys):
    agents: Mapping[str, AgentProfile] = Field(default_factory=dict)
    clients: tuple[ClientKeys, ...] = ()  # [[clients]]: scoped callers (file only, never a variable)
    daemon_env: Mapping[str, str] = Field(default_factory=dict)  # what agents may inherit (allow-list + inherit_env)
    config_file: Path | None = None  # the file read, kept out of every agent's reach
    defaults_file: Path | None = None  # the defaults file read (RCODER_DEFAULTS), kept out of reach too
    landlock_abi: int = Field(default_factory=landlock.abi)  # the kernel's Landlock ABI version, 0: none
    # the flat names the files used that have a table now ("tls_cert" -> "tls.cert"): said at start
    flat_keys: Mapping[str, str] = Field(default_factory=dict)

    def key_name(self, setting: str) -> str:
        """A setting as an error names it: flat (``tls_key``) where the files wrote its table's
        settings flat, else as its table holds it (``tls.key``)."""
        table = TABLE_OF.get(setting)
        if table is None or any(GROUPS[table][key] in self.flat_keys for key in GROUPS[table]):
            return setting
        return GROUPED_NAME[setting]

    @property
    def reflection_open(self) -> bool:
        """Whether reflection is served without the token: ``open_reflection``, or for "loopback",
        whether ``listen`` is a loopback address (docs/access.md)."""
        if isinstance(self.open_reflection, bool):
            return self.open_reflection
        return is_loopback(self.listen)

    def profile(self, name: str) -> AgentProfile | None:
        return self.agents.get(name)

    def budgets_of(self, profile: AgentProfile) -> BudgetKeys:
        """The caps on the turns of ``profile``: its own ``budgets``, each unset key from ``[budgets]``."""
        own = profile.budgets.model_dump(exclude_none=True)
        return self.budgets.model_copy(update=own) if own else self.budgets

    def agent_env(self, profile: AgentProfile, kind_env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment an agent of ``profile`` starts with (before its model provider):
        inherited variables, then its kind's, then the profile's own ``env``."""
        inherited = {k: self.daemon_env[k] for k in BASE_AGENT_ENV + profile.inherit_env if k in self.daemon_env}
        return {**inherited, **(kind_env or {}), **profile.env}

    def has_key(self, profile: AgentProfile) -> bool:
        """Whether its agent would start with a model key: its ``model_api_key``, or its
        ``key_variable`` in what it inherits or its ``env`` (True when it needs none rcoder knows of).
        A request's own ``model_provider.api_key`` may still give one."""
        variable = profile.key_variable
        return not variable or bool(profile.model_api_key) or bool(self.agent_env(profile).get(variable))


class _File(SettingsKeys):
    agents: dict[str, dict[str, Any]] = Field(default_factory=dict)  # checked as ProfileKeys once merged
    clients: Array[ClientKeys] = ()


_FILE, _KEYS, _PROFILES = TypeAdapter(_File), TypeAdapter(SettingsKeys), TypeAdapter(dict[str, ProfileKeys])
# every key of every table: what an unknown key is compared with for "did you mean"
KNOWN_KEYS = frozenset(
    key for model in (_File, ProfileKeys, BudgetKeys, PermissionRule, ClientKeys) for key in model.model_fields
) | frozenset(GROUPS)


class _Problems:
    """The ConfigErrors of the schema's checks, gathered so that one run names them all."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    def check(self, schema: TypeAdapter[Any], data: object, base_dir: Path, **how: Any) -> Any:
        """``checked``'s answer; None (the error kept) when ``data`` does not pass."""
        try:
            return checked(schema, data, base_dir, known=KNOWN_KEYS, renamed=GROUPED_NAME, **how)
        except ConfigError as exc:
            self.errors.append(exc)
            return None

    def run(self, check: Callable[[Settings], None], settings: Settings) -> None:
        """One check between keys; its error kept."""
        try:
            check(settings)
        except ConfigError as exc:
            self.errors.append(exc)

    def raise_any(self) -> None:
        if self.errors:
            raise ConfigError.joined(self.errors)


def builtin_profiles(data_dir: Path = DEFAULT_DATA_DIR) -> dict[str, AgentProfile]:
    """Profiles available with no config file (``rcoder.builtin_agents``), checked like any other."""
    return {name: AgentProfile(**t, name=name, base_dir=AGENTS_DIR) for name, t in builtin_tables(data_dir).items()}


def load_settings(
    config_file: Path | None,
    environ: Mapping[str, str],
    overrides: Mapping[str, Any] | None = None,
    landlock_abi: int | None = None,
    defaults_file: Path | None = None,
) -> Settings:
    """Build Settings from a defaults file, a TOML file, ``RCODER_<KEY>`` variables and flag
    overrides, each over the one before.

    ``defaults_file``: settings only, no profiles (``RCODER_DEFAULTS``), relative paths against its folder.
    ``landlock_abi``: the kernel's Landlock ABI version (asked of the kernel when None)."""
    cwd = Path.cwd()
    base_dir = config_file.resolve().parent if config_file is not None else cwd
    defaults, flat_defaults = _read_defaults(defaults_file) if defaults_file is not None else ({}, {})
    grouped = ungroup(_read_toml(config_file) if config_file is not None else {})
    raw = grouped.values
    env = {
        key: environ[var]
        for key in SettingsKeys.model_fields
        if key not in FILE_ONLY and (var := f"RCODER_{key.upper()}") in environ
    }
    flags = {key: value for key, value in (overrides or {}).items() if value is not None}
    # Every layer is checked before any error is raised, so that one run names every problem.
    problems = _Problems()
    if grouped.problems:
        problems.errors.append(ConfigError(*grouped.problems[0], more=tuple(grouped.problems[1:])))
    file = problems.check(_FILE, raw, base_dir, key=grouped.name)
    # variables and flags are strings: read leniently ("8" a number, "yes" true), still checked
    from_env = problems.check(_KEYS, env, cwd, strict=False, key=lambda key: f"RCODER_{key.upper()}")
    from_flags = problems.check(_KEYS, flags, cwd, strict=False)
    values = {**defaults}
    for layer in (file, from_env, from_flags):
        if layer is not None:
            values |= layer.model_dump(exclude_unset=True, exclude={"agents", "clients"})
    # the profiles are checked even when the file's other keys are not (its tables as written)
    written = file.agents if file is not None else raw.get("agents", {})
    written = {n: t for n, t in written.items() if isinstance(t, dict)} if isinstance(written, dict) else {}
    builtin = builtin_tables(values.get("data_dir", DEFAULT_DATA_DIR))
    # a table named like a built-in profile changes only the keys it sets
    tables = builtin | {name: builtin.get(name, {}) | table for name, table in written.items()}
    profiles = problems.check(_PROFILES, tables, base_dir, key=lambda key: f"agents.{key}")
    problems.raise_any()
    assert file is not None and profiles is not None
    agents = {
        name: AgentProfile(**dict(keys), name=name, base_dir=base_dir if name in file.agents else AGENTS_DIR)
        for name, keys in profiles.items()
    }
    if values.get("container_project_volumes"):
        # the projects' files are on volumes only their containers mount: the built-in profiles,
        # which run on this host, are left out (docs/relay.md#a-named-volume-per-project)
        agents = {name: profile for name, profile in agents.items() if name in file.agents}
    visible = {*BASE_AGENT_ENV, *(name for profile in agents.values() for name in profile.inherit_env)}
    settings = Settings(
        **values,
        agents=agents,
        clients=file.clients,
        daemon_env={k: environ[k] for k in visible if k in environ},
        config_file=config_file.resolve() if config_file is not None else None,
        defaults_file=defaults_file.resolve() if defaults_file is not None else None,
        landlock_abi=landlock.abi() if landlock_abi is None else landlock_abi,
        flat_keys=flat_defaults | grouped.flat,
    )
    # the checks between keys, each on its own, every one run: all their problems in one error
    checks = [_check_default_agent, _check_tls, _check_shared_token, _check_callers, _check_checkpoint_root,
              _check_containers, _check_relays]  # fmt: skip
    for check in checks + [partial(_check_sandbox, name=name) for name in settings.agents]:
        problems.run(check, settings)
    problems.raise_any()
    return settings


def _check_default_agent(settings: Settings) -> None:
    if settings.default_agent not in settings.agents:
        known = ", ".join(sorted(settings.agents))
        raise ConfigError("default_agent", f"no profile named {settings.default_agent!r} (profiles: {known})")


def _check_tls(settings: Settings) -> None:
    if bool(settings.tls_cert) != bool(settings.tls_key):
        cert, key = settings.key_name("tls_cert"), settings.key_name("tls_key")
        raise ConfigError(key if settings.tls_cert else cert, f"set both {cert} and {key}, or neither")


def _check_containers(settings: Settings) -> None:
    """docs/relay.md#containers: a relay's container never shares the host's network (its loopback
    holds the daemon's port), and an engine network's name is one the engine can have."""
    network = settings.container_network
    if network == "host" or not re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}", network):
        key = settings.key_name("container_network")
        raise ConfigError(key, f"{network!r}: \"none\" or an engine network's name; never \"host\", which would give "
                          "agents the host's loopback")  # fmt: skip
    socket = settings.container_engine_socket
    if socket and not socket.startswith("/"):
        raise ConfigError(settings.key_name("container_engine_socket"), f"{socket!r}: the socket's absolute path")
    publish = settings.container_publish_host
    if publish:
        key = settings.key_name("container_publish_host")
        if not _ip_or_host_name(publish):
            raise ConfigError(key, f"{publish!r}: an IP address or a host name other machines reach this host at, "
                              "with no port (the engine picks the port)")  # fmt: skip
        if not settings.relays_listen_host:
            listen = settings.key_name("relays_listen_host")
            raise ConfigError(key, f"{key} = {publish!r} publishes a container's relay that serves TCP, which it does "
                              f"only with {listen} (and {settings.key_name('relays_key_file')}) set: set them, or "
                              f"leave {key} unset")  # fmt: skip
        if network == "none":
            raise ConfigError(key, f"{key} = {publish!r} needs {settings.key_name('container_network')}: with \"none\" "
                              "a container has no port to publish; name an engine network (podman's \"podman\", "
                              "Docker's \"bridge\"), or leave it unset")  # fmt: skip
    if settings.container_project_volumes:
        # a profile run on this host would find an empty project folder: the files are on the volume
        key = settings.key_name("container_project_volumes")
        problems = tuple(
            (f"agents.{name}.placement", f"{profile.placement!r}: with {key} = true each project's files are on a "
             "volume only its containers mount; set placement = \"container\" (or take the profile out)")
            for name, profile in sorted(settings.agents.items()) if profile.placement != "container"
        )  # fmt: skip
        if problems:
            raise ConfigError(*problems[0], more=problems[1:])


MIN_RELAY_KEY_BYTES = 32
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")  # a DNS name, as a certificate's SAN holds it


def _ip_or_host_name(host: str) -> bool:
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return True
    return _HOST_NAME.fullmatch(host) is not None


def _check_relays(settings: Settings) -> None:
    """docs/relay.md#security: a relay serves TCP only with a secret derived from a key no one else
    can read, so ``listen_host`` needs ``key_file``, and the key file is long, private and ours."""
    unattached, ttl = settings.relays_unattached_end, settings.lease_ttl
    if 0 < unattached < 2 * ttl:
        # a lost host's running turn is taken over once its lease ran out and another host's next
        # look came (every half lease_ttl): its agent, unattached meanwhile, must still be there
        name = settings.key_name("relays_unattached_end")
        raise ConfigError(name, f"{unattached:g}: 0 (never) or at least twice {settings.key_name('lease_ttl')} "
                          f"({2 * ttl:g} s), so that another host can take a lost host's turn over before its "
                          "agent is ended")  # fmt: skip
    listen, key_file = settings.key_name("relays_listen_host"), settings.key_name("relays_key_file")
    host = settings.relays_listen_host
    if host and not _ip_or_host_name(host):
        raise ConfigError(listen, f"{host!r}: an IP address or a host name, with no port (the relay picks its port)")
    if host and not settings.relays_key_file:
        raise ConfigError(key_file, f"{listen} = {host!r} needs {key_file}: a file of at least {MIN_RELAY_KEY_BYTES} "
                          "random bytes, the same on every host (head -c 32 /dev/urandom > relay.key; chmod 600 "
                          f"relay.key), or leave {listen} unset to serve relays on their unix socket only")  # fmt: skip
    if not settings.relays_key_file:
        return
    path = Path(settings.relays_key_file)
    try:
        info = path.stat()
        size = info.st_size
    except OSError as exc:
        raise ConfigError(key_file, f"{path}: {exc.strerror or exc}: make it with head -c 32 /dev/urandom > {path}; "
                          f"chmod 600 {path}") from exc  # fmt: skip
    if not path.is_file():
        raise ConfigError(key_file, f"{path} is not a file")
    if size < MIN_RELAY_KEY_BYTES:
        raise ConfigError(key_file, f"{path} holds {size} bytes: a key of at least {MIN_RELAY_KEY_BYTES} random bytes "
                          f"(head -c 32 /dev/urandom > {path})")  # fmt: skip
    if info.st_mode & 0o077:
        raise ConfigError(key_file, f"{path} has mode {info.st_mode & 0o777:04o}: others than its owner may read it, "
                          f"and every relay's secret is derived from it: chmod 600 {path}")  # fmt: skip
    if info.st_uid != os.geteuid():
        raise ConfigError(key_file, f"{path} belongs to uid {info.st_uid}, not to the daemon's {os.geteuid()}: "
                          f"chown it to the daemon's user")  # fmt: skip


def _check_shared_token(settings: Settings) -> None:
    if settings.store_url and not settings.auth_token and not settings.open_to_agents:
        raise ConfigError(
            "auth_token",
            "a PostgreSQL store_url means hosts that forward to each other, so they need one shared token: "
            "set the same auth_token (or RCODER_AUTH_TOKEN) on every host, or open_to_agents = true",
        )


def _check_sandbox(settings: Settings, name: str) -> None:
    """A profile that asks for Landlock by name gets it whole, or the daemon does not start."""
    profile = settings.agents[name]
    if profile.sandbox == "landlock" and not settings.landlock_abi:
        why = landlock.why_not() or "this kernel offers no Landlock (Linux 5.13+ with landlock among its LSMs)"
        raise ConfigError(
            f"agents.{name}.sandbox",
            f'asks for "landlock" but {why}; set sandbox = "none" to run this agent unconfined',
        )
    if profile.sandbox == "landlock" and settings.landlock_abi < landlock.TRUNCATE_ABI:
        # A profile that asks for Landlock by name is promised that other projects' files stay whole,
        # which an ABI without truncation rights cannot keep.
        raise ConfigError(
            f"agents.{name}.sandbox",
            f'asks for "landlock" but this kernel\'s Landlock (ABI {settings.landlock_abi}) cannot keep an '
            f"agent from truncating other projects' files, the store or the config (ABI "
            f'{landlock.TRUNCATE_ABI}+, Linux 6.2+); set sandbox = "auto" to run confined with that said '
            'in a warning, or "none"',
        )


def checkpoint_root(settings: SettingsKeys) -> Path:
    """Where the projects' checkpoint stores live (docs/checkpoints.md)."""
    return (
        Path(settings.checkpoint_root).expanduser() if settings.checkpoint_root else settings.data_dir / "checkpoints"
    )


def _check_checkpoint_root(settings: Settings) -> None:
    """The checkpoint stores must be out of every agent's reach: never in a project's folder
    (sandbox.protected hides them from agents wherever they are)."""
    root = checkpoint_root(settings).resolve()
    workspace, data_dir = settings.workspace_root.resolve(), settings.data_dir.resolve()
    in_data_dir = root == data_dir or data_dir in root.parents  # hidden with data_dir
    if not in_data_dir and (root == workspace or workspace in root.parents):
        raise ConfigError(
            settings.key_name("checkpoint_root"),
            f"{root} is inside workspace_root ({workspace}), where it would be a project's folder; put it beside it",
        )


def _check_callers(settings: Settings) -> None:
    """What the schema alone cannot say of ``[[clients]]`` and the JWT keys (docs/access.md#tenants)."""
    seen: dict[str, int] = {}
    digests: dict[str, int] = {}
    for index, client in enumerate(settings.clients):
        entry = f"clients[{index}] ({client.name})"
        if client.name in seen:
            raise ConfigError(f"{entry}.name", f"clients[{seen[client.name]}] has this name already: names are unique")
        seen[client.name] = index
        if bool(client.token_sha256) == (client.token_file is not None):
            raise ConfigError(entry, "set exactly one of token_sha256 or token_file")
        if client.token_sha256 in digests:
            raise ConfigError(
                f"{entry}.token_sha256",
                f"clients[{digests[client.token_sha256]}] has this token: one token, one client",
            )
        if client.token_sha256:
            digests[client.token_sha256] = index
        unknown = [name for name in client.agents or () if name not in settings.agents]
        if unknown:
            raise ConfigError(
                f"{entry}.agents", f"no profile named {unknown[0]!r}: profiles are {', '.join(sorted(settings.agents))}"
            )
    jwks_file, issuer, audience = (settings.key_name(key) for key in ("jwt_jwks_file", "jwt_issuer", "jwt_audience"))
    jwt = {jwks_file: settings.jwt_jwks_file, issuer: settings.jwt_issuer, audience: settings.jwt_audience}
    if any(jwt.values()) and not all(jwt.values()):
        missing = ", ".join(key for key, value in jwt.items() if not value)
        raise ConfigError(
            missing.split(", ")[0], f"JWT callers need {jwks_file}, {issuer} and {audience} ({missing} unset)"
        )
    if (settings.clients or settings.jwt_jwks_file) and settings.open_to_agents and not settings.auth_token:
        raise ConfigError(
            "clients" if settings.clients else jwks_file,
            "scoped callers need a token to be asked: open_to_agents = true with no auth_token lets anyone in "
            "as admin; set auth_token (the admin credential) or open_to_agents = false",
        )


def _read_defaults(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The defaults file's settings, checked, as set (its relative paths against its own folder),
    and the flat names it used that have a table now."""
    table = _read_toml(path, DEFAULTS_VARIABLE)
    if "agents" in table:
        raise ConfigError(
            DEFAULTS_VARIABLE,
            f"{path} holds top-level keys only, in their tables or not: agent profiles go in the config file",
        )
    grouped = ungroup(table)
    where = f" (in {DEFAULTS_VARIABLE} {path})"
    if grouped.problems:
        named = [(f"{key}{where}", problem) for key, problem in grouped.problems]
        raise ConfigError(*named[0], more=tuple(named[1:]))
    keys = checked(
        _KEYS,
        grouped.values,
        path.resolve().parent,
        key=lambda key: f"{grouped.name(key)}{where}",
        known=KNOWN_KEYS,
        renamed=GROUPED_NAME,
    )
    return keys.model_dump(exclude_unset=True), grouped.flat


def _read_toml(path: Path, key: str = "--config") -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        raise ConfigError(key, f"file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(key, f"{path} is not valid TOML: {exc}") from None


def key_descriptions(model: type[BaseModel]) -> dict[str, str]:
    """Each key of ``model`` (its bases' included) and the docstring written under it: the
    configuration reference's descriptions (docs/config-reference.md), read from the source."""
    described: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, _Schema)):
            continue
        body = ast.parse(inspect.getsource(cls)).body[0]
        assert isinstance(body, ast.ClassDef)
        for key, text in zip(body.body, body.body[1:], strict=False):
            if (
                isinstance(key, ast.AnnAssign)
                and isinstance(key.target, ast.Name)
                and isinstance(text, ast.Expr)
                and isinstance(text.value, ast.Constant)
                and isinstance(text.value.value, str)
            ):
                described[key.target.id] = inspect.cleandoc(text.value.value)
    return described
