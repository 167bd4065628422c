"""An agent's process and its whole tree: spawned (confined, when the profile asks) in a group
of its own, found by its mark, ended as a group, and its leftovers ended at the next start."""
