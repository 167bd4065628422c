"""Several hosts on one store (docs/design/hosts.md): this host's leases and its hold on each
session, where a call is served, and the signals that reach a run's owner."""
