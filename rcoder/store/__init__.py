"""Durable records: sessions, runs and transcripts."""

from rcoder.store.base import SessionStore

__all__ = ["SessionStore"]
