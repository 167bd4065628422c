"""Prometheus metrics (``metrics_listen``): what operators watch.

One ``Metrics`` object per daemon, with its own registry, passed to the
core through its constructor. Gauges of live and warm agents are read at
scrape time from a callback, so they can never drift from the truth.
``/metrics`` asks the daemon's token (``authorization: Bearer``) when it has one: an agent
can reach the port but never read the token (docs/design/trust.md#no-calls-back).
"""

from __future__ import annotations

import hmac
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from rcoder.domain import Usage

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TURN_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
TOKEN_KINDS = ("input", "output", "cached_read", "cached_write", "thought")

AgentCounts = Callable[[], Mapping[str, tuple[int, int]]]  # profile -> (live, warm)
RunsHeld = Callable[[], tuple[int, int]]  # (bytes, runs) kept for replay
# profile -> (memory now, largest peak, CPU seconds, OOM kills) of its agents' cgroups (docs/limits.md)
AgentResourceTotals = Callable[[], Mapping[str, tuple[int, int, float, int]]]


class _LimitGauges(Collector):
    """What each profile's agents use, read from their cgroups at scrape time; never per session."""

    def __init__(self, totals: AgentResourceTotals) -> None:
        self._totals = totals

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        memory = GaugeMetricFamily("rcoder_agent_memory_bytes", "Memory the live agents of a profile use now, summed",
                                   labels=["agent"])  # fmt: skip
        peak = GaugeMetricFamily("rcoder_agent_memory_peak_bytes", "The largest memory peak among a profile's live "
                                 "agents", labels=["agent"])  # fmt: skip
        cpu = CounterMetricFamily("rcoder_agent_cpu_seconds", "CPU seconds a profile's agents used, ended and live",
                                  labels=["agent"])  # fmt: skip
        kills = CounterMetricFamily("rcoder_agent_oom_kills", "Processes the kernel killed at a profile's memory_max",
                                    labels=["agent"])  # fmt: skip
        for agent, (now, most, seconds, killed) in sorted(self._totals().items()):
            memory.add_metric([agent], now)
            peak.add_metric([agent], most)
            cpu.add_metric([agent], seconds)
            kills.add_metric([agent], killed)
        yield from (memory, peak, cpu, kills)


class _AgentGauges(Collector):
    """Live and warm agents per profile, labelled with where the profile's agents run
    (docs/placement.md#what-a-platform-sees): a profile has one placement."""

    def __init__(self, counts: AgentCounts, placements: Mapping[str, str]) -> None:
        self._counts = counts
        self._placements = placements

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["agent", "placement"]
        live = GaugeMetricFamily("rcoder_live_agents", "Agent processes serving a session", labels=labels)
        warm = GaugeMetricFamily("rcoder_warm_agents", "Initialised agents waiting in the warm pool", labels=labels)
        for agent, (n_live, n_warm) in sorted(self._counts().items()):
            placement = self._placements.get(agent, "local")
            live.add_metric([agent, placement], n_live)
            warm.add_metric([agent, placement], n_warm)
        yield live
        yield warm


class _RunGauges(Collector):
    def __init__(self, held: RunsHeld) -> None:
        self._held = held

    def collect(self) -> Iterator[GaugeMetricFamily]:
        size, count = self._held()
        yield GaugeMetricFamily(
            "rcoder_run_buffer_bytes",
            "Bytes of events runs hold for replay, running and finished (bounded by runs_total_bytes "
            "for finished runs, run_buffer_bytes for each run)",
            value=size,
        )
        yield GaugeMetricFamily("rcoder_runs_kept", "Runs kept in memory, running and finished", value=count)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.runs = Counter(
            "rcoder_runs",
            "Turns that ended, by agent, resume outcome and stop reason",
            ["agent", "outcome", "stop_reason"],
            registry=self.registry,
        )
        self.resumes = Counter(
            "rcoder_session_opens",
            "Sessions opened for a turn, by agent, resume outcome and route",
            ["agent", "outcome", "route"],
            registry=self.registry,
        )
        self.agent_sources = Counter(
            "rcoder_session_agents",
            "Agents that new or resumed sessions got, by where from: started for the request (cold), "
            "the warm pool (warm), or the warm pool with the session already open (primed)",
            ["agent", "source"],
            registry=self.registry,
        )
        self.agent_starts = Histogram(
            "rcoder_agent_start_seconds",
            "Agents started (for a request or the warm pool), by agent and placement: seconds from its "
            "preparation to its initialize answer, a relay's own start included",
            ["agent", "placement"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.spawn_failures = Counter(
            "rcoder_agent_start_failures",
            "Agents that could not be started or initialised, by agent and reason",
            ["agent", "reason"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "rcoder_tokens",
            "Tokens the agents reported their turns used, by agent, project and kind "
            "(input, output, cached_read, cached_write, thought)",
            ["agent", "project", "kind"],
            registry=self.registry,
        )
        self.cost = Counter(
            "rcoder_cost",
            "Cost the agents reported for their turns, by agent, project and currency",
            ["agent", "project", "currency"],
            registry=self.registry,
        )
        self.forks = Counter(
            "rcoder_session_forks",
            "Sessions forked (ForkSession), by agent and method: the agent's session/fork, or re-seeded",
            ["agent", "method"],
            registry=self.registry,
        )
        # several hosts (docs/design/hosts.md#leases): this host's share of the work of keeping ownership straight
        self.lease_renewals = Counter(
            "rcoder_lease_renewals",
            "Lease renewal rounds (one statement each, for every lease this host holds), by result",
            ["result"],
            registry=self.registry,
        )
        self.leases_lost = Counter(
            "rcoder_leases_lost", "Session leases this host found another host had taken", registry=self.registry
        )
        self.takeovers = Counter(
            "rcoder_lease_takeovers",
            "Sessions this host took over from a host whose lease had expired",
            registry=self.registry,
        )
        self.forwards = Counter(
            "rcoder_forwards",
            "Requests forwarded to the host that owns their session or run, by method and result",
            ["method", "result"],
            registry=self.registry,
        )
        self.signals_sent = Counter(
            "rcoder_signals_sent",
            "Cancels and permission answers left in the store for an owner that did not answer, by kind",
            ["kind"],
            registry=self.registry,
        )
        self.signals_applied = Counter(
            "rcoder_signals_applied",
            "Signals from other hosts this host read from the store and applied, by kind and result",
            ["kind", "result"],
            registry=self.registry,
        )
        self.unauthenticated = Counter(
            "rcoder_unauthenticated_calls_refused",
            "Calls refused before their request was read: no token, or a wrong one",
            registry=self.registry,
        )
        # label values are config names, "jwt" for every JWT caller, "admin", "unauthenticated":
        # never a subject or a token (bounded, and nothing secret in a scrape)
        self.requests = Counter(
            "rcoder_requests",
            "AgentRunner calls by caller, method and status code (a forward is counted where it arrived)",
            ["client", "method", "code"],
            registry=self.registry,
        )
        self.time_to_first_event = Histogram(
            "rcoder_time_to_first_event_seconds",
            "From a Chat request to its started event (agent start or reuse included)",
            ["agent"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.turn_duration = Histogram(
            "rcoder_turn_duration_seconds",
            "From started to completed",
            ["agent"],
            buckets=TURN_BUCKETS,
            registry=self.registry,
        )
        self._server: Any = None
        self._started: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._ended: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def turn_started(self, agent: str, outcome: str, route: str, seconds: float) -> None:
        """A turn's ``started`` is out, ``seconds`` after its request (label lookups cached:
        a live turn should not pay for them each time)."""
        key = (agent, outcome, route)
        children = self._started.get(key)
        if children is None:
            children = self._started[key] = (
                self.time_to_first_event.labels(agent),
                self.resumes.labels(agent, outcome, route),
            )
        children[0].observe(seconds)
        children[1].inc()

    def turn_usage(self, agent: str, project: str, usage: Usage) -> None:
        """Tokens and cost the agent reported for a turn (only what it reported)."""
        for kind in TOKEN_KINDS:
            count = getattr(usage, f"{kind}_tokens")
            if count:
                self.tokens.labels(agent, project, kind).inc(count)
        if usage.cost_amount is not None and usage.cost_amount > 0:
            self.cost.labels(agent, project, usage.cost_currency or "unknown").inc(usage.cost_amount)

    def turn_ended(self, agent: str, outcome: str, stop_reason: str, seconds: float) -> None:
        key = (agent, outcome, stop_reason)
        children = self._ended.get(key)
        if children is None:
            children = self._ended[key] = (
                self.runs.labels(agent, outcome, stop_reason),
                self.turn_duration.labels(agent),
            )
        children[0].inc()
        children[1].observe(seconds)

    def spawn_failed(self, agent: str, reason: str) -> None:
        """An agent could not be started or initialised (``rcoder_agent_start_failures``)."""
        self.spawn_failures.labels(agent, reason).inc()

    def agent_started(self, agent: str, placement: str, seconds: float) -> None:
        """An agent started, from its preparation to its ``initialize`` answer, for a request or the
        warm pool (``rcoder_agent_start_seconds``: its ``_count`` counts the starts)."""
        self.agent_starts.labels(agent, placement).observe(seconds)

    def watch_agents(self, counts: AgentCounts, placements: Mapping[str, str]) -> None:
        """Live and warm agents per profile, read at scrape time, with each profile's placement."""
        self.registry.register(_AgentGauges(counts, placements))

    def watch_limits(self, totals: AgentResourceTotals) -> None:
        self.registry.register(_LimitGauges(totals))

    def watch_runs(self, held: RunsHeld) -> None:
        """Bytes and runs kept, read at scrape time (``RunRegistry.held``)."""
        self.registry.register(_RunGauges(held))

    def serve(self, listen: str, token: str = "") -> int:
        """Serve ``/metrics`` on ``host:port`` from a thread; returns the port. With ``token``, a
        scrape without ``authorization: Bearer <token>`` gets 401."""
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        app = make_wsgi_app(self.registry)

        class Server(ThreadingWSGIServer):  # a class per server: its address family is a class attribute
            address_family = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM)[0][0]

        self._server = make_server(host, int(port), _bearer(app, token) if token else app, Server, _Quiet)
        threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True).start()
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _bearer(app: WsgiApp, token: str) -> WsgiApp:
    """``app`` for requests with ``authorization: Bearer <token>`` (compared in constant time); 401 otherwise."""
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        given = str(environ.get("HTTP_AUTHORIZATION", "")).encode()
        if hmac.compare_digest(given, expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"send 'authorization: Bearer <auth_token>'\n"]

    return guarded


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a line each on stderr."""
