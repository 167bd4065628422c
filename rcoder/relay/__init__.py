"""``rcoder relay``: one process that owns a project's agents for whichever daemon holds their
sessions, reached over gRPC (docs/relay.md)."""
