"""What an agent may reach and use (docs/confinement.md): its sandbox (Landlock rules and the
exec wrapper that applies them, ``confine.c``), its cgroup limits, and the uid it runs as."""
