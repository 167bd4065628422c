"""Agents over ACP. The modules here put the sub-packages together: the pool that owns every
agent process (``pool``), starting one and opening its session (``launcher``, with what a
process is started with in ``prepare``), a live agent (``connection``) and an agent's own delete
command (``own_delete``). Below them: ``processes`` (a process and its tree), ``confinement``
(sandbox, limits, uid), ``profiles`` (kinds, homes), ``acp`` (the protocol) and ``files`` (the
daemon's file work where an agent can write); ``tests/test_layers.py`` keeps that order.

The only package that imports ``acp``; it hands the core plain domain types. The SDK is imported
here first, quickly (``acp.sdk``), before any module of the package imports it.
"""

from rcoder.agent.acp.sdk import import_acp

import_acp()
