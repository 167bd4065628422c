"""A run's events: numbered and replayable while it runs (``run``), bounded in bytes
(``event_bytes``), and stored and read back (``history``, ``event_codec``)."""
