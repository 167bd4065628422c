"""The config file's tables of settings (``[tls]``, ``[hosts]``, ``[runs]``...): which setting each
key of a table is, and the flat names (``tls_cert``) still read for one release (docs/configuration.md).

The settings model (rcoder.config) keeps one flat attribute per setting, as its ``RCODER_<KEY>``
variable names it; a table is how a file writes them together: ``[tls] cert`` is ``tls_cert``.
``ungroup`` turns a file's tables into those attributes, says which flat names it met, and refuses
a setting written both ways or a key a table does not have.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# table -> its key -> the setting (the attribute of rcoder.config.SettingsKeys). A setting in no
# table stays a top-level key: listen, data_dir, workspace_root, store_url, default_agent,
# auth_token, open_to_agents, shutdown_grace (and the [budgets] table, a model of its own).
GROUPS: Mapping[str, Mapping[str, str]] = {
    "tls": {"cert": "tls_cert", "key": "tls_key"},
    "jwt": {"jwks_file": "jwt_jwks_file", "issuer": "jwt_issuer", "audience": "jwt_audience"},
    "hosts": {
        "id": "host_id",
        "advertise_address": "advertise_address",
        "lease_ttl": "lease_ttl",
        "peers": "peer_hosts",
    },
    "checkpoints": {
        "enabled": "checkpoints",
        "root": "checkpoint_root",
        "max_diff_bytes": "max_diff_bytes",
        "max_file_bytes": "checkpoint_max_file_bytes",
        "max_snapshot_bytes": "checkpoint_max_snapshot_bytes",
        "store_max_bytes": "checkpoint_store_max_bytes",
        "retention": "checkpoint_retention",
        "keep": "checkpoint_keep",
        "gc_timeout": "checkpoint_gc_timeout",
        "snapshot_timeout": "checkpoint_snapshot_timeout",
    },
    "agent_processes": {
        "user": "agent_user",
        "max_live": "max_live_agents",
        "idle_timeout": "idle_timeout",
        "initialize_timeout": "initialize_timeout",
        "session_open_timeout": "session_open_timeout",
        "start_concurrency": "agent_start_concurrency",
        "stop_grace": "agent_stop_grace",
        "stderr_tail_bytes": "stderr_tail_bytes",
        "erase_timeout": "agent_erase_timeout",
        "line_limit": "agent_line_limit",
    },
    "turns": {
        "timeout": "turn_timeout",
        "max_queued": "max_queued_turns",
        "cancel_grace": "cancel_grace",
        "permission_timeout": "permission_timeout",
        "heartbeat_interval": "heartbeat_interval",
        "disk_check_interval": "disk_check_interval",
        "reseed_on_fallback": "reseed_on_fallback",
        "reseed_max_bytes": "reseed_max_bytes",
    },
    "runs": {
        "buffer_events": "run_buffer_events",
        "buffer_bytes": "run_buffer_bytes",
        "event_bytes": "run_event_bytes",
        "total_bytes": "runs_total_bytes",
        "max_followers": "run_max_followers",
        "retention": "run_retention",
    },
    "history": {"retention": "history_retention", "max_bytes_per_run": "history_max_bytes_per_run"},
    "limits": {
        "max_concurrent_rpcs": "max_concurrent_rpcs",
        "max_request_bytes": "max_request_bytes",
        "max_request_bytes_in_flight": "max_request_bytes_in_flight",
        "max_file_bytes": "max_file_bytes",
    },
    "logs": {"level": "log_level", "format": "log_format"},
    "containers": {
        "engine_socket": "container_engine_socket",
        "image": "container_image",
        "network": "container_network",
        "publish_host": "container_publish_host",
        "project_volumes": "container_project_volumes",
    },
    "relays": {
        "listen_host": "relays_listen_host",
        "key_file": "relays_key_file",
        "idle_exit": "relays_idle_exit",
        "unattached_end": "relays_unattached_end",
    },
    "telemetry": {"metrics_listen": "metrics_listen", "otlp_endpoint": "otlp_endpoint"},
}
# each grouped setting's name as a file writes it: "tls_cert" -> "tls.cert"
GROUPED_NAME: Mapping[str, str] = {
    setting: f"{table}.{key}" for table, keys in GROUPS.items() for key, setting in keys.items()
}
# each grouped setting's table: "tls_cert" -> "tls"
TABLE_OF: Mapping[str, str] = {setting: table for table, keys in GROUPS.items() for setting in keys.values()}


@dataclass
class Ungrouped:
    """A file's settings by attribute, and how it wrote them."""

    values: dict[str, Any] = field(default_factory=dict)
    # the flat names it used that have a table now: "tls_cert" -> "tls.cert"
    flat: dict[str, str] = field(default_factory=dict)
    # each setting as the file wrote it, where that is not its attribute: "tls_cert" -> "tls.cert"
    written: dict[str, str] = field(default_factory=dict)
    problems: list[tuple[str, str]] = field(default_factory=list)

    def name(self, path: str) -> str:
        """An error's key path (``tls_cert``, ``peer_hosts[1]``) as the file wrote it (``hosts.peers[1]``)."""
        head, cut, rest = path.partition("[")
        head, dot, tail = head.partition(".")
        return self.written.get(head, head) + dot + tail + cut + rest


def ungroup(table: Mapping[str, Any]) -> Ungrouped:
    """``table`` (a file's TOML, or a defaults file's) with its settings tables made flat attributes;
    the other keys (``agents``, ``clients``, ``budgets``, unknown ones) kept as they are for the
    schema to check. Its problems (an unknown key in a table, a setting written flat and grouped,
    a table written as a value) are kept in ``problems``, so that one run names them all."""
    out = Ungrouped()
    for key, value in table.items():
        if key in GROUPS and isinstance(value, dict):
            continue  # below, once every flat key is known
        if key in GROUPS and key not in GROUPED_NAME:  # [checkpoints] alone is a table and a flat key too
            out.problems.append((key, f"expected a table: [{key}] with {', '.join(GROUPS[key])}"))
            continue
        out.values[key] = value
        if key in GROUPED_NAME:
            out.flat[key] = GROUPED_NAME[key]
    for name, keys in GROUPS.items():
        written = table.get(name)
        if not isinstance(written, dict):
            continue
        for key, value in written.items():
            setting = keys.get(key)
            if setting is None:
                near = difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
                guess = f": did you mean {near[0]!r}?" if near else f" (its keys: {', '.join(keys)})"
                out.problems.append((f"{name}.{key}", f"unknown key{guess} (see docs/configuration.md)"))
            elif setting in out.flat:
                twice = f"set twice, here and as {setting} (its flat name, read until the next release)"
                out.problems.append((f"{name}.{key}", f"{twice}: keep {name}.{key} alone"))
            else:
                out.values[setting] = value
                out.written[setting] = f"{name}.{key}"
    return out
