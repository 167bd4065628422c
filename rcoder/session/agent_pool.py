"""The pool of agent processes now lives in the agent layer (``rcoder.agent.pool``), where
processes are owned. This name stays for code and tests written against the old place."""

from rcoder.agent.pool import AgentPool, Checkout, SlotState

__all__ = ["AgentPool", "Checkout", "SlotState"]
