"""The Agent Client Protocol: our side of it (``client``), the pipes it runs on, and the
converters between the SDK's models and rcoder's domain types. A live agent, its process and its
connection together, is ``rcoder.agent.connection``."""
