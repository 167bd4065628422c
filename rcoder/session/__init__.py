"""Sessions and runs, by job: the turn engine (``turns``), opening a turn's session (``resume``),
a run's events (``runs``), operations on a whole session (``sessions``), a project's files
(``files``), several hosts (``hosts``) and the bounds a turn is kept under (``guards``)."""
