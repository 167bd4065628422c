"""The turn engine: a turn taken in (``intake``), queued or refused, its session opened, its
prompt sent, its end written, and what a cancel, a timeout or a lost lease does to it on the way
(docs/design/turn.md)."""
