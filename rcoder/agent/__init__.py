"""Agents over ACP: processes, the client side of the protocol, launching.

The only package that imports ``acp``; it hands the core plain domain types.
"""
