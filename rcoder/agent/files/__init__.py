"""The daemon's own file work where an agent can write: paths of a project opened beneath it,
never through a link that leads out (``beneath``), files touched without following the agent's
links (``safe_fs``), and what an agent under its own uid must own (``ownership``)."""
