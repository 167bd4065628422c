"""Sessions and runs: the resume decision, live agents, and the events of each turn."""
