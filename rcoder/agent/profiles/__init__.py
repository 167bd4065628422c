"""What a profile means for its agent: its kind, its home per project, and how the agent's own
copy of a conversation is erased."""
