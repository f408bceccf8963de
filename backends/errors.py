"""The backends' own error, in a module of its own: the engine's error vocabulary re-exports it
without importing torch (the scheduler imports the errors and must stay torch-free)."""

from __future__ import annotations


class BackendUnavailableError(RuntimeError):
    """The requested attention backend cannot run on this machine; the message says why and how to fix it."""
