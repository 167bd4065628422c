"""Opening a turn's session: the live agent, or one from the pool with its conversation opened
new, resumed or fallen back to a fresh one (docs/design/resume.md)."""
