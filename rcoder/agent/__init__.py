"""Agents over ACP: processes, the client side of the protocol, launching.

The only package that imports ``acp``; it hands the core plain domain types. The SDK is imported
here first, quickly (``sdk``), before any module of the package imports it.
"""

from rcoder.agent.sdk import import_acp

import_acp()
