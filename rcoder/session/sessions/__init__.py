"""What is done to a whole session besides a turn: fork, delete, rewind, the read-only views of
the session and agent calls, the audit trail, and where projects live."""
