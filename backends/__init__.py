"""Attention backends behind one interface (see ``backends.base``); ``get_backend`` picks one."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from backends.errors import BackendUnavailableError

if TYPE_CHECKING:  # (torch is imported only with a backend: the package itself stays light)
    from backends.base import AttentionBackend

__all__ = ["BackendUnavailableError", "get_backend"]

log = logging.getLogger(__name__)


def get_backend(name: str, device: str) -> AttentionBackend:
    """The backend called ``name`` for ``device``.

    ``auto`` is cuda on a GPU when its library is built, else triton there; on a CPU it is
    the C++ library, or the torch reference (with a warning) if that library is not built.

    Raises:
        BackendUnavailableError: an explicitly requested backend cannot run here; the
            message says why and how to fix it.
    """
    if name == "auto":
        return _auto(device)
    if name == "torch":
        from backends.reference import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        if device != "cpu":
            raise BackendUnavailableError(f"the cpu backend runs on CPU tensors, but the device is {device}; "
                                          "use --device cpu or another backend")
        from backends.cpu import CpuAttentionBackend

        return CpuAttentionBackend()
    if name == "cuda":
        from backends.cuda import CudaAttentionBackend, unavailable_reason

        reason = unavailable_reason() if device == "cuda" else f"the device is {device}, not cuda"
        if reason:
            raise BackendUnavailableError(f"the cuda backend cannot run: {reason}")
        return CudaAttentionBackend()
    if name == "triton":
        return _triton(device)
    raise BackendUnavailableError(f"unknown attention backend {name!r}")


def _triton(device: str) -> AttentionBackend:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError("the triton backend needs a CUDA GPU, and torch sees none")
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise BackendUnavailableError("the triton backend needs a GPU (or TRITON_INTERPRET=1, set before start-up, "
                                      "to run its kernels slowly on the CPU for testing)")
    try:
        from backends.triton_attention import TritonAttentionBackend
    except ImportError as exc:
        raise BackendUnavailableError(f"the triton backend needs the triton package: {exc}") from exc
    return TritonAttentionBackend()


def _auto(device: str) -> AttentionBackend:
    if device == "cuda":
        from backends.cuda import unavailable_reason

        reason = unavailable_reason()
        if reason is None:
            return get_backend("cuda", device)
        log.warning("backend auto: cuda unavailable (%s); using triton", reason)
        return _triton(device)
    try:
        return get_backend("cpu", device)
    except BackendUnavailableError as exc:
        log.warning("backend auto: %s; falling back to the (slow) torch reference backend", exc)
        return get_backend("torch", device)
