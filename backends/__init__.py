"""Attention backends behind one interface (see ``backends.base``)."""

from __future__ import annotations

from backends.base import AttentionBackend, AttentionMetadata, BackendUnavailableError

__all__ = ["AttentionBackend", "AttentionMetadata", "BackendUnavailableError", "get_backend"]


def get_backend(name: str, device: str) -> AttentionBackend:
    """The backend called ``name`` for ``device``; ``auto`` picks the best one available.

    Raises:
        BackendUnavailableError: the backend cannot run here; the message says why.
    """
    if name in ("auto", "torch"):
        from backends.reference import TorchAttentionBackend

        return TorchAttentionBackend()
    raise BackendUnavailableError(
        f"attention backend {name!r} is not built in this version; use --backend torch (or auto)"
    )
